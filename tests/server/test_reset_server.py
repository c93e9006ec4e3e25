"""A prefix-cache reset on a real ``agentkv serve``, the way an operator or a benchmark triggers it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentkv.protocol import EVENTS_PATH, AgentTag
from agentkv.testing.server_stats import StatsSnapshot, cached_tokens
from agentkv.testing.servers import running_server, tiny_server_spec
from agentkv.testing.vllm_server import VLLMServer

pytestmark = pytest.mark.server

BLOCK = 32
ANCHOR_BLOCKS = 8
HISTORY_BLOCKS = 40  # a call: 8 + 40 blocks; two anchors and one call fit the 80 blocks, four and one do not
SESSIONS = 6


@pytest.fixture(scope="module")
def dev_agentkv_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """An ``agentkv serve`` of this module's own with vLLM's development routes
    (``/reset_prefix_cache``), which only a loopback test may expose."""
    spec = tiny_server_spec(tiny_model_dir, agentkv=True, env={"VLLM_SERVER_DEV_MODE": "1"})
    yield from running_server(spec, tmp_path_factory.mktemp("reset"))


def _pipeline(client: httpx.Client, agents: tuple[str, ...], app: str) -> list[tuple[int, str, int]]:
    """SESSIONS sessions calling ``agents`` in order, one prompt = the agent's anchor + a fresh
    history; (session, agent, cached tokens) per call."""
    measured = []
    for s in range(SESSIONS):
        session = f"{app}-{s}"
        for step, agent in enumerate(agents):
            anchor = random.Random(f"anchor-{agent}")
            rng = random.Random(f"history-{session}-{step}")
            prompt = [anchor.randrange(10, 4000) for _ in range(ANCHOR_BLOCKS * BLOCK)] + [
                rng.randrange(10, 4000) for _ in range(HISTORY_BLOCKS * BLOCK + 1)]
            tag = AgentTag(agent, session, "" if step == 0 else agents[step - 1], step)
            measured.append((s, agent, cached_tokens(client, prompt, tag.to_headers())))
        client.post(EVENTS_PATH, json={"version": 1, "events": [
            {"type": "session_end", "id": f"end-{session}", "session": session}]}).raise_for_status()
    return measured


def test_after_reset_prefix_cache_the_old_anchors_blocks_give_way(dev_agentkv_server):
    """A reset drops every cached block's hash but leaves the free queue as it was. The blocks that
    held the first app's anchors, which the model still values, are worthless from then on: the
    second app's anchors must not be evicted to keep them."""
    url = dev_agentkv_server.base_url
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as client:
        _pipeline(client, ("supervisor", "coder", "reviewer", "writer"), "old")
        client.post("/reset_prefix_cache").raise_for_status()
        snapshot = StatsSnapshot.take(url)
        calls = _pipeline(client, ("planner", "executor"), "new")
    # anchors are learned from two sessions; from the third on every call hits its anchor
    assert [hit for s, _, hit in calls if s >= 2] == [ANCHOR_BLOCKS * BLOCK] * (2 * (SESSIONS - 2))
    assert snapshot.delta("evictions", "anchor") == 0
