"""Independent calls on a real server: every call a session of its own, so no transition is ever
learned (R = 0), and the agents differ only in how often they are called."""

from __future__ import annotations

import random

import httpx
import pytest

from agentkv.testing.server_stats import StatsSnapshot, cached_tokens

pytestmark = pytest.mark.server

BLOCK = 32
ANCHOR_BLOCKS = 8
QUERY_BLOCKS = 24  # a call is 33 blocks: three of them overflow the 80-block pool
OFTEN, SELDOM = "often", ("seldom0", "seldom1", "seldom2")
CALLS = 40


def _tokens(seed: str, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(count)]


def _calls():
    """The often called agent every fourth call, the three others in turn between; each call a new session."""
    for n in range(CALLS):
        agent = OFTEN if n % 4 == 0 else SELDOM[n % 4 - 1]
        prompt = _tokens(f"anchor-{agent}", ANCHOR_BLOCKS * BLOCK) + _tokens(f"q-{n}", QUERY_BLOCKS * BLOCK + 1)
        yield agent, f"one-{n}", prompt


def replay_calls(base_url: str, *, sessions: bool = True) -> list[tuple[str, int]]:
    """(agent, cached tokens) of every call; ``sessions=False`` tags each with its agent only."""
    hits = []
    with httpx.Client(base_url=base_url, timeout=120, trust_env=False) as client:
        for agent, session, prompt in _calls():
            headers = {"X-AgentKV-Agent": agent} | ({"X-AgentKV-Session": session} if sessions else {})
            hits.append((agent, cached_tokens(client, prompt, headers)))
    return hits


def test_the_anchor_of_the_agent_called_most_often_is_kept_without_any_transition(vanilla_server,
                                                                                  own_agentkv_server):
    snapshot = StatsSnapshot.take(own_agentkv_server.base_url)
    vanilla, agentkv = replay_calls(vanilla_server.base_url), replay_calls(own_agentkv_server.base_url)
    often = {name: [hit for agent, hit in rows if agent == OFTEN] for name, rows in
             (("vanilla", vanilla), ("agentkv", agentkv))}
    print(f"\ncached tokens of {OFTEN!r}'s calls: {often}")
    # its anchor is learned from its first two calls; from the third on every call hits it
    assert often["agentkv"][2:] == [ANCHOR_BLOCKS * BLOCK] * (len(often["agentkv"]) - 2)
    assert often["vanilla"][2:] == [0] * (len(often["vanilla"]) - 2)  # three other calls between: LRU lost it
    stats = snapshot.now()
    assert stats["predictability"] == 0.0 and stats["policy"] == "survival"
    assert stats["agents"][OFTEN]["anchor_length_blocks"] == ANCHOR_BLOCKS
