"""The stats document is cheap to poll: reused for a short while, rebuilt after new facts."""

from __future__ import annotations

from collections import Counter

from vllm.v1.core.kv_cache_utils import KVCacheBlock

import server_patch._runtime as runtime_module
from agentkv.protocol import AgentTag
from server_patch._runtime import AgentKVRuntime
from server_patch._tracker import BlockTracker


def test_stats_are_reused_briefly_and_rebuilt_after_events_or_expiry(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(runtime_module.time, "monotonic", lambda: now[0])
    runtime = AgentKVRuntime()
    first = runtime.stats()
    runtime.tagged_requests = 7
    assert runtime.stats() is first  # younger than STATS_MAX_AGE: the same document
    now[0] += runtime_module.STATS_MAX_AGE
    second = runtime.stats()
    assert second is not first and second["tagged_requests"] == 7
    payload = {"version": 1, "events": [{"type": "graph", "id": "g1", "nodes": ["a", "b"], "edges": [["a", "b"]]}]}
    assert runtime.handle({"op": "events", "payload": payload})["accepted"] == 1
    assert runtime.stats()["facts"]["edges"] == [["a", "b"]]  # a new fact is seen at once
    export = {"format": "agentkv.transition-counts", "version": 1, "replica": "peer", "epoch": "e", "sequence": 1,
              "agents": ["a", "b"], "counts": [[0, 1], [0, 0]], "entry": [0, 0], "ends": [0, 0]}
    assert runtime.handle({"op": "merge", "payload": export}) == {"merged": True}
    assert runtime.stats()["learner"]["peers"] == {"peer": 1}  # ... and so is a merge


def test_blocks_by_agent_counts_every_tracked_block_that_holds_a_hash():
    tracker = BlockTracker()
    planner, coder = [KVCacheBlock(i) for i in (10, 11, 12)], [KVCacheBlock(i) for i in (20, 21)]
    tracker.cached(planner, 0, 3, AgentTag("planner", "s1"), 2)
    tracker.cached(coder, 0, 2, AgentTag("coder", "s2"), 1)
    tracker.hit(planner[:2], AgentTag("coder", "s2"), 2)  # planner's anchor now shared with coder
    assert tracker.blocks_by_agent(lambda block_id: True) == {
        "planner": Counter({"anchor": 2, "history": 1}),
        "coder": Counter({"anchor": 3, "history": 1}),
    }
    # evicted (the pool dropped the hash): its entry stays, uncounted, until the block is cached again
    assert tracker.blocks_by_agent(lambda block_id: block_id != 21) == {
        "planner": Counter({"anchor": 2, "history": 1}),
        "coder": Counter({"anchor": 3}),
    }
