"""AutoGen adapter: ``team.load_state`` replaces the team's conversation, so it ends its session, and the
loaded conversation's next speaker follows the turn it resumes after."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

pytest.importorskip("autogen_agentchat")

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.messages import MessageFactory
from autogen_agentchat.teams import RoundRobinGroupChat

from agentkv.client import ERRORS
from agentkv.frameworks.autogen import instrument, instrumentation

from ._fakes import EventsServer
from .test_autogen import client, make_team
from .test_autogen_graph import graph_flow

REVIEW_LOOP = [("writer", "critic", "DRAFT"), ("critic", "writer", None), ("writer", "publisher", "FINAL")]


def sessions(prefix: str) -> Any:
    """A session function naming each conversation ``prefix1``, ``prefix2``, ..."""
    numbers: Iterator[int] = iter(range(1, 100))
    return lambda: f"{prefix}{next(numbers)}"


def test_a_graph_flow_loading_a_start_of_graph_state_midway_starts_a_new_session_at_its_entry(server):
    """Midway (the critic -> writer edge fired), the team loads a state saved before its first run:
    the writer then ran as the graph's entry, but was tagged as going on in the old session after
    the critic (a transition that did not happen, at step 3)."""
    server.script("writer", "DRAFT 1", "FINAL")
    team = instrument(graph_flow(server, REVIEW_LOOP, max_turns=2), session=sessions("g"))

    async def run_midway_then_load_the_start() -> None:
        start = await team.save_state()
        await team.run(task="write")  # writer, critic: stopped with the writer ready
        await team.load_state(start)
        await team.run(task="write")

    asyncio.run(run_midway_then_load_the_start())
    assert server.tags() == [("writer", "g1", "", 1), ("critic", "g1", "writer", 2),
                             ("writer", "g2", "", 1), ("publisher", "g2", "writer", 2)]


@pytest.mark.parametrize("loader", ["fresh", "completed"])
def test_a_graph_flow_loading_a_state_saved_midway_resumes_after_its_last_turn(server, loader):
    """A state saved midway (critic -> writer fired) loaded by a team that never ran or whose graph ran
    to its end: the writer resumes after the critic at the loaded conversation's next step; it was
    tagged as the entry of the session."""
    server.script(None, "DRAFT 1", "shorter")  # the saving team is not instrumented
    saver = graph_flow(server, REVIEW_LOOP, max_turns=2)
    team = instrument(graph_flow(server, REVIEW_LOOP, max_turns=20), session=sessions("r"))

    async def save_midway_then_load_and_resume() -> None:
        await saver.run(task="write")  # not instrumented: writer, critic
        midway = await saver.save_state()
        if loader == "completed":
            server.script("writer", "FINAL")
            await team.run(task="other")  # writer, publisher: the graph's end
        server.script("writer", "FINAL")
        await team.load_state(midway)
        await team.run(task="go on")

    asyncio.run(save_midway_then_load_and_resume())
    before = [("writer", "r1", "", 1), ("publisher", "r1", "writer", 2)] if loader == "completed" else []
    session = "r2" if loader == "completed" else "r1"
    assert server.tags()[2:] == [*before, ("writer", session, "critic", 3), ("publisher", session, "writer", 4)]


def test_a_selector_group_chat_loading_a_state_resumes_after_the_last_speaker(server):
    """The selector's first pick and the next speaker follow the loaded conversation's last speaker
    (they were tagged as the first of a session: parent "", step 0 and 1)."""
    server.script(None, "planner", "planned", "coder", "coded")  # the saving team is not instrumented
    server.script("selector", "critic")
    saver = make_team(server, messages=3)
    team = instrument(make_team(server, messages=2), session="loaded")

    async def save_then_load_and_run() -> None:
        await saver.run(task="build it")  # planner, coder
        await team.load_state(await saver.save_state())
        await team.run(task="review it")

    asyncio.run(save_then_load_and_run())
    assert server.tags()[4:] == [("selector", "loaded", "coder", 2), ("critic", "loaded", "coder", 3)]


def test_a_round_robin_loading_a_state_ends_its_session_and_starts_the_loaded_one(server):
    """Loading replaces the conversation the way ``reset`` ends it: ``session_end`` for the old one,
    and the loaded conversation is a new session (it went on in the old one, after its last speaker)."""
    agents = [AssistantAgent(n, model_client=client(server)) for n in ("x", "y", "z")]
    team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(2))
    with EventsServer() as events:
        instrument(team, session=sessions("rr"), events_url=events.url)

        async def run_load_run() -> None:
            start = await team.save_state()
            await team.run(task="go")  # x
            await team.load_state(start)
            await team.run(task="go")  # x again: the loaded state starts at x
        asyncio.run(run_load_run())
        assert instrumentation(team).sink.flush(5)
    assert server.tags() == [("x", "rr1", "", 1), ("x", "rr2", "", 1)]
    kinds = [(e["type"], e.get("session")) for e in events.events() if e["type"] != "graph"]
    assert kinds == [("session_start", "rr1"), ("session_end", "rr1"), ("session_start", "rr2")]


class Unreadable(MessageFactory):
    """A message factory that knows none of the messages of a state (e.g. types agentkv cannot import)."""

    def create(self, data: Mapping[str, Any]) -> Any:
        raise ValueError(f"unknown message type {data.get('type')}")


def test_a_load_autogen_refuses_or_agentkv_cannot_read_is_counted_not_raised(server, monkeypatch):
    """A load AutoGen refuses (bad state) leaves the conversation and its session; a state agentkv cannot
    read still ends them, its next speaker an entry, counted and not raised."""
    monkeypatch.setattr(ERRORS, "by_kind", type(ERRORS.by_kind)())
    server.script("selector", "planner", "coder")
    team = instrument(make_team(server, messages=2), session=sessions("b"))

    async def refused_then_unreadable() -> None:
        await team.run(task="go")
        with pytest.raises(ValueError):
            await team.load_state({"agent_states": {}})
        assert instrumentation(team).conversation == "b1"
        state = await team.save_state()
        monkeypatch.setattr(team, "_message_factory", Unreadable())  # the manager keeps its own
        await team.load_state(state)
        await team.run(task="go")

    asyncio.run(refused_then_unreadable())
    assert server.tags() == [("selector", "b1", "", 0), ("planner", "b1", "", 1),
                             ("selector", "b2", "", 0), ("coder", "b2", "", 1)]
    assert ERRORS.by_kind["autogen load"] == 1
