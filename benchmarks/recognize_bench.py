"""Cost of recognizing one untagged request: ``python benchmarks/recognize_bench.py``.

Six agents (64-token shared preamble + 900-1650-token anchors, as the replay tapes), sessions
of 12 calls whose history grows by ~150 tokens a call, block size 16; block hashes are
precomputed (vLLM computes them anyway), so the time is recognition's own: the prefix-tree
walk, the preamble check, history chunking and the session lookup.
"""

from __future__ import annotations

import random
import statistics
import time

from server_patch._recognize import Recognizer

BS = 16
ANCHORS = {"supervisor": 1000, "planner": 1150, "researcher": 1500, "coder": 1650, "reviewer": 1100, "writer": 900}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30_000) for _ in range(n)]


def _hashes(tokens: list[int]) -> list[int]:
    out, parent = [], 0
    for start in range(0, len(tokens) - BS + 1, BS):
        parent = hash((parent, tuple(tokens[start : start + BS])))
        out.append(parent)
    return out


def workload(sessions: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    preamble = _tokens(rng, 64)
    anchors = {a: preamble + _tokens(rng, n) for a, n in ANCHORS.items()}
    names = list(ANCHORS)
    live: list[list[int]] = []
    calls = []
    for _ in range(sessions):
        live.append(_tokens(rng, 200))
        for history in live[-4:]:  # four sessions interleave
            for _ in range(3):
                prompt = anchors[rng.choice(names)] + history
                calls.append((prompt, _hashes(prompt)))
                history += _tokens(rng, rng.randrange(60, 220))
    return calls


def main() -> None:
    calls = workload(200)
    runs = []
    for _ in range(3):
        recognizer = Recognizer()
        started = time.process_time()  # CPU time: the machine may be shared
        for i, (prompt, hashes) in enumerate(calls):
            recognizer.recognize(f"r{i}", hashes, prompt, BS)
        runs.append((time.process_time() - started) / len(calls) * 1e6)
    stats = recognizer.stats()
    print(f"{len(calls)} requests, mean prompt {statistics.fmean(len(p) for p, _ in calls):.0f} tokens: "
          f"{statistics.median(runs):.1f} us per request (median of 3: {', '.join(f'{r:.1f}' for r in runs)}); "
          f"recognized {stats['recognized_requests']}, sessions {stats['sessions']}, tree nodes {stats['tree_nodes']}")


if __name__ == "__main__":
    main()
