"""Cluster configuration and start-up without vLLM: validation, router command lines, core slices, lost ports."""

from __future__ import annotations

import sys
import time

import pytest

from agentkv import cluster as cluster_module
from agentkv.cluster import Cluster, ClusterConfig
from agentkv.launcher import Command, PortLost, ServerProcess

ARGS = ["--block-size", "32", "--served-model-name", "tiny"]


def test_config_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="unknown router policy"):
        ClusterConfig("m", policy="least_loaded", vllm_args=ARGS)
    with pytest.raises(ValueError, match="--block-size"):
        ClusterConfig("m", policy="kv_aware")
    with pytest.raises(ValueError, match="--host and --port"):
        ClusterConfig("m", vllm_args=[*ARGS, "--port", "8000"])
    with pytest.raises(ValueError, match="--host and --port"):
        ClusterConfig("m", vllm_args=[*ARGS, "--port=8000"])
    for name in ("a/b", "..", "", "x y"):  # a name becomes a file name
        with pytest.raises(ValueError, match="--name takes letters"):
            ClusterConfig("m", vllm_args=ARGS, name=name)
    config = ClusterConfig("m", policy="consistent_hash")  # no block size needed
    with pytest.raises(ValueError, match="--block-size"):
        config.check_policy("kv_aware")


def test_replicas_never_share_one_snapshot_or_trace_file(monkeypatch):
    with pytest.raises(ValueError, match="--agentkv-snapshot would be one file for 2 replicas"):
        ClusterConfig("m", vllm_args=[*ARGS, "--agentkv-snapshot=/tmp/s.json"])
    with pytest.raises(ValueError, match="--agentkv-snapshot would be one file"):  # agentkv serve reads it alike
        ClusterConfig("m", vllm_args=[*ARGS, "--agentkv_snapshot", "/tmp/s.json"])
    monkeypatch.setenv("AGENTKV_TRACE", "/tmp/t.jsonl")
    with pytest.raises(ValueError, match=r"--agentkv-trace would be one file for 3 replicas \(unset AGENTKV_TRACE"):
        ClusterConfig("m", vllm_args=ARGS, replicas=3)
    ClusterConfig("m", vllm_args=ARGS, replicas=1)  # one server: its own file
    ClusterConfig("m", vllm_args=ARGS, vanilla=True)  # vanilla vLLM reads no AGENTKV_* variable


def test_flags_given_as_flag_equals_value_are_read_like_the_others():
    config = ClusterConfig("m", vllm_args=["--block-size=16", "--served-model-name=tiny", "--max-model-len", "2048"])
    assert config.block_size == 16 and config.served_model_name == "tiny"
    assert config.vllm_args == ["--block-size", "16", "--served-model-name", "tiny", "--max-model-len", "2048"]


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
    assert [cluster_module._cpu_binding(i, 2, {}) for i in range(2)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}, {"VLLM_CPU_OMP_THREADS_BIND": "2,3"}]
    assert cluster_module._cpu_binding(4, 8, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}  # more replicas than cores
    # the user's binding wins, given in ClusterConfig.env (docs/scale-out.md) or exported
    config = cluster_module.ClusterConfig("m", policy="round_robin", env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    replica = cluster_module.Cluster(config)._replica(1)
    assert replica.base_env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in replica.spec.env
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "3")
    assert cluster_module._cpu_binding(0, 2, {}) == {}


_STARTS: list[int] = []  # replica indexes, in launch order


class _FlakyReplica:
    """A replica that loses a port race on its first ``failures`` starts (what vLLM's log says then)."""

    def __init__(self, index: int, failures: int, message: str) -> None:
        self.index, self.failures, self.message = index, failures, message

    def launch(self) -> _FlakyReplica:
        _STARTS.append(self.index)
        return self

    def wait_healthy(self, timeout: float) -> _FlakyReplica:
        if _STARTS.count(self.index) <= self.failures:
            raise RuntimeError(f"server exited with code 1 during start-up\n{self.message}")
        return self

    def start(self, timeout: float) -> _FlakyReplica:
        return self.launch().wait_healthy(timeout)

    def stop(self) -> None:
        pass


LOST_PORT = "zmq.error.ZMQError: Address already in use (addr='tcp://*:38631')"


@pytest.mark.parametrize(("failures", "message", "starts"), [
    (1, LOST_PORT, 2),  # relaunched once on fresh ports, then healthy
    (3, LOST_PORT, 3),  # retries are bounded: the third failure is raised
    (1, "RuntimeError: Engine core initialization failed", 1),  # any other failure is raised at once
])
def test_a_replica_that_lost_a_port_is_relaunched_on_fresh_ports(monkeypatch, tmp_path, failures, message, starts):
    from agentkv import cluster

    _STARTS.clear()
    running = cluster.Cluster(cluster.ClusterConfig("model", replicas=2, policy="round_robin", log_dir=tmp_path))
    monkeypatch.setattr(running, "_replica", lambda index: _FlakyReplica(index, failures if index == 1 else 0, message))
    monkeypatch.setattr(running, "_router", lambda *args, **kwargs: _FlakyReplica(9, 0, ""))
    ports = (list(running.replica_ports), list(running.event_ports))
    if starts == 2:
        running.start()
        assert _STARTS == [0, 1, 1, 9] and [p.index for p in running.processes] == [0, 1, 9]
        assert (running.replica_ports[0], running.event_ports[0]) == (ports[0][0], ports[1][0])
        assert running.replica_urls[1] == f"http://127.0.0.1:{running.replica_ports[1]}"
    else:
        with pytest.raises(RuntimeError, match="during start-up"):
            running.start()
        assert _STARTS.count(1) == starts and running.processes == []


def test_a_relaunched_replica_keeps_its_place(monkeypatch, tmp_path):
    """The state file lists the replicas' process groups in index order; a relaunched replica 0
    was appended after replica 1 (a CI run: replica-1's environment at index 0)."""
    from agentkv import cluster

    _STARTS.clear()
    running = cluster.Cluster(cluster.ClusterConfig("model", replicas=2, policy="round_robin", log_dir=tmp_path))
    monkeypatch.setattr(running, "_replica", lambda index: _FlakyReplica(index, 1 if index == 0 else 0, LOST_PORT))
    monkeypatch.setattr(running, "_router", lambda *args, **kwargs: _FlakyReplica(9, 0, ""))
    running.start()
    assert _STARTS == [0, 1, 0, 9] and [p.index for p in running.processes] == [0, 1, 9]


# A server that says it serves while another process's socket on its port accepts and never answers.
_SILENT_SERVER = """
import socket, sys, time
sock = socket.socket(); sock.bind(("127.0.0.1", int(sys.argv[1]))); sock.listen(8)
print("(APIServer pid=1) INFO:     Application startup complete.", flush=True)
time.sleep(60)
"""


def test_a_port_that_answers_no_http_is_a_lost_port_and_the_replica_is_relaunched(monkeypatch, tmp_path):
    """A CI run: replica 1's port was held by its own engine's socket (vLLM picks internal ports
    as it starts), so /health connected and hung while the log said the server was up."""
    silent = ServerProcess(Command(lambda port: [sys.executable, "-c", _SILENT_SERVER, str(port)]),
                           log_path=tmp_path / "silent.log")
    silent.silent_port_grace = 1.0
    started = time.monotonic()
    with pytest.raises(PortLost, match="another process holds its port"):
        silent.launch().wait_healthy(60)
    assert time.monotonic() - started < 20 and silent._proc is not None and silent._proc.returncode is not None

    _STARTS.clear()
    running = Cluster(ClusterConfig("model", replicas=2, policy="round_robin", log_dir=tmp_path))

    class _SilentOnce(_FlakyReplica):
        def wait_healthy(self, timeout: float) -> _FlakyReplica:
            if _STARTS.count(self.index) <= self.failures:
                raise PortLost("the server says it serves, but ... has not answered")
            return self

    monkeypatch.setattr(running, "_replica", lambda index: _SilentOnce(index, 1 if index == 1 else 0, ""))
    monkeypatch.setattr(running, "_router", lambda *args, **kwargs: _FlakyReplica(9, 0, ""))
    running.start()
    assert _STARTS == [0, 1, 1, 9]


ROUTER_LOST_PORT = "Error: Address already in use (os error 98)"  # vllm-router's log (a CI run)


@pytest.mark.parametrize(("fixed", "failures", "message", "starts"), [
    (False, 1, ROUTER_LOST_PORT, 2),  # relaunched once on a fresh port, then healthy
    (False, 3, ROUTER_LOST_PORT, 3),  # retries are bounded
    (True, 1, ROUTER_LOST_PORT, 1),  # the user's --port is never swapped for another
    (False, 1, "Error: no worker became healthy", 1),  # any other failure is raised at once
])
def test_a_router_that_lost_a_port_is_relaunched_on_a_fresh_one(monkeypatch, tmp_path, fixed, failures, message,
                                                                 starts):
    _STARTS.clear()
    ports: list[int] = []
    running = Cluster(ClusterConfig("model", replicas=1, policy="round_robin", log_dir=tmp_path,
                                    router_port=9999 if fixed else None))
    first = running.router_port
    monkeypatch.setattr(running, "_replica", lambda index: _FlakyReplica(index, 0, ""))

    def router(policy, port, args=()):
        ports.append(port)
        return _FlakyReplica(9, failures, message)

    monkeypatch.setattr(running, "_router", router)
    if starts == 2:
        running.start()
        assert _STARTS == [0, 9, 9] and [p.index for p in running.processes] == [0, 9]
        assert ports[0] == first and running.router_port == ports[1] != first
        assert running.url == f"http://127.0.0.1:{ports[1]}"
    else:
        with pytest.raises(RuntimeError, match="during start-up"):
            running.start()
        assert _STARTS.count(9) == starts and running.processes == []
