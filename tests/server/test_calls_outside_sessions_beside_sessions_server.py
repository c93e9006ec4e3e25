"""Calls tagged with their agent only, between the dispatches of another app's sessions, on a real
server: their queries are never reused and must go before the other app's anchors do."""

from __future__ import annotations

import random

import httpx
import pytest

from agentkv.testing.server_stats import cached_tokens

pytestmark = pytest.mark.server

BLOCK = 32
ANCHOR_BLOCKS = 4
HISTORY_BLOCKS = 6
QUERY_BLOCKS = 40  # two queries between an agent's calls overflow the 80-block pool
PIPELINE = ("extract", "report")
SESSIONS = 8


def _tokens(seed: str, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(count)]


def _replay(base_url: str) -> list[tuple[str, int]]:
    """(agent, cached tokens) of every call: each pipeline dispatch followed by a session-less
    summarizer call with a query of its own."""
    hits = []
    with httpx.Client(base_url=base_url, timeout=120, trust_env=False) as client:
        for s in range(SESSIONS):
            for step, agent in enumerate(PIPELINE):
                prompt = _tokens(f"anchor-{agent}", ANCHOR_BLOCKS * BLOCK) + _tokens(f"{s}-{agent}",
                                                                                     HISTORY_BLOCKS * BLOCK + 1)
                headers = {"X-AgentKV-Agent": agent, "X-AgentKV-Session": f"pipe-{s}",
                           "X-AgentKV-Parent": PIPELINE[step - 1] if step else "", "X-AgentKV-Step": str(step)}
                hits.append((agent, cached_tokens(client, prompt, headers)))
                query = _tokens("anchor-summarizer", ANCHOR_BLOCKS * BLOCK) + _tokens(f"q-{s}-{step}",
                                                                                      QUERY_BLOCKS * BLOCK + 1)
                hits.append(("summarizer", cached_tokens(client, query, {"X-AgentKV-Agent": "summarizer"})))
    return hits


def test_queries_of_calls_outside_any_session_go_before_the_anchors_of_sessions(vanilla_server, own_agentkv_server):
    vanilla, agentkv = _replay(vanilla_server.base_url), _replay(own_agentkv_server.base_url)
    pipeline = {name: [hit for agent, hit in rows if agent in PIPELINE][4:] for name, rows in
                (("vanilla", vanilla), ("agentkv", agentkv))}  # from the third session on
    print(f"\ncached tokens of the pipeline's calls from the third session on: {pipeline}")
    assert pipeline["agentkv"] == [ANCHOR_BLOCKS * BLOCK] * len(pipeline["agentkv"])
    assert pipeline["vanilla"] == [0] * len(pipeline["vanilla"])  # two queries between: LRU lost them
    summarizer = [hit for agent, hit in agentkv if agent == "summarizer"]
    assert summarizer[1:] == [ANCHOR_BLOCKS * BLOCK] * (len(summarizer) - 1)
