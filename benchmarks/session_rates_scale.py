"""The history sums of a full evaluation at scale: gathered per session or taken per chain row.

``_over_steps`` (agentkv/graph/_session_rates.py) sums each live session's first-passage
probabilities over the steps looked ahead. Gathering the table's slice per session copies
sessions x K x agents floats; past ``_GATHER_LIMIT`` entries it takes one product per distinct
row instead. This times both ways on random tables (the same arrays each way; µs of thread CPU
time, the best of ``--repeats``) and the peak memory each allocates, so that the limit sits at
the crossover:

    .venv/bin/python benchmarks/session_rates_scale.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from unittest import mock

import numpy as np

from agentkv.graph import _session_rates

CASES = ((24, 100), (64, 500), (256, 200), (128, 1000), (256, 500), (256, 5000), (256, 10000))  # (agents, sessions)
STEPS = 24  # the learned horizon's most


def timed(limit: float, weights: np.ndarray, table: np.ndarray, rows: np.ndarray, repeats: int) -> tuple[float, int]:
    """(best µs, peak bytes) of one ``_over_steps`` call with ``_GATHER_LIMIT`` at ``limit``."""
    with mock.patch.object(_session_rates, "_GATHER_LIMIT", limit):
        best = float("inf")
        for _ in range(repeats):
            start = time.thread_time()
            _session_rates._over_steps(weights, table, rows)
            best = min(best, time.thread_time() - start)
        tracemalloc.start()
        _session_rates._over_steps(weights, table, rows)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return best * 1e6, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"_GATHER_LIMIT = {_session_rates._GATHER_LIMIT:,} entries; K = {STEPS}")
    print("| agents | sessions | entries gathered | gathered µs | per row µs | gathered MiB | per row MiB | taken |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for agents, sessions in CASES:
        table = rng.random((agents, STEPS, agents))
        rows = np.concatenate([rng.integers(0, agents, sessions), np.arange(agents)]).astype(np.intp)
        weights = rng.random((STEPS, len(rows)))
        gathered, gathered_peak = timed(float("inf"), weights, table, rows, args.repeats)
        grouped, grouped_peak = timed(0, weights, table, rows, args.repeats)
        entries = len(rows) * STEPS * agents
        taken = "per row" if entries > _session_rates._GATHER_LIMIT else "gathered"
        print(f"| {agents} | {sessions} | {entries:,} | {gathered:,.0f} | {grouped:,.0f} | "
              f"{gathered_peak / 2**20:.1f} | {grouped_peak / 2**20:.1f} | {taken} |")


if __name__ == "__main__":
    main()
