"""AGENTKV_PEER_API_KEY end to end: two real ``agentkv serve`` replicas behind different ``--api-key``s,
each pulling the other's learned counts. A holds B's key as its peer key and merges B's counts; B holds a
wrong key: A refuses its pulls, which B counts and logs once, serving on. (The own-key fallback, with the
variable unset, is test_hardening's.)"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from agentkv.launcher import free_port
from agentkv.protocol import STATS_PATH, AgentTag
from agentkv.testing.servers import tiny_server_spec
from agentkv.testing.vllm_server import VLLMServer

pytestmark = pytest.mark.server

KEYS = {"a": "replica-a-key", "b": "replica-b-key"}
PEER_KEYS = {"a": KEYS["b"], "b": "not-replica-a-key"}


def _stats(server: VLLMServer, name: str) -> dict:
    response = httpx.get(server.base_url + STATS_PATH, headers={"Authorization": f"Bearer {KEYS[name]}"},
                         trust_env=False, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _until(read: Callable[[], dict], holds: Callable[[dict], bool], timeout: float = 60.0) -> dict:
    """``read()`` once ``holds`` for it, or at ``timeout`` (the pulls run every 0.5 s; a loaded
    machine may time one out)."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if holds(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_replicas_pull_each_other_with_the_configured_peer_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    ports = {"a": free_port(), "b": free_port()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    servers = {
        name: VLLMServer(
            tiny_server_spec(tiny_model_dir, agentkv=True, extra_args=["--api-key", KEYS[name]],
                             env={"AGENTKV_REPLICA": f"peer-key-{name}", "AGENTKV_PEERS": urls[other],
                                  "AGENTKV_PEER_API_KEY": PEER_KEYS[name], "AGENTKV_SYNC_INTERVAL": "0.5"}),
            port=ports[name], log_path=tmp_path / f"{name}.log")
        for name, other in (("a", "b"), ("b", "a"))
    }
    with contextlib.ExitStack() as stack:
        for server in servers.values():  # A first: B's first pull (the one it logs) meets a running A
            stack.callback(server.stop)
            server.launch()
            server.wait_healthy(600)
        a, b = servers["a"], servers["b"]
        with httpx.Client(base_url=b.base_url, timeout=120, trust_env=False,
                          headers={"Authorization": f"Bearer {KEYS['b']}"}) as client:
            for step, agent in enumerate(("key-planner", "key-coder")):  # what only B learns first-hand
                tag = AgentTag(agent, "keyed-1", "" if step == 0 else "key-planner", step)
                response = client.post("/v1/completions", headers=tag.to_headers(),
                                       json={"model": "tiny", "prompt": [11 + step] * 40, "max_tokens": 1})
                assert response.status_code == 200, response.text

        def merged_b(stats: dict) -> bool:
            return "peer-key-b" in stats["learner"]["peers"] and "key-coder" in stats["transitions"].get(
                "key-planner", {})

        stats_a = _until(lambda: _stats(a, "a"), merged_b)
        assert merged_b(stats_a), (stats_a["learner"]["peers"], stats_a["transitions"])
        # A's pulls while B was starting met a refused connection: counted, but none since B took them
        before = stats_a["peer_sync_failures"].get(b.base_url, 0)
        time.sleep(2.0)  # four more pulls
        assert _stats(a, "a")["peer_sync_failures"].get(b.base_url, 0) == before  # B took A's pulls with B's key
        stats_b = _until(lambda: _stats(b, "b"), lambda st: st["peer_sync_failures"].get(a.base_url, 0) >= 2)
        assert stats_b["peer_sync_failures"][a.base_url] >= 2  # the wrong key: refused, counted ...
        assert stats_b["learner"]["peers"] == {}  # ... and nothing merged
        logged = [line for line in b.log_path.read_text().splitlines()
                  if f"cannot merge learned counts from {a.base_url}" in line]
        assert len(logged) == 1 and "401 Unauthorized" in logged[0], logged  # logged once, with the reason
        assert b.running and _stats(b, "b")["tagged_requests"] == 2  # and B serves on
