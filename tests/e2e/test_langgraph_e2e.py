"""A LangGraph app on the real agentkv server: the server learns its agents, sessions and transitions,
and the client-side anchors agree with the server's anchor lengths."""

from __future__ import annotations

import uuid
from typing import Any, TypedDict

import httpx
import pytest

pytest.importorskip("langgraph")

from langchain_anthropic import ChatAnthropic
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph

import agentkv
from agentkv.testing.server_stats import fetch_stats, learned, wait_for
from agentkv.warmup import AnchorBook

from ._util import BLOCK, cached_tokens, instructions

pytestmark = pytest.mark.server

SESSIONS = 3


class State(TypedDict):
    task: str
    rounds: int


@tool
def run_tests(path: str) -> str:
    """Run the test suite under a path and report failures."""
    return "ok"


def build(base_url: str, run: str, seen: dict[str, list[int]], checkpointer: Any = None,
          api: str = "chat") -> Any:
    """``api``: the models call chat completions (``"chat"``), the Responses API (``"responses"``:
    ``use_responses_api``) or Anthropic's Messages API (``"messages"``: ``ChatAnthropic``)."""
    llm: Any
    if api == "messages":
        llm = ChatAnthropic(base_url=base_url, api_key="x", model="tiny", max_tokens=1, temperature=0)
        # The server has no tool-call parser: the tools are rendered into the prompt, none is called.
        coder_llm = llm.bind_tools([run_tests], tool_choice={"type": "none"})
    else:
        llm = ChatOpenAI(base_url=base_url + "/v1", api_key="x", model="tiny", max_tokens=1, temperature=0,
                         use_responses_api=api == "responses")
        coder_llm = llm.bind_tools([run_tests], tool_choice="none")

    def node(role: str, model: Any) -> Any:
        def run_node(state: State) -> dict[str, Any]:
            reply = model.invoke([SystemMessage(instructions(role, run)),
                                  HumanMessage(f"{state['task']} (round {state['rounds']})")])
            hit = (reply.usage_metadata or {}).get("input_token_details", {}).get("cache_read", 0) \
                if api != "chat" else cached_tokens(reply)
            seen.setdefault(role, []).append(hit)
            return {"rounds": state["rounds"] + (role == "reviewer")}

        return run_node

    builder = StateGraph(State)
    builder.add_node("planner", node("planner", llm))
    builder.add_node("coder", node("coder", coder_llm))
    builder.add_node("reviewer", node("reviewer", llm))
    builder.add_edge(START, "planner")
    builder.add_edge("planner", "coder")
    builder.add_edge("coder", "reviewer")
    # Deterministic routing in Python (the tiny model's output is noise): one revision, then done.
    builder.add_conditional_edges("reviewer", lambda s: "coder" if s["rounds"] < 2 else END, ["coder", END])
    names = {node: f"{node}-{run}" for node in ("planner", "coder", "reviewer")}
    return agentkv.instrument(builder.compile(checkpointer=checkpointer), agent_names=names,
                              events_url=base_url), names


def test_langgraph_app_is_learned_by_the_server(own_agentkv_server) -> None:
    # A server of this module's own: what the server learned depends on every agent it saw.
    base = own_agentkv_server.base_url
    run = uuid.uuid4().hex[:8]
    seen: dict[str, list[int]] = {}
    app, names = build(base, run, seen)
    book = AnchorBook(base_url=base, block_size=BLOCK).attach()
    before = fetch_stats(base)
    try:
        for s in range(SESSIONS):
            app.invoke({"task": f"feature {s}", "rounds": 0}, {"configurable": {"thread_id": f"lg-{run}-{s}"}})
    finally:
        book.detach()
    wait_for(lambda: fetch_stats(base)["sessions"]["ended"] >= before["sessions"]["ended"] + SESSIONS,
             "3 session ends")
    after = fetch_stats(base)

    planner, coder, reviewer = names["planner"], names["coder"], names["reviewer"]
    assert {planner, coder, reviewer} <= set(after["agents"])
    assert after["dispatches"] - before["dispatches"] == SESSIONS * 5  # planner, (coder, reviewer) x 2
    assert not any(s.startswith(f"lg-{run}") for s in after["sessions"]["current"])  # all ended
    assert {planner, coder, reviewer} <= set(after["facts"]["nodes"])
    assert learned(after, planner, coder) and learned(after, coder, reviewer)
    assert max(after["transitions"][reviewer], key=after["transitions"][reviewer].get) == coder
    # every session after the first reuses each agent's anchor from the prefix cache
    assert all(hit >= BLOCK for role in seen for hit in seen[role][2:])
    assert after["agents"][coder]["hits"] > 0

    # The client's anchors (token prefix shared by two sessions, via POST /tokenize) are the server's
    # anchors (block-hash prefix shared by two sessions), block for block.
    with httpx.Client(base_url=base, trust_env=False, timeout=30) as client:
        def tokenize(payload: Any) -> list[int]:
            response = client.post("/tokenize", json=payload)
            response.raise_for_status()
            return response.json()["tokens"]

        for agent in (planner, coder, reviewer):
            anchor = book.resolve(agent, tokenize)
            assert anchor is not None and anchor.source == "cross-session"
            assert anchor.blocks == after["agents"][agent]["anchor_length_blocks"] >= 8, agent
    assert book.divergences() == {}


def test_a_checkpointed_thread_stays_live_until_the_app_ends_it(own_agentkv_server) -> None:
    """A chat: each user message is one run on the thread, and the graph keeps the thread's state.
    The run's end is not the conversation's (the server would evict its history first)."""
    base = own_agentkv_server.base_url
    run = uuid.uuid4().hex[:8]
    app, _ = build(base, run, {}, checkpointer=InMemorySaver())
    thread = f"chat-{run}"
    app.invoke({"task": "feature", "rounds": 0}, {"configurable": {"thread_id": thread}})
    assert app.sink.flush(10)  # everything the run posted (facts, session_start) has reached the server
    assert thread in fetch_stats(base)["sessions"]["current"]  # live: not ended with the run
    app.end_session(thread)
    wait_for(lambda: thread not in fetch_stats(base)["sessions"]["current"], "the chat's end")


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_a_langgraph_app_on_another_api_is_learned(agentkv_server, api) -> None:
    """The same app with ``ChatOpenAI(use_responses_api=True)`` (tagged through the openai SDK's
    ``responses.create``) or on ``ChatAnthropic`` against vLLM's ``/v1/messages`` (the anthropic
    SDK, tagged alike: no headers passed by the app), learned by the server as with chat
    completions, and each API's usage read (a Messages response counts cache reads apart from
    ``input_tokens``). On the shared server (the module's own keeps only the agents its hit
    assertions were sized for): deltas and each agent's most likely successor."""
    base = agentkv_server.base_url
    run = uuid.uuid4().hex[:8]
    seen: dict[str, list[int]] = {}
    app, names = build(base, run, seen, api=api)
    before = fetch_stats(base)
    for s in range(2):
        app.invoke({"task": f"feature {s}", "rounds": 0}, {"configurable": {"thread_id": f"l{api}-{run}-{s}"}})
    wait_for(lambda: fetch_stats(base)["sessions"]["ended"] >= before["sessions"]["ended"] + 2, "2 session ends")
    after = fetch_stats(base)
    planner, coder, reviewer = names["planner"], names["coder"], names["reviewer"]
    assert after["tagged_requests"] - before["tagged_requests"] == 2 * 5
    assert after["dispatches"] - before["dispatches"] == 2 * 5
    for agent, successor in ((planner, coder), (coder, reviewer), (reviewer, coder)):
        row = after["transitions"][agent]
        assert max(row, key=row.get) == successor, agent
    assert max(seen["coder"]) >= BLOCK  # the coder's instructions and tools, read from the cache
