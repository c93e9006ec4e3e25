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


def closed(plan: TapePlan, blocks: int, ranking: str = "agentkv") -> float:
    """The share of the LRU -> Belady gap policy ``ranking`` closes."""
    lru, agentkv, belady = (replay(plan, policy, blocks).hit_rate for policy in ("lru", ranking, "belady"))
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


def test_calls_that_name_their_agent_alone_are_ranked_a_minute_apart_as_a_second_apart(selector):
    """Agent-only tags and recognition off: no session, so no gap is learned, and the recency term
    counted seconds: at 60 times the tape's times agentkv closed 8% of the LRU -> Belady gap here (74%
    at the tape's own times). Its time unit is the pace of calls now: 82%."""
    plan = TapePlan(selector)
    blocks = 2 * plan.max_request_blocks + 1
    policy = "agentkv-agent-only-no-recognition"
    fast, slow = closed(plan, blocks, policy), closed(stretched(selector, 60.0), blocks, policy)
    assert fast > 0.6
    assert slow > fast - 0.1
