"""The eviction order does not depend on the workload's unit of time (a real KVCacheManager, the
server's runtime): the recency tie-break counts age in learned time resolutions, not seconds."""

from __future__ import annotations

import dataclasses

import pytest

from agentkv.bench.plan import TapePlan
from agentkv.bench.replay import replay
from agentkv.bench.tape import Tape, WorkloadConfig, generate


def stretched(tape: Tape, factor: float) -> TapePlan:
    """``tape`` with every arrival time and tool gap ``factor`` times longer (calls minutes apart)."""
    requests = [dataclasses.replace(r, t=r.t * factor, tool_gap=r.tool_gap * factor) for r in tape.requests]
    return TapePlan(Tape(dict(tape.header), requests))


@pytest.fixture(scope="module")
def selector() -> Tape:
    return generate(WorkloadConfig(topology="selector", sessions=16, seed=3))


def closed(plan: TapePlan, blocks: int) -> float:
    """The share of the LRU -> Belady gap agentkv closes."""
    lru, agentkv, belady = (replay(plan, policy, blocks).hit_rate for policy in ("lru", "agentkv", "belady"))
    assert belady - lru > 0.1  # room to rank at this capacity
    return (agentkv - lru) / (belady - lru)


def test_agentkv_ranks_a_workload_whose_calls_come_minutes_apart_as_one_whose_calls_come_seconds_apart(selector):
    """At 100 times the tape's times (tool calls of minutes, hand-offs of 30 s), a recency term per
    second buried every value under its blocks' age: agentkv evicted almost as LRU (13% of the LRU ->
    Belady gap closed here, 83% at the tape's own times; now 90%)."""
    plan = TapePlan(selector)
    blocks = 2 * plan.max_request_blocks + 1
    fast, slow = closed(plan, blocks), closed(stretched(selector, 100.0), blocks)
    assert fast > 0.6
    assert slow > fast - 0.1
