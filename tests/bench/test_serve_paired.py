"""Paired-block comparisons: bootstrap intervals, verdicts, block sizes, core swapping."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from agentkv.bench.serve import block_sizes
from agentkv.bench.serve_paired import Block, compare, comparison_lines, core_pair, pin_env, swap_cores, verdict


def _block(ttft: list[float], turns: int = 4, wall: float = 2.0, hits: float = 50, queries: float = 100) -> Block:
    return Block(np.array(ttft), np.array([t + 100 for t in ttft]), turns, wall, hits, queries)


def test_identical_servers_are_the_same():
    rng = np.random.default_rng(3)
    pairs = []
    for _ in range(10):
        same = _block(list(rng.uniform(50, 150, 8)))
        pairs.append((same, same))
    result = compare(pairs)
    assert result["blocks"] == 10
    assert result["ttft_mean"] == {"value": 1.0, "low": 1.0, "high": 1.0}
    assert result["hit_rate"]["value"] == 0.0
    assert verdict(result["ttft_mean"], neutral=1.0, lower_is_better=True) == "the same"


def test_an_interval_within_the_tolerance_is_the_same_not_worse():
    """An open-loop run's throughput is set by the arrival rate: 1.00x [0.997, 0.999] is no loss."""
    effect = {"value": 0.998, "low": 0.997, "high": 0.999}
    assert verdict(effect, neutral=1.0, lower_is_better=False) == "worse"
    assert verdict(effect, neutral=1.0, lower_is_better=False, tolerance=0.01) == "the same"
    assert verdict({"value": 0.98, "low": 0.97, "high": 0.999}, neutral=1.0, lower_is_better=False,
                   tolerance=0.01) == "worse"
    assert verdict({"value": 1.0, "low": 0.98, "high": 1.005}, neutral=1.0, lower_is_better=False,
                   tolerance=0.01) == "inside the noise"


def test_a_consistent_gain_is_called_better_and_pooled_exactly():
    rng = np.random.default_rng(0)
    pairs = []
    for _ in range(12):
        base = list(rng.uniform(80, 120, 10))
        pairs.append((_block(base, hits=40), _block([0.7 * t for t in base], hits=55)))
    result = compare(pairs)
    assert result["ttft_mean"]["value"] == pytest.approx(0.7)
    assert result["ttft_mean"]["high"] == pytest.approx(0.7)  # every block has the same ratio
    assert result["hit_rate"]["value"] == pytest.approx(15.0)
    assert result["throughput"]["value"] == pytest.approx(1.0)
    lines = comparison_lines(0.5, result)
    assert lines[0] == "arrival rate 0.5/s, agentkv vs vanilla, 12 paired blocks (95% bootstrap intervals):"
    assert lines[1].split() == ["mean", "TTFT", "0.70x", "[0.70,", "0.70]", "better"]
    assert lines[-1].split()[-1] == "better" and "+15.0 points" in lines[-1]
    assert "the same (within 1%)" in lines[5]  # throughput: 1.00x in every block


def test_noisy_blocks_give_an_interval_around_the_point():
    rng = np.random.default_rng(1)
    pairs = [(_block(list(rng.uniform(50, 300, 6))), _block(list(rng.uniform(50, 300, 6)))) for _ in range(6)]
    effect = compare(pairs)["ttft_mean"]
    assert effect["low"] < effect["value"] < effect["high"]
    assert verdict({"value": 1.3, "low": 1.1, "high": 1.5}, neutral=1.0, lower_is_better=True) == "worse"
    assert verdict({"value": 1.3, "low": 1.1, "high": 1.5}, neutral=1.0, lower_is_better=False) == "better"


def test_a_single_block_has_no_interval():
    effect = compare([(_block([100.0]), _block([50.0]))])["ttft_mean"]
    assert effect["value"] == 0.5 and math.isnan(effect["low"]) and math.isnan(effect["high"])
    assert verdict(effect, neutral=1.0, lower_is_better=True) == "inside the noise"


def test_block_sizes_split_the_sessions():
    assert block_sizes(16, 4) == [4, 4, 4, 4]
    assert block_sizes(10, 4) == [4, 4, 2]
    assert block_sizes(2, 4) == [2]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_swap_cores_moves_pinned_threads_of_the_group_only():
    a, b = core_pair()
    assert a != b and pin_env(a) == {"VLLM_CPU_OMP_THREADS_BIND": str(a)}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    floating = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        os.sched_setaffinity(child.pid, {a})
        assert swap_cores([child.pid], (a, b)) == 1
        assert os.sched_getaffinity(child.pid) == {b}
        assert swap_cores([child.pid], (a, b)) == 1
        assert os.sched_getaffinity(child.pid) == {a}
        assert swap_cores([floating.pid], (a, b)) == 0  # may run anywhere: left alone
        assert len(os.sched_getaffinity(floating.pid)) >= 2
    finally:
        for process in (child, floating):
            process.kill()
            process.wait()


def test_the_demo_says_plainly_when_the_difference_is_inside_the_noise():
    from agentkv.demo import _verdict

    rng = np.random.default_rng(2)
    noisy = compare([(_block(list(rng.uniform(50, 300, 6))), _block(list(rng.uniform(50, 300, 6))))
                     for _ in range(6)])
    lines = _verdict({"comparisons": [{"rate": 0.15, "setup": "single", "server": "agentkv", **noisy}]})
    assert lines[0].startswith("arrival rate 0.15/s, agentkv vs vanilla, 6 paired blocks")
    assert lines[-1].startswith("  => mean TTFT: the difference (") and "inside the noise" in lines[-1]
    clear = compare([(_block([100.0, 120.0]), _block([60.0, 72.0])) for _ in range(5)])
    lines = _verdict({"comparisons": [{"rate": 0.15, "setup": "single", "server": "agentkv", **clear}]})
    assert lines[-1] == "  => mean TTFT: agentkv is better than vanilla (0.60x, 95% CI 0.60-0.60)"


def test_the_warmup_variant_is_also_compared_with_agentkv_alone():
    """What the warm-ups add on top of the eviction policy: agentkv+warmup against agentkv, paired."""
    from agentkv.bench.serve.report import comparison_report
    from agentkv.bench.serve.run import _comparisons

    def blocks(scale: float, hits: float) -> list[Block]:
        return [_block([scale * t for t in (100.0, 120.0)], hits=hits) for _ in range(4)]

    result = {"comparisons": _comparisons({(0.5, "single", "vanilla"): blocks(1.0, 30),
                                           (0.5, "single", "agentkv"): blocks(0.9, 55),
                                           (0.5, "single", "agentkv+warmup"): blocks(0.72, 60)}, seed=0)}
    effects = {(c["server"], c["baseline"]): (c["ttft_mean"]["value"], c["hit_rate"]["value"])
               for c in result["comparisons"]}
    assert effects == {("agentkv", "vanilla"): (pytest.approx(0.9), pytest.approx(25.0)),
                       ("agentkv+warmup", "vanilla"): (pytest.approx(0.72), pytest.approx(30.0)),
                       ("agentkv+warmup", "agentkv"): (pytest.approx(0.8), pytest.approx(5.0))}
    headings = [line for line in comparison_report(result) if line.startswith("arrival rate")]
    assert [h.split(",")[1].strip() for h in headings] == [
        "agentkv vs vanilla", "agentkv+warmup vs vanilla", "agentkv+warmup vs agentkv"]


def test_the_report_tells_what_became_of_the_warmups():
    from agentkv.bench.serve.report import warmup_lines

    warmups = {"sent": 29, "failed": 0, "dropped": 0, "skipped_resident": 145, "skipped_costly": 14,
               "fallback_room_unknown": 1, "server_sent": 29, "server_useful": 21, "server_wasted": 6,
               "server_redundant": 2, "server_lead_le_1": 13}
    rows = [{"rate": 0.5, "setup": "single", "server": "agentkv"},
            {"rate": 0.5, "setup": "single", "server": "agentkv+warmup", "warmups": warmups},
            {"rate": 0.5, "setup": "kv_aware/session", "server": "agentkv+warmup", "warmups": {"sent": 0}}]
    assert warmup_lines({"rows": rows}) == [
        "agentkv+warmup at 0.5 sessions/s: warm-ups sent 29 (useful 21, wasted 6, redundant 2, as the server "
        "saw them); decisions skipped: resident 145, costly 14",
        "agentkv+warmup kv_aware/session at 0.5 sessions/s: warm-ups sent 0"]
