"""Cluster configuration without starting anything: validation, router command lines, core slices."""

from __future__ import annotations

import pytest

from agentkv import cluster as cluster_module
from agentkv.cluster import Cluster, ClusterConfig

ARGS = ["--block-size", "32", "--served-model-name", "tiny"]


def test_config_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="unknown router policy"):
        ClusterConfig("m", policy="least_loaded", vllm_args=ARGS)
    with pytest.raises(ValueError, match="--block-size"):
        ClusterConfig("m", policy="kv_aware")
    with pytest.raises(ValueError, match="--host and --port"):
        ClusterConfig("m", vllm_args=[*ARGS, "--port", "8000"])
    config = ClusterConfig("m", policy="consistent_hash")  # no block size needed
    with pytest.raises(ValueError, match="--block-size"):
        config.check_policy("kv_aware")


def test_router_command_lines(tmp_path):
    cluster = Cluster(ClusterConfig("m", replicas=2, vllm_args=ARGS, log_dir=tmp_path))
    kv = cluster._router("kv_aware", 9000).spec.command(9000)
    for url, port in zip(cluster.replica_urls, cluster.event_ports, strict=True):
        assert f"{url}=tcp://127.0.0.1:{port}" in kv
    assert kv[kv.index("--kv-event-model") + 1] == "tiny" and kv[kv.index("--kv-event-block-size") + 1] == "32"
    assert kv[kv.index("--prometheus-host") + 1] == "127.0.0.1"  # never the shared default port 29000
    other = cluster._router("consistent_hash", 9001, ["--request-timeout-secs", "5"]).spec.command(9001)
    assert "--kv-event-source" not in other and other[-2:] == ["--request-timeout-secs", "5"]
    assert other[other.index("--prometheus-port") + 1] != kv[kv.index("--prometheus-port") + 1]


def test_each_cpu_replica_gets_its_own_cores(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(cluster_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert [cluster_module._cpu_binding(i, 2) for i in range(2)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}, {"VLLM_CPU_OMP_THREADS_BIND": "2,3"}]
    assert cluster_module._cpu_binding(4, 8) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}  # more replicas than cores
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "3")
    assert cluster_module._cpu_binding(0, 2) == {}  # the user's binding wins
