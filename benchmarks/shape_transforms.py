"""Reshaped copies of tapes: the same workload with other anchor or history sizes, or denser sessions.

Looks for shapes on which the server-only policy falls back toward (or below) LRU, as session 42's
time scaling did (docs/benchmarks.md "Other shapes of the same workloads"). Per input tape, four
copies next to each other in OUT:

* ``-a8`` / ``-a025``: every anchor segment (``anchor/...``) 8 and 0.25 times as long (tool-heavy
  system prompts of ~10k tokens; one-line ones);
* ``-h4``: every other segment and every output 4 times as long (long conversations);
* ``-dense4``: sessions start 4 times as densely (each session's first ``t`` divided by 4, its
  own pace kept), so 4 times as many are live at once.

    python benchmarks/shape_transforms.py OUT TAPE...
    agentkv bench replay OUT/*.jsonl --policies lru,agentkv,belady --multipliers 2,3 --no-preflight
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from agentkv.bench.tape.format import Tape, read_tape, segment_kind, write_tape


def resized(tape: Tape, anchor: float, history: float) -> Tape:
    """Anchor segments times ``anchor``, every other segment and the outputs times ``history``."""
    def size(key: str, tokens: int) -> int:
        return max(1, round(tokens * (anchor if segment_kind(key) == "anchor" else history)))

    requests = [dataclasses.replace(r, segments=tuple((key, size(key, n)) for key, n in r.segments),
                                    output_tokens=max(1, round(r.output_tokens * history)))
                for r in tape.requests]
    return dataclasses.replace(tape, requests=requests)


def denser(tape: Tape, factor: float) -> Tape:
    """Sessions start ``factor`` times as densely; within a session every ``t`` keeps its offset from
    the session's first, and the tool gaps stay, so a session's own pace is unchanged."""
    first: dict[str, float] = {}
    requests = []
    for r in tape.requests:
        start = first.setdefault(r.session, r.t)
        requests.append(dataclasses.replace(r, t=start / factor + (r.t - start)))
    requests.sort(key=lambda r: r.t)
    return dataclasses.replace(tape, requests=requests)


def main(out: Path, paths: list[str]) -> None:
    for path in paths:
        tape, name = read_tape(path), Path(path).stem
        for suffix, reshaped in (("a8", resized(tape, 8, 1)), ("a025", resized(tape, 0.25, 1)),
                                 ("h4", resized(tape, 1, 4)), ("dense4", denser(tape, 4))):
            write_tape(reshaped, out / f"{name}-{suffix}.jsonl")
            print(f"wrote {out / f'{name}-{suffix}.jsonl'}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2:])
