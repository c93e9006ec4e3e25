"""Paired comparisons for ``agentkv bench serve`` that survive a noisy machine.

The servers run one at a time, in short alternating blocks (ABAB..., the order flipping every
block), so both see the same background load; each server's engine has a core of its own
(``VLLM_CPU_OMP_THREADS_BIND``: vLLM's CPU threads spin-wait, so two engines sharing cores
distort each other), and halfway through each rate's blocks the cores are swapped
(:func:`swap_cores`), so neither server keeps the better core. Every ratio agentkv/vanilla comes
with a 95% bootstrap confidence interval that resamples whole blocks, both servers' calls of a
block together (:func:`compare`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["METRICS", "SAME_POINTS", "SAME_RATIO", "Block", "Swap", "compare", "comparison_lines", "core_pair",
           "pin_env", "swap_cores", "verdict"]

CORE_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESAMPLES = 4000

Swap = Callable[[], int]  # swaps the engines' cores, returns the number of threads moved


def core_pair() -> tuple[int, int]:
    """Two different cores for two servers (the same one twice on a one-core machine)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return cores[0], cores[-1]


def pin_env(core: int) -> dict[str, str]:
    """The environment that binds a vLLM CPU engine's threads to ``core``."""
    return {CORE_ENV: str(core)}


def swap_cores(groups: Sequence[int], cores: tuple[int, int]) -> int:
    """Move every thread of the process groups ``groups`` bound to exactly one of ``cores`` onto
    the other (threads that may run anywhere stay as they are); returns how many moved. Linux only
    (``/proc``); elsewhere nothing moves."""
    a, b = cores
    moved = 0
    for pid in _group_members(set(groups)):
        for tid in _threads(pid):
            try:
                current = os.sched_getaffinity(tid)
                if current in ({a}, {b}):
                    os.sched_setaffinity(tid, {b} if current == {a} else {a})
                    moved += 1
            except OSError:  # the thread ended meanwhile
                continue
    return moved


def _group_members(groups: set[int]) -> list[int]:
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) in groups:  # fields after the command: state, ppid, pgrp, ...
            members.append(int(entry.name))
    return members


def _threads(pid: int) -> list[int]:
    try:
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return []


@dataclass(frozen=True)
class Block:
    """One block of sessions on one server: its calls' TTFT and turn latency (ms), agent turns,
    wall time (s) and prefix-cache counter deltas (tokens)."""

    ttft: np.ndarray
    turn: np.ndarray
    turns: int
    wall: float
    hits: float
    queries: float

    @classmethod
    def of(cls, run: Any) -> Block:
        """From a :class:`agentkv.bench.serve.RateRun`."""
        done = [r for r in run.records if r.error is None and r.ttft is not None and r.latency is not None]
        return cls(np.array([r.ttft * 1000 for r in done]), np.array([r.latency * 1000 for r in done]),
                   len(done), run.wall, run.hits, run.queries)


def _pooled(blocks: Sequence[Block], name: str) -> float:
    if name == "throughput":
        wall = sum(b.wall for b in blocks)
        return sum(b.turns for b in blocks) / wall if wall else math.nan
    if name == "hit_rate":
        queries = sum(b.queries for b in blocks)
        return sum(b.hits for b in blocks) / queries if queries else math.nan
    values = np.concatenate([b.ttft if name.startswith("ttft") else b.turn for b in blocks])
    if not len(values):
        return math.nan
    if name.endswith("mean"):
        return float(values.mean())
    # nearest rank, as the table's rows (``stats._percentile``): the ratio compares what the table shows
    return float(np.percentile(values, 50 if name.endswith("p50") else 99, method="inverted_cdf"))


# A 95% interval this close to no difference says the servers are the same on that metric (an
# open-loop run's throughput is set by the arrival rate: 1.00x [0.998, 0.999] is not "worse").
SAME_RATIO = 0.01
SAME_POINTS = 0.5
# (key, label): ratios compared / baseline (e.g. agentkv / vanilla), except hit rate (a difference in points)
METRICS = (("ttft_mean", "mean TTFT"), ("ttft_p50", "p50 TTFT"), ("ttft_p99", "p99 TTFT"),
           ("turn_mean", "mean turn latency"), ("throughput", "throughput"), ("hit_rate", "hit rate"))


def compare(pairs: Sequence[tuple[Block, Block]], *, seed: int = 0, resamples: int = RESAMPLES) -> dict[str, Any]:
    """``pairs``: (baseline block, compared block) with the same sessions, e.g. (vanilla, agentkv).
    For each metric: the pooled ratio compared/baseline (hit rate: difference in points) and its 95%
    percentile-bootstrap interval, resampling pairs with replacement. One pair gives the point and a
    NaN interval."""
    rng = np.random.default_rng(seed)
    n = len(pairs)
    draws = rng.integers(0, n, size=(resamples, n)) if n > 1 else np.zeros((0, n), dtype=int)
    out: dict[str, Any] = {"blocks": n}
    for key, _ in METRICS:

        def effect(index: Sequence[int] | np.ndarray, key: str = key) -> float:
            base = _pooled([pairs[i][0] for i in index], key)
            ours = _pooled([pairs[i][1] for i in index], key)
            return 100 * (ours - base) if key == "hit_rate" else (ours / base if base else math.nan)

        point = effect(range(n))
        samples = np.array([effect(row) for row in draws]) if len(draws) else np.array([])
        samples = samples[~np.isnan(samples)]
        low, high = (np.percentile(samples, [2.5, 97.5]).tolist() if len(samples) else [math.nan, math.nan])
        out[key] = {"value": point, "low": low, "high": high}
    return out


def verdict(effect: dict[str, float], *, neutral: float, lower_is_better: bool, tolerance: float = 0.0) -> str:
    """'better', 'worse', 'inside the noise' (the interval holds ``neutral``, or is unknown) or
    'the same' (the whole interval within ``tolerance`` of ``neutral``: a difference too small to matter)."""
    low, high = effect["low"], effect["high"]
    if math.isnan(low):
        return "inside the noise"
    if neutral - tolerance <= low and high <= neutral + tolerance:
        return "the same"
    if low <= neutral <= high:
        return "inside the noise"
    return "better" if (high < neutral) == lower_is_better else "worse"


def comparison_lines(rate: float, result: dict[str, Any], name: str = "agentkv", baseline: str = "vanilla"
                     ) -> list[str]:
    """Human-readable lines: every metric with its interval and whether it is more than noise."""
    lines = [f"arrival rate {rate:g}/s, {name} vs {baseline}, {result['blocks']} paired blocks "
             "(95% bootstrap intervals):"]
    for key, label in METRICS:
        effect = result[key]
        if key == "hit_rate":
            text = f"{effect['value']:+.1f} points [{effect['low']:+.1f}, {effect['high']:+.1f}]"
            call = verdict(effect, neutral=0.0, lower_is_better=False, tolerance=SAME_POINTS)
            same = f"the same (within {SAME_POINTS:g} points)"
        else:
            text = f"{effect['value']:.2f}x [{effect['low']:.2f}, {effect['high']:.2f}]"
            call = verdict(effect, neutral=1.0, lower_is_better=key != "throughput", tolerance=SAME_RATIO)
            same = f"the same (within {SAME_RATIO:.0%})"
        lines.append(f"  {label:18s} {text:24s} {same if call == 'the same' else call}")
    return lines

