"""Calls tagged with their agent only, no session, on a real server: recognition finds each call a
session of its own (none continues another's conversation), so the agents' anchors rank by how
often they are called, as with a session per call."""

from __future__ import annotations

import pytest

from agentkv.testing.server_stats import StatsSnapshot

from .test_one_call_sessions_server import ANCHOR_BLOCKS, BLOCK, CALLS, OFTEN, replay_calls

pytestmark = pytest.mark.server


def test_the_anchor_of_the_agent_called_most_often_is_kept_when_calls_name_no_session(vanilla_server,
                                                                                      own_agentkv_server):
    snapshot = StatsSnapshot.take(own_agentkv_server.base_url)
    vanilla = replay_calls(vanilla_server.base_url, sessions=False)
    agentkv = replay_calls(own_agentkv_server.base_url, sessions=False)
    often = {name: [hit for agent, hit in rows if agent == OFTEN] for name, rows in
             (("vanilla", vanilla), ("agentkv", agentkv))}
    print(f"\ncached tokens of {OFTEN!r}'s calls: {often}")
    assert often["agentkv"][2:] == [ANCHOR_BLOCKS * BLOCK] * (len(often["agentkv"]) - 2)
    assert often["vanilla"][2:] == [0] * (len(often["vanilla"]) - 2)
    stats = snapshot.now()
    assert stats["predictability"] == 0.0 and stats["policy"] == "survival"
    # every call went through recognition, and none continued another's conversation
    assert sum(snapshot.delta("recognition", counter, now=stats) for counter in
               ("recognized_requests", "unrecognized_requests")) == CALLS
    assert snapshot.delta("recognition", "followed_requests", now=stats) == 0
