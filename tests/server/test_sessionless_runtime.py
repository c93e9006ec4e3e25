"""Calls that name their agent and no session, on a server without recognition (real vLLM
KVCacheManager): nothing there tells a one-off query from a conversation."""

from __future__ import annotations

import random

import pytest

from agentkv.protocol import AgentTag
from server_patch._runtime import AgentKVRuntime, RuntimeConfig
from server_patch._tracker import AnchorLengths
from tests.server.test_runtime import AGENTS, BS, anchor, manager, request, run


def test_the_anchor_of_calls_outside_any_session_is_not_the_conversation_they_continue():
    """Two conversations with one agent, no session sent: consecutive calls of one conversation share
    it too, so the anchor is the prefix a call shares with the nearest of the agent's last calls
    (it was the whole conversation whenever it continued the latest)."""
    anchors = AnchorLengths()
    calls = [[1, 2, 10], [1, 2, 20], [1, 2, 10, 11], [1, 2, 10, 11, 12], [1, 2, 10, 11, 12, 13],
             [1, 2, 20, 21]]
    lengths = []
    for hashes in calls:
        anchors.observe("assistant", None, hashes)
        lengths.append(anchors.length("assistant"))
    assert lengths == [0, 2, 2, 2, 2, 2]  # before: [0, 2, 2, 4, 5, 2]
    for hashes in ([10, 1], [10, 2], [10, 3], [10, 4], [10, 5]):  # only one conversation, the window's length
        anchors.observe("assistant", None, hashes)
    assert anchors.length("assistant") == 1


def sessionless_conversations(n_conversations: int, turns: int, seed: int = 0):
    """Conversations with three agents (each user talks to one), turns in random order, no session sent."""
    rng = random.Random(seed)
    told = dict.fromkeys(range(n_conversations), 0)
    while told:
        c = rng.choice(sorted(told))
        told[c] += 1
        start = 500_000 + c * 10_000
        yield AGENTS[c % 3], anchor(AGENTS[c % 3]) + list(range(start, start + told[c] * 2 * BS)) + [7]
        if told[c] == turns:
            del told[c]


@pytest.mark.parametrize("spacing", [1.0, 60.0])
@pytest.mark.parametrize("num_blocks", [30, 40])
def test_conversations_that_name_their_agent_alone_keep_their_turns_without_recognition(num_blocks, spacing):
    """Agent-only tags and recognition off: nothing tells a conversation from one-off queries. Its
    turns were history of no session (the floor), so the newest went first, and the anchor was learned
    as the conversation whenever a turn continued its agent's latest call: 3,552 and 4,352 tokens hit
    where vanilla hits 3,936 and 4,768. Beyond the anchor they are untagged now, in LRU order.

    On a quiet server (calls a minute apart) the queue's recency counted seconds while no session's
    gap was learned, and outweighed the model: 3,936 and 4,768, vanilla's. It counts calls now."""
    clock = [0.0]
    kv, vanilla_kv = manager(num_blocks), manager(num_blocks)
    runtime = AgentKVRuntime(RuntimeConfig(recognize=False), clock=lambda: clock[0])
    runtime.install(kv)
    hits = vanilla = 0
    for agent, prompt in sessionless_conversations(8, 6):
        hits += run(kv, runtime, request(prompt, AgentTag(agent)))
        vanilla += run(vanilla_kv, None, request(prompt, None))
        clock[0] += spacing
    assert runtime.policy == "survival" and hits > vanilla  # 1 s apart: 4,224 vs 3,936; 4,832 vs 4,768
