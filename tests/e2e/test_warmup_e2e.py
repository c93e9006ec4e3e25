"""Warm-up on the real agentkv server: a cold anchor, warmed in the pause before its agent, is hit.

The app is planner -> (pause) -> coder. Session 1 teaches the prediction planner -> coder and the
coder's anchor; its session end retires its blocks and two 64-block untagged prompts evict them, so
before session 2 the coder's anchor (unique to this run) is cold -- the warm-up's own
``cached_tokens`` shows it. In session 2 the coordinator warms it after the planner's turn, and the
coder's real call hits at least the whole anchor. Then the same with the server's own transition
model instead of a client-side learner.
"""

from __future__ import annotations

import uuid
from typing import Any, TypedDict

import pytest

pytest.importorskip("langgraph")

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

import agentkv
from agentkv.graph import TransitionLearner
from agentkv.testing.server_stats import fetch_stats, learned, wait_for
from agentkv.warmup import WarmupCoordinator

from ._util import BLOCK, cached_tokens, fill_cache, instructions

pytestmark = pytest.mark.server


class State(TypedDict):
    task: str


class App:
    """planner -> pause -> coder; the pause node stands for the gap between two agents' turns."""

    def __init__(self, base_url: str, run: str) -> None:
        self.base_url = base_url
        self.coordinator: WarmupCoordinator | None = None
        self.hits: dict[str, list[int]] = {"planner": [], "coder": []}
        llm = ChatOpenAI(base_url=base_url + "/v1", api_key="x", model="tiny", max_tokens=1, temperature=0)

        def agent(role: str) -> Any:
            def run_node(state: State) -> dict[str, Any]:
                reply = llm.invoke([SystemMessage(instructions(role, run, sentences=30)),
                                    HumanMessage(f"{state['task']} ({role})")])
                self.hits[role].append(cached_tokens(reply))
                return {}

            return run_node

        def pause(state: State) -> dict[str, Any]:
            assert self.coordinator is not None and self.coordinator.flush(30)
            return {}

        builder = StateGraph(State)
        builder.add_node("planner", agent("planner"))
        builder.add_node("pause", pause)
        builder.add_node("coder", agent("coder"))
        builder.add_edge(START, "planner")
        builder.add_edge("planner", "pause")
        builder.add_edge("pause", "coder")
        builder.add_edge("coder", END)
        self.planner, self.coder = f"planner-{run}", f"coder-{run}"
        names = {"planner": self.planner, "pause": None, "coder": self.coder}
        self.graph = agentkv.instrument(builder.compile(), agent_names=names, events_url=base_url)

    def session(self, thread: str) -> None:
        ended = fetch_stats(self.base_url)["sessions"]["ended"]
        self.graph.invoke({"task": f"task {thread}"}, {"configurable": {"thread_id": thread}})
        wait_for(lambda: fetch_stats(self.base_url)["sessions"]["ended"] > ended, f"the end of {thread}")


def test_warmup_makes_a_cold_anchor_hit(own_agentkv_server) -> None:
    # A server of this module's own: what the server learned depends on every agent it saw.
    base = own_agentkv_server.base_url
    run = uuid.uuid4().hex[:8]
    app = App(base, run)

    server_before = fetch_stats(base)["warmups"]
    app.coordinator = WarmupCoordinator(base, learner=TransitionLearner())
    with app.coordinator as coordinator:
        app.session(f"w-{run}-1")
        assert coordinator.stats()["sent"] == 0  # nothing predicted yet
        fill_cache(base, f"{run}-1")
        app.session(f"w-{run}-2")
        client_side = coordinator.stats()

    [warm] = client_side["recent"]
    anchor = warm["anchor_tokens"]
    print(f"\nclient-side prediction: anchor {anchor} tokens ({anchor // BLOCK} blocks, {warm['source']}); "
          f"warm-up cached_tokens {warm['cached_tokens']} (cold); coder's call cached_tokens "
          f"{app.hits['coder'][-1]}; planner (not warmed) {app.hits['planner'][-1]}")
    assert warm["agent"] == app.coder and warm["after"] == app.planner
    assert anchor >= 10 * BLOCK and anchor % BLOCK == 0
    assert warm["cached_tokens"] < anchor  # the anchor was cold right before the warm-up
    assert app.hits["planner"][-1] < BLOCK  # what the fill did to an agent nobody warmed
    assert app.hits["coder"][-1] >= anchor == warm["next_call_cached_tokens"]
    assert client_side["sent"] == 1 and client_side["useful"] == 1 and client_side["failed"] == 0
    assert client_side["predictions"] == {"right": 1, "wrong": 0}
    assert client_side["errors"] == {} and client_side["unstable_prefixes"] == {}
    assert learned(fetch_stats(base), app.planner, app.coder)
    server_after = fetch_stats(base)["warmups"]
    # the server saw the warm-up and the coder's call hit every warmed block
    assert server_after["sent"] - server_before["sent"] == 1
    assert server_after["useful"] - server_before["useful"] == 1

    # The same with the server's learned transitions (no client-side learner).
    app.coordinator = WarmupCoordinator(base)
    with app.coordinator as coordinator:
        app.session(f"w-{run}-3")  # captures the anchors (the server already predicts planner -> coder)
        assert coordinator.stats()["sent"] == 0  # the coder's anchor was resident: nothing to warm
        fill_cache(base, f"{run}-3")
        app.session(f"w-{run}-4")
        server_side = coordinator.stats()
    warm = server_side["recent"][-1]
    print(f"server-side prediction: warm-up cached_tokens {warm['cached_tokens']}, coder's call cached_tokens "
          f"{app.hits['coder'][-1]} of an anchor of {warm['anchor_tokens']}")
    assert warm["agent"] == app.coder and warm["cached_tokens"] < warm["anchor_tokens"]
    assert app.hits["coder"][-1] >= warm["anchor_tokens"] >= 10 * BLOCK
    assert server_side["sent"] == 1 and server_side["useful"] == 1 and server_side["failed"] == 0
    assert server_side["skipped"].get("resident", 0) >= 1
    assert "residency_unknown" not in server_side["fallbacks"]  # the server knew the coder's anchor by then
    assert fetch_stats(base)["warmups"]["useful"] - server_after["useful"] == 1


def test_an_anchor_the_server_has_not_learned_yet_is_warmed_only_when_evicted(own_agentkv_server) -> None:
    """The server learns an agent's anchor length from its second session; before that it reports the
    cached leading blocks of the agent's latest first call, and the coordinator checks them against
    the anchor it holds. In session 2 the coder (called once, in session 1) is predicted: resident,
    it is not warmed (it was warmed blind before, to find every block cached); evicted (session 1's
    retired blocks go first when this module's other test filled the pool), it is, and the warm-up
    computes the anchor. Either way the decision knew the residency."""
    base = own_agentkv_server.base_url
    run = uuid.uuid4().hex[:8]
    app = App(base, run)
    app.coordinator = WarmupCoordinator(base, learner=TransitionLearner())
    with app.coordinator as coordinator:
        app.session(f"u-{run}-1")
        assert fetch_stats(base)["agents"][app.coder]["anchor_length_blocks"] == 0  # one session: not learned
        app.session(f"u-{run}-2")
        stats = coordinator.stats()
    assert "residency_unknown" not in stats["fallbacks"]
    if stats["sent"]:
        [warm] = stats["recent"]
        assert warm["cached_tokens"] < warm["anchor_tokens"] and stats["useful"] == 1  # it was cold
    else:
        assert stats["skipped"].get("resident", 0) == 1
    assert app.hits["coder"][-1] >= 10 * BLOCK  # the coder's call hit its anchor either way
