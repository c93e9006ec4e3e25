"""The anchor a real server learns for an agent whose sessions open with a task from a short list."""

from __future__ import annotations

import random

import httpx
import pytest

from agentkv.testing.server_stats import StatsSnapshot, cached_tokens

pytestmark = pytest.mark.server

BLOCK = 32
ANCHOR_BLOCKS = 4
TASK_BLOCKS = 3
AGENT = "opener"  # no other test sends it: the shared server's learned anchor is this test's alone


def _tokens(seed: str, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(count)]


def test_two_sessions_that_open_alike_do_not_stretch_the_anchor(agentkv_server):
    """Sessions 3 and 4 open with the same task, and so do 5 and 6: the anchor used to be the
    latest two sessions' common prefix, anchor and task (7 blocks here); it is what most pairs share."""
    tasks = [_tokens(f"task-{t}", TASK_BLOCKS * BLOCK) for t in range(4)]
    with httpx.Client(base_url=agentkv_server.base_url, timeout=120, trust_env=False) as client:
        for s, t in enumerate([0, 1, 2, 2, 3, 3]):
            prompt = _tokens("anchor-opener", ANCHOR_BLOCKS * BLOCK) + tasks[t] + _tokens(f"own-{s}", 2 * BLOCK + 1)
            cached_tokens(client, prompt, {"X-AgentKV-Agent": AGENT, "X-AgentKV-Session": f"opener-{s}"})
    stats = StatsSnapshot.take(agentkv_server.base_url).before
    assert stats["agents"][AGENT]["anchor_length_blocks"] == ANCHOR_BLOCKS
