"""``agentkv bench serve`` behind real routers: counters summed over the replicas, session events
fanned out to every replica, and the routing key deciding where an agent's calls go."""

from __future__ import annotations

import httpx
import pytest

from agentkv.bench import serve
from agentkv.bench.serve_args import ServeConfig
from agentkv.cluster import Cluster
from agentkv.protocol import STATS_PATH

pytestmark = pytest.mark.server


def _stats(cluster: Cluster) -> list[dict]:
    return [httpx.get(url + STATS_PATH, trust_env=False, timeout=10).json() for url in cluster.replica_urls]


def _run(cluster: Cluster, url: str, setup: str, tmp_path) -> tuple[dict, list[dict], list[dict]]:
    urls = tuple(cluster.replica_urls)
    config = ServeConfig(rates=[4.0], sessions=3, warmup_sessions=0, turns=4, tool_gap=0.05, concurrency=3,
                         out=tmp_path, replicas=2)
    before = _stats(cluster)
    result = serve.run_benchmark(config, targets=[serve.Target("agentkv", url, urls, urls, setup)], log=lambda _: None)
    (row,) = result["rows"]
    return row, before, _stats(cluster)


def test_routed_run_sums_the_replicas_and_every_replica_hears_every_session_end(cluster, tmp_path):
    row, before, after = _run(cluster, cluster.url, "kv_aware/session", tmp_path)
    assert (row["setup"], row["turns"], row["errors"], row["failed_sessions"]) == ("kv_aware/session", 12, 0, 0)
    assert 0 <= row["hit_rate"] <= 1 and row["prompt_tokens"] > 12 * 500
    assert len(row["engine_share"]) == 2 and sum(row["engine_share"]) == pytest.approx(1.0)
    queried = sum(a["queries"] for st in after for a in st["agents"].values()) - sum(
        a["queries"] for st in before for a in st["agents"].values())
    assert queried >= row["prompt_tokens"]  # the tagged calls reached the replicas (a preempted one counts twice)
    for old, new in zip(before, after, strict=True):
        assert new["sessions"]["ended"] - old["sessions"]["ended"] == 3  # fanned out, not routed


def test_agent_routing_key_keeps_each_agent_on_one_replica_under_consistent_hash(cluster, tmp_path):
    router = cluster.add_router("consistent_hash")
    row, before, after = _run(cluster, router, "consistent_hash/agent", tmp_path)
    assert (row["turns"], row["errors"]) == (12, 0)
    served = {}
    for replica, (old, new) in enumerate(zip(before, after, strict=True)):
        for agent, totals in new["agents"].items():
            if totals["queries"] > old["agents"].get(agent, {}).get("queries", 0):
                served.setdefault(agent, set()).add(replica)
    assert "supervisor" in served and all(len(replicas) == 1 for replicas in served.values()), served
