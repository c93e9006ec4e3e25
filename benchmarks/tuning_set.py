"""The tuning set: the cases the next-use model's choices are tried on, never the ones reported.

The seed-0 zoo (eight workloads) and the three chat tapes of ``chat_tapes.py``, each at pool
multipliers 2 and 3 without the pressure preflight: 22 cases, lru / agentkv / belady. Tune here;
report on the seed-1 zoo (``agentkv bench replay --seed 1``) and the held-out tapes
(``holdout_tapes.py``), which no choice was made on (docs/benchmarks.md).

    .venv/bin/python benchmarks/tuning_set.py run .build/tune/base     # writes the tapes on first use; ~40 s
    AGENTKV_...=... .venv/bin/python benchmarks/tuning_set.py run .build/tune/variant
    .venv/bin/python benchmarks/tuning_set.py compare .build/tune/base .build/tune/variant

``compare`` prints, per case, the share of the LRU -> Belady gap agentkv closes and its history
hit rate against LRU's (points), for every run given, then the means over the cases.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from agentkv.bench.report import index_results

WORKLOADS = ("pipeline", "debate", "selector", "random", "teams", "multi-app", "heavy-tools", "abandoned")
TAPES = Path(".build/tune/tapes")


def tapes() -> list[Path]:
    """The tuning set's tapes, written once (a tape depends on its seed alone)."""
    paths = [TAPES / f"{workload}-s0.jsonl" for workload in WORKLOADS]
    for workload, path in zip(WORKLOADS, paths, strict=True):
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "agentkv", "bench", "tape", "--workload", workload, "--seed", "0",
                            "-o", str(path)], check=True)
    chat = [Path(".build/chat") / f"chat-mine-{seed}.jsonl" for seed in (0, 1, 2)]
    if not all(path.exists() for path in chat):
        subprocess.run([sys.executable, str(Path(__file__).with_name("chat_tapes.py"))], check=True)
    return paths + chat


def run(out: Path) -> None:
    subprocess.run([sys.executable, "-m", "agentkv", "bench", "replay", *map(str, tapes()),
                    "--policies", "lru,agentkv,belady", "--multipliers", "2,3", "--no-preflight",
                    "--out", str(out), "--quiet"], check=True)
    print(f"wrote {out / 'replay.json'}")


def _results(directory: Path) -> dict[tuple[str, int, str], dict[str, Any]]:
    return index_results(json.loads((directory / "replay.json").read_text())["results"])


def compare(directories: list[Path]) -> None:
    runs = [_results(directory) for directory in directories]
    base = runs[0]
    cases = sorted({(tape, capacity) for tape, capacity, _ in base})
    closed_sum = [0.0] * len(runs)
    history_sum = [0.0] * len(runs)
    names = " | ".join(directory.name for directory in directories)
    print(f"case                    lru  belady | {names}  (closed, history - lru)")
    for tape, capacity in cases:
        lru, belady = base[(tape, capacity, "lru")], base[(tape, capacity, "belady")]
        gap = belady["hit_rate"] - lru["hit_rate"]
        row = f"{tape:16s} {capacity:5d} {100 * lru['hit_rate']:5.1f}  {100 * belady['hit_rate']:5.1f} |"
        for i, results in enumerate(runs):
            agentkv = results[(tape, capacity, "agentkv")]
            closed = (agentkv["hit_rate"] - lru["hit_rate"]) / gap if gap > 1e-3 else 0.0
            history = agentkv["history_hit_rate"] - lru["history_hit_rate"]
            closed_sum[i] += closed
            history_sum[i] += history
            row += f" {100 * closed:6.1f}% {100 * history:+5.1f}"
        print(row)
    print("mean closed  " + "  ".join(f"{100 * s / len(cases):.2f}%" for s in closed_sum)
          + "   mean history - lru  " + "  ".join(f"{100 * s / len(cases):+.2f}" for s in history_sum))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("run", help="replay the tuning set into DIR").add_argument("out", type=Path)
    commands.add_parser("compare", help="agentkv's closed gap and history per case, run by run").add_argument(
        "runs", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "run":
        run(args.out)
    else:
        compare(args.runs)


if __name__ == "__main__":
    main()
