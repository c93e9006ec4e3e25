"""A real ``agentkv serve`` recognizes the agents of requests that carry no agentkv metadata at all."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from agentkv.protocol import STATS_MAX_AGE, STATS_PATH

pytestmark = pytest.mark.server

BLOCK = 32
AGENTS = ("planner", "coder")


def _tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def test_untagged_requests_show_recognized_agents_in_stats(own_agentkv_server):
    # A server of this module's own: recognition learns the preamble from all the traffic a server
    # has seen, and other modules' traffic (other first blocks) would hide this test's preamble.
    agentkv_server = own_agentkv_server
    anchors = {a: _tokens("team", BLOCK) + _tokens(f"anchor-{a}", 4 * BLOCK) for a in AGENTS}
    with httpx.Client(base_url=agentkv_server.base_url, timeout=120, trust_env=False) as client:
        time.sleep(STATS_MAX_AGE)  # the stats document is served again for up to STATS_MAX_AGE
        before = client.get(STATS_PATH).json()["recognition"]["recognized_requests"]
        for s in range(5):
            history = _tokens(f"task-{s}", 3 * BLOCK)
            for agent in AGENTS:  # plain OpenAI-compatible requests: no X-AgentKV-*, no X-Session-ID
                body = {"model": "tiny", "prompt": anchors[agent] + history, "max_tokens": 1, "temperature": 0}
                client.post("/v1/completions", json=body).raise_for_status()
                history = history + _tokens(f"out-{s}-{agent}", BLOCK)
        time.sleep(STATS_MAX_AGE)
        stats = client.get(STATS_PATH).json()
        recent = client.get("/agentkv/v1/recognized").json()["recognized"]
    assert stats["recognition"]["recognized_requests"] - before >= 4
    found = {agent for _, agent, _, _ in recent[-4:]}
    assert len(found) == 2 and all(a.startswith("fp:") for a in found)
    assert all(stats["agents"][a]["queries"] > 0 for a in found)
    assert len({session for _, _, session, _ in recent[-2:]}) == 1  # the coder continued the planner's session


def test_an_untagged_request_handed_an_answer_joins_its_session(own_agentkv_server):
    """No metadata at all, and no shared history: the coder is given the planner's answer (as
    multi-agent apps hand work over). The server follows the session by the quoted answer."""
    anchors = {a: _tokens("team", BLOCK) + _tokens(f"anchor-{a}", 4 * BLOCK) for a in AGENTS}
    with httpx.Client(base_url=own_agentkv_server.base_url, timeout=120, trust_env=False) as client:
        for s in range(4):  # enough sessions for recognition to know both anchors
            history = _tokens(f"quote-task-{s}", 3 * BLOCK)
            for agent in AGENTS:
                body = {"model": "tiny", "prompt": anchors[agent] + history, "max_tokens": 1}
                client.post("/v1/completions", json=body).raise_for_status()
                history = history + _tokens(f"quote-out-{s}-{agent}", BLOCK)
        body = {"model": "tiny", "prompt": anchors["planner"] + _tokens("quote-task", 3 * BLOCK), "max_tokens": 96,
                "temperature": 1.0, "seed": 7, "ignore_eos": True, "return_token_ids": True}
        answer = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        body = {"model": "tiny", "prompt": anchors["coder"] + _tokens("the coder's notes", BLOCK) + answer,
                "max_tokens": 1}
        client.post("/v1/completions", json=body).raise_for_status()
        recent = client.get("/agentkv/v1/recognized").json()["recognized"]
        time.sleep(STATS_MAX_AGE)  # a fresh stats document
        quoting = client.get(STATS_PATH).json()["recognition"]["quoting_requests"]
    (_, planner, planner_session, _), (_, coder, coder_session, _) = recent[-2:]
    assert len(answer) == 96 and planner != coder and coder_session == planner_session and quoting >= 1


def test_a_call_that_names_its_agent_alone_joins_its_session_from_the_agents_second_call(own_agentkv_server):
    """Tagged with ``X-AgentKV-Agent`` only (no session): the agent is the client's, the session is
    recognized, even for an agent called too seldom to count as an anchor of its own yet."""
    anchors = {a: _tokens("team", BLOCK) + _tokens(f"named-anchor-{a}", 4 * BLOCK) for a in (*AGENTS, "reviewer")}
    with httpx.Client(base_url=own_agentkv_server.base_url, timeout=120, trust_env=False) as client:
        for s in range(4):
            history = _tokens(f"named-task-{s}", 3 * BLOCK)
            route = [*AGENTS, "reviewer"] if s in (1, 3) else list(AGENTS)  # the reviewer: twice in all
            for agent in route:
                body = {"model": "tiny", "prompt": anchors[agent] + history, "max_tokens": 1}
                client.post("/v1/completions", json=body, headers={"X-AgentKV-Agent": agent}).raise_for_status()
                history = history + _tokens(f"named-out-{s}-{agent}", BLOCK)
        recent = client.get("/agentkv/v1/recognized").json()["recognized"]
    # the last conversation (the first ones split while recognition learns where the anchors end)
    last = [(agent, session) for _, agent, session, _ in recent[-3:]]
    assert [agent for agent, _ in last] == ["planner", "coder", "reviewer"]
    assert len({session for _, session in last}) == 1  # the reviewer's second call joined the conversation


def test_routing_by_agent_leaves_the_session_of_an_agent_only_call_to_recognition(own_agentkv_server):
    """``set_routing_key("agent")`` puts the agent's name in ``X-Session-ID`` for the router: a call
    tagged ``agentkv.agent(name)`` alone is still not one session per agent (every call of the
    coder was its one long session): its conversation is recognized."""
    import openai

    import agentkv
    from agentkv.frameworks import set_routing_key

    anchors = {a: _tokens("team", BLOCK) + _tokens(f"routed-anchor-{a}", 4 * BLOCK) for a in AGENTS}
    client = openai.OpenAI(base_url=own_agentkv_server.base_url + "/v1", api_key="x", max_retries=0,
                           http_client=httpx.Client(timeout=120, trust_env=False))
    previous = set_routing_key("agent")
    try:
        for s in range(4):
            history = _tokens(f"routed-task-{s}", 3 * BLOCK)
            for agent in AGENTS:
                with agentkv.agent(agent):
                    client.completions.create(model="tiny", prompt=anchors[agent] + history, max_tokens=1)
                history = history + _tokens(f"routed-out-{s}-{agent}", BLOCK)
    finally:
        set_routing_key(previous)
    with httpx.Client(base_url=own_agentkv_server.base_url, timeout=120, trust_env=False) as raw:
        recent = raw.get("/agentkv/v1/recognized").json()["recognized"]
    last = [(agent, session) for _, agent, session, _ in recent[-2:]]
    assert [agent for agent, _ in last] == list(AGENTS)
    assert len({session for _, session in last}) == 1 and last[0][1] not in AGENTS  # one conversation, recognized
