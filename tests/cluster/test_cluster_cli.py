"""``agentkv cluster up`` / ``cluster down`` run as a user runs them: the command line, in a subprocess.

The fixture in conftest.py builds ``Cluster`` directly; this test goes through argument parsing and
``_up``, which once passed the sync interval where the router arguments belong and never started, and
checks that each replica runs in the user's own environment (the cluster once forced the tests' one);
``cluster up --vanilla`` runs plain vLLM replicas (the benchmark's vanilla cluster is built directly).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentkv.cluster import _state_file
from agentkv.launcher import VLLM_MODULE
from agentkv.protocol import STATS_PATH, AgentTag
from agentkv.testing.vllm_server import TEST_ENV

from .conftest import BLOCK

pytestmark = pytest.mark.server

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 600.0


def _agentkv(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentkv", *args]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _environment(pid: int) -> dict[str, str]:
    """The environment a process was started with (Linux)."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().partition("=")[::2] for e in entries if e)


def _wait_for_state(up: subprocess.Popen[str], state: Path) -> dict:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if up.poll() is not None:
            output = up.stdout.read() if up.stdout else ""
            pytest.fail(f"`agentkv cluster up` exited with {up.returncode} before it was up:\n{output[-4000:]}")
        if state.exists():
            return json.loads(state.read_text())
        time.sleep(1.0)
    pytest.fail(f"`agentkv cluster up` not up after {START_TIMEOUT:.0f} s")


@contextlib.contextmanager
def _cluster_up(name: str, env: dict[str, str], *options: str, model: str) -> Iterator[tuple[subprocess.Popen, dict]]:
    """``agentkv cluster up [options] --name NAME MODEL [the tiny model's vLLM args]`` in a subprocess,
    up: (its process, its state file); whatever it started is killed on the way out."""
    up = subprocess.Popen(
        _agentkv("cluster", "up", *options, "--name", name, model, "--served-model-name", "tiny", "--dtype",
                 "bfloat16", "--max-model-len", "2048", "--block-size", str(BLOCK), "--num-gpu-blocks-override",
                 "81", "--enforce-eager"),
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    recorded: dict = {}
    try:
        recorded = _wait_for_state(up, _state_file(name))
        yield up, recorded
    finally:
        for pgid in recorded.get("pgids", []):
            _kill_group(pgid)
        _kill_group(up.pid)
        up.wait(timeout=30)
        if up.stdout:
            up.stdout.close()
        _state_file(name).unlink(missing_ok=True)


def _down_stops(name: str, env: dict[str, str], up: subprocess.Popen, recorded: dict) -> None:
    """``agentkv cluster down`` stops the cluster ``up`` runs: its process, its replicas, its state file."""
    down = subprocess.run(_agentkv("cluster", "down", "--name", name), cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip() == f"cluster {name!r} stopped"
    assert up.wait(timeout=30) == 0
    assert not _state_file(name).exists()
    for replica in recorded["replicas"]:
        with pytest.raises(httpx.HTTPError):
            httpx.get(replica + "/health", trust_env=False, timeout=2)


def _complete(router: str, tokens: int) -> None:
    tag = AgentTag("planner", "cli-1", "", 0)
    response = httpx.post(router + "/v1/completions", trust_env=False, timeout=120,
                          json={"model": "tiny", "prompt": [11] * tokens, "max_tokens": 1}, headers=tag.to_headers())
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == tokens


def test_cluster_up_and_down_from_the_command_line(tiny_model_dir: Path) -> None:
    name = f"pytest-cli-{uuid.uuid4().hex[:6]}"
    # the user's environment: the tests' defaults minus one, plus a variable of the user's own
    env = {k: v for k, v in {**os.environ, **TEST_ENV}.items() if k != "DO_NOT_TRACK"}
    env |= {"PYTHONPATH": str(REPO_ROOT), "AGENTKV_CLI_TEST": name}
    with _cluster_up(name, env, "--replicas", "2", "--router-policy", "kv_aware", "--sync-interval", "1",
                     model=str(tiny_model_dir)) as (up, recorded):
        assert recorded["pid"] == up.pid and len(recorded["replicas"]) == 2
        for index, pgid in enumerate(recorded["pgids"][:2]):  # replicas first, then the router
            replica_env = _environment(pgid)
            assert {k: replica_env.get(k) for k in env} == env  # passed through, nothing overridden
            assert "DO_NOT_TRACK" not in replica_env  # the tests' environment is not forced on the user
            assert replica_env["AGENTKV_REPLICA"] == f"{name}-replica-{index}"
        for index, replica in enumerate(recorded["replicas"]):
            stats = httpx.get(replica + STATS_PATH, trust_env=False, timeout=30)
            assert stats.status_code == 200
            assert stats.json()["learner"]["replica"] == f"{name}-replica-{index}"
        _complete(recorded["router"], 2 * BLOCK)
        again = subprocess.run(_agentkv("cluster", "up", "--name", name, str(tiny_model_dir), "--block-size",
                                        str(BLOCK)), cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                               timeout=180)
        assert again.returncode == 1 and f"a cluster named {name!r} is already up" in again.stderr, again.stderr

        _down_stops(name, env, up, recorded)
        twice = subprocess.run(_agentkv("cluster", "down", "--name", name), cwd=REPO_ROOT, env=env,
                               capture_output=True, text=True, timeout=180)
        assert (twice.returncode, twice.stdout.strip()) == (0, f"no cluster named {name!r} is up")
        shutil.rmtree(recorded["logs"])  # kept for a user (and for a failing run), not after every passing one


def test_a_vanilla_cluster_from_the_command_line_runs_plain_vllm(tiny_model_dir: Path) -> None:
    name = f"pytest-cli-vanilla-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, **TEST_ENV, "PYTHONPATH": str(REPO_ROOT)}
    with _cluster_up(name, env, "--vanilla", "--replicas", "2", "--router-policy", "round_robin",
                     model=str(tiny_model_dir)) as (up, recorded):
        assert len(recorded["replicas"]) == 2
        for pgid in recorded["pgids"][:2]:  # replicas first, then the router
            command = Path(f"/proc/{pgid}/cmdline").read_bytes().split(b"\0")
            assert command[1:3] == [b"-m", VLLM_MODULE.encode()]  # vLLM's own server, not agentkv.serve
            assert not {"AGENTKV_REPLICA", "AGENTKV_PEERS"} & set(_environment(pgid))  # no peers to merge with
        for replica in recorded["replicas"]:  # no agentkv extension: its routes are vLLM's 404
            assert httpx.get(replica + "/health", trust_env=False, timeout=30).status_code == 200
            assert httpx.get(replica + STATS_PATH, trust_env=False, timeout=30).status_code == 404
        _complete(recorded["router"], 2 * BLOCK)  # an agentkv-tagged call: plain vLLM ignores its headers
        _down_stops(name, env, up, recorded)
        shutil.rmtree(recorded["logs"])
