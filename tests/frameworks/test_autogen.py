"""AutoGen adapter: speakers and selector tagged exactly, streaming, facts, events (GraphFlow: test_autogen_graph)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

pytest.importorskip("autogen_agentchat")

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.base import TaskResult
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.teams import RoundRobinGroupChat, SelectorGroupChat
from autogen_ext.models.openai import OpenAIChatCompletionClient

from agentkv.client import ERRORS
from agentkv.frameworks import Dispatch, current_tag, on_dispatch_end
from agentkv.frameworks.autogen import TaggedModelClient, instrument, instrumentation, team_facts
from agentkv.graph import TransitionLearner
from agentkv.protocol import validate_events

from ._fakes import BASE_URL, EventsServer, FakeOpenAI, closed_port_url, tool_call

MODEL = "gpt-4o-mini-2024-07-18"  # a model autogen-ext knows (model_info), echoed back by the fake


def client(server: FakeOpenAI) -> OpenAIChatCompletionClient:
    return OpenAIChatCompletionClient(
        model=MODEL, api_key="sk-test", base_url=BASE_URL, http_client=server.async_http_client(), max_retries=0
    )


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def make_team(server: FakeOpenAI, *, messages: int = 5, streaming: tuple[str, ...] = (), **kwargs: Any) -> Any:
    shared = client(server)  # one client shared by all participants: each still gets its own tag
    agents = [
        AssistantAgent(
            name,
            model_client=shared,
            description=f"the {name}",
            system_message=f"You are the {name}.",
            model_client_stream=name in streaming,
            tools=[add] if name == "coder" else None,
            reflect_on_tool_use=name == "coder",
        )
        for name in ("planner", "coder", "critic")
    ]
    return SelectorGroupChat(
        agents, model_client=client(server), termination_condition=MaxMessageTermination(messages), **kwargs
    )


def test_selector_group_chat_tags_speakers_and_selector(server, dispatches):
    server.script("selector", "coder", "critic", "planner", "coder")
    server.script("coder", tool_call("add", {"a": 1, "b": 2}), "three")  # tool round trip in one turn
    team = instrument(make_team(server, streaming=("critic",)), session="run-1")
    ended: list[Dispatch] = []
    unsubscribe = on_dispatch_end(ended.append)
    try:
        result = asyncio.run(team.run(task="build it"))
    finally:
        unsubscribe()
    assert ended == [d for d in dispatches if d.session == "run-1"]  # each turn ended, in order
    speakers = [m.source for m in result.messages if type(m).__name__ == "TextMessage"]
    assert speakers == ["user", "coder", "critic", "planner", "coder"]
    assert server.tags() == [
        ("selector", "run-1", "", 0),
        ("coder", "run-1", "", 1),
        ("coder", "run-1", "", 1),  # after the tool result (reflect_on_tool_use): same dispatch
        ("selector", "run-1", "coder", 1),
        ("critic", "run-1", "coder", 2),  # streamed
        ("selector", "run-1", "critic", 2),
        ("planner", "run-1", "critic", 3),
        ("selector", "run-1", "planner", 3),
        ("coder", "run-1", "planner", 4),
    ]
    assert server.requests[2].body["messages"][-1]["role"] == "tool"
    assert server.requests[4].body.get("stream") is True
    assert [(d.agent, d.parent, d.step, d.framework) for d in dispatches if d.session == "run-1"] == [
        ("coder", "", 1, "autogen"),
        ("critic", "coder", 2, "autogen"),
        ("planner", "critic", 3, "autogen"),
        ("coder", "planner", 4, "autogen"),
    ]
    state = instrumentation(team)
    assert state.speakers == [
        ("coder", "", 1),
        ("critic", "coder", 2),
        ("planner", "critic", 3),
        ("coder", "planner", 4),
    ]
    assert current_tag() is None


def test_selector_calls_are_learned_as_interposed_between_speaker_turns(server):
    server.script("selector", "planner", "coder", "critic", "coder", "critic", "planner")
    team = instrument(make_team(server, messages=7), session="chain")
    asyncio.run(team.run(task="build it"))
    assert server.tags() == [
        ("selector", "chain", "", 0),
        ("planner", "chain", "", 1),
        ("selector", "chain", "planner", 1),  # the last speaker's parent and step
        ("coder", "chain", "planner", 2),  # the previous speaker, not the selector
        ("selector", "chain", "coder", 2),
        ("critic", "chain", "coder", 3),
        ("selector", "chain", "critic", 3),
        ("coder", "chain", "critic", 4),
        ("selector", "chain", "coder", 4),
        ("critic", "chain", "coder", 5),
        ("selector", "chain", "critic", 5),
        ("planner", "chain", "critic", 6),
    ]
    learner = TransitionLearner()  # what the server learns from these tags
    for agent, session, parent, step in server.tags():
        learner.observe(agent, session, parent, step=step)
    agents, counts = learner.agents, learner.counts()
    chain = {(agents[i], agents[j]): counts[i, j] for i, j in zip(*np.nonzero(counts), strict=True)}
    assert chain == {("planner", "coder"): 1, ("coder", "critic"): 2, ("critic", "coder"): 1, ("critic", "planner"): 1}
    assert dict(zip(agents, learner.interposed_rate().tolist(), strict=True)) == {
        "selector": 1.0, "planner": 0.0, "coder": 0.0, "critic": 0.0
    }
    assert learner.entry_counts().tolist() == [1.0, 1.0, 0.0, 0.0]  # the first pick comes before any speaker
    assert learner.current_agent("chain") == "planner"


def test_two_agents_selector_called_once_and_streaming_selector(server):
    agents = [
        AssistantAgent(n, model_client=client(server), description=n, model_client_stream=True) for n in ("a", "b")
    ]
    team = SelectorGroupChat(
        agents,
        model_client=client(server),
        model_client_streaming=True,
        termination_condition=MaxMessageTermination(4),
    )
    server.script("selector", "b")
    instrument(team, session=lambda: "fixed")
    asyncio.run(team.run(task="go"))
    # with two agents and no repeats, AutoGen picks the only candidate without the model
    assert server.tags() == [
        ("selector", "fixed", "", 0),
        ("b", "fixed", "", 1),
        ("a", "fixed", "b", 2),
        ("b", "fixed", "a", 3),
    ]
    assert all(r.body.get("stream") for r in server.requests)


def test_run_stream_new_session_per_run_and_lineage_reset(server):
    team = instrument(make_team(server, messages=3))
    server.script("selector", "planner", "critic", "critic", "planner")

    async def both() -> list[Any]:
        out = []
        async for item in team.run_stream(task="first"):
            out.append(item)
        await team.reset()
        result = await team.run(task="second")
        return [out[-1], result]

    first, second = asyncio.run(both())
    assert isinstance(first, TaskResult) and isinstance(second, TaskResult)
    sessions = [r.tag[1] for r in server.requests]
    assert len(set(sessions)) == 2 and None not in sessions
    s1, s2 = sessions[0], sessions[-1]
    assert [t for t in server.tags() if t[1] == s1] == [
        ("selector", s1, "", 0),
        ("planner", s1, "", 1),
        ("selector", s1, "planner", 1),
        ("critic", s1, "planner", 2),
    ]
    assert [t for t in server.tags() if t[1] == s2] == [
        ("selector", s2, "", 0),
        ("critic", s2, "", 1),
        ("selector", s2, "critic", 1),
        ("planner", s2, "critic", 2),
    ]


def test_a_run_without_reset_continues_the_conversation_and_its_session(server):
    """AutoGen keeps the team's messages between runs: the next run's prompts extend the last
    one's, so it is the same session (and lineage) until ``reset``; ending it at each run would
    make the server evict the conversation first."""
    team = instrument(make_team(server, messages=2))
    server.script("selector", "planner", "critic")

    async def follow_up() -> None:
        await team.run(task="first")
        await team.run(task="and then")

    asyncio.run(follow_up())
    session = server.tags()[0][1]
    assert server.tags() == [
        ("selector", session, "", 0),
        ("planner", session, "", 1),
        ("selector", session, "planner", 1),  # the second run's first pick closes the planner's turn
        ("critic", session, "planner", 2),
    ]
    assert instrumentation(team).conversation == session
    asyncio.run(team.reset())
    assert instrumentation(team).conversation is None


def test_a_reset_autogen_refuses_while_the_team_runs_leaves_its_session(server):
    """AutoGen refuses ``reset`` while a run is in progress and keeps the conversation: so does agentkv
    (it ended the session, and the run's next speaker started a new one)."""
    team = instrument(make_team(server, messages=3))
    server.script("selector", "planner", "critic")

    async def reset_midway() -> None:
        async for item in team.run_stream(task="go"):
            if getattr(item, "source", None) == "planner":
                with pytest.raises(RuntimeError):
                    await team.reset()

    asyncio.run(reset_midway())
    session = server.tags()[0][1]
    assert server.tags() == [
        ("selector", session, "", 0),
        ("planner", session, "", 1),
        ("selector", session, "planner", 1),
        ("critic", session, "planner", 2),
    ]
    assert instrumentation(team).conversation == session


def test_instrument_is_idempotent_and_keeps_the_team_usable(server):
    team = make_team(server)
    assert instrument(team) is team and instrument(team) is team
    assert isinstance(team._model_client, TaggedModelClient)
    assert not isinstance(team._model_client.inner, TaggedModelClient)
    assert team._participants[0]._model_client.model_info["family"]
    config = team.dump_component()  # still serializable
    assert config.config["model_client"]["provider"].endswith("OpenAIChatCompletionClient")


def test_team_facts():
    server = FakeOpenAI()
    facts = team_facts(make_team(server))
    validate_events({"version": 1, "events": [facts]})
    assert facts["nodes"] == ["coder", "critic", "planner"]
    pairs = {tuple(e) for e in facts["conditional_edges"]}
    assert len(pairs) == 6 and ("coder", "coder") not in pairs  # no repeats by default
    assert facts["entry"] == ["coder", "critic", "planner"]

    repeat = team_facts(make_team(server, allow_repeated_speaker=True))
    assert ("coder", "coder") in {tuple(e) for e in repeat["conditional_edges"]}

    rr = RoundRobinGroupChat(
        [AssistantAgent(n, model_client=client(server)) for n in ("x", "y", "z")],
        termination_condition=MaxMessageTermination(2),
    )
    rr_facts = team_facts(rr)
    assert rr_facts["edges"] == [["x", "y"], ["y", "z"], ["z", "x"]] and rr_facts["entry"] == ["x"]

    team = make_team(server)
    team.allowed_transitions = {"planner": ["coder"], "coder": ["critic"], "critic": ["planner", "coder"]}
    declared = team_facts(team)
    assert declared["conditional_edges"] == [
        ["coder", "critic"],
        ["critic", "coder"],
        ["critic", "planner"],
        ["planner", "coder"],
    ]


def test_round_robin_is_tagged_too(server):
    rr = RoundRobinGroupChat(
        [AssistantAgent(n, model_client=client(server)) for n in ("x", "y")],
        termination_condition=MaxMessageTermination(4),
    )
    instrument(rr, session="rr")
    asyncio.run(rr.run(task="go"))
    assert server.tags() == [("x", "rr", "", 1), ("y", "rr", "x", 2), ("x", "rr", "y", 3)]


def test_events_and_a_down_server(server):
    with EventsServer() as events:
        team = instrument(make_team(server, messages=2), session="ev-1", events_url=events.url)
        server.script("selector", "planner")
        asyncio.run(team.run(task="go"))
        assert instrumentation(team).sink.flush(5)
        kinds = [(e["type"], e.get("session")) for e in events.events()]
        assert ("session_start", "ev-1") in kinds and ("session_end", "ev-1") not in kinds  # the team goes on
        asyncio.run(team.reset())
        assert instrumentation(team).sink.flush(5)
    for body in events.bodies:
        validate_events(body["json"])
    kinds = [(e["type"], e.get("session")) for e in events.events()]
    assert kinds.index(("session_start", "ev-1")) < kinds.index(("session_end", "ev-1"))
    assert any(e["type"] == "graph" and e["nodes"] == ["coder", "critic", "planner"] for e in events.events())

    server.requests.clear()
    down = instrument(make_team(server, messages=2), session="ev-2", events_url=closed_port_url())
    server.script("selector", "critic")
    result = asyncio.run(down.run(task="go"))
    assert result.messages[-1].source == "critic"
    assert server.tags() == [("selector", "ev-2", "", 0), ("critic", "ev-2", "", 1)]
    assert instrumentation(down).sink.flush(5)
    assert instrumentation(down).sink.failed > 0


def test_closing_run_stream_early_lets_the_team_run_again(server):
    """Stopping a run by closing its stream (e.g. the user cancels) must stop AutoGen's run too:
    a run left open keeps the team "already running" and refuses the next one."""
    server.script("selector", "planner", "coder", "critic")
    team = instrument(make_team(server, messages=6), session="closed-early")

    async def stop_then_run_again() -> TaskResult:
        stream = team.run_stream(task="go")
        async for message in stream:
            if getattr(message, "source", "user") != "user":
                break  # the first speaker answered: enough
        await stream.aclose()
        return await team.run(task="go on")

    result = asyncio.run(stop_then_run_again())
    assert isinstance(result, TaskResult)
    assert {t[1] for t in server.tags()} == {"closed-early"}
    assert instrumentation(team).session is None  # both runs ended


def test_a_run_refused_while_the_team_runs_leaves_the_running_one_its_session(server):
    """AutoGen refuses a second run while one is in progress; the refused run must change nothing
    (neither the running run's session nor its lineage)."""
    server.script("selector", "planner", "coder", "critic")
    team = instrument(make_team(server, messages=4), session="busy")

    async def run_with_an_interloper() -> str:
        refused = ""
        async for message in team.run_stream(task="go"):
            if getattr(message, "source", "") == "planner" and not refused:
                try:
                    await team.run(task="me too")
                except ValueError as exc:
                    refused = str(exc)
        return refused

    assert "already running" in asyncio.run(run_with_an_interloper())
    assert server.tags() == [
        ("selector", "busy", "", 0),
        ("planner", "busy", "", 1),
        ("selector", "busy", "planner", 1),
        ("coder", "busy", "planner", 2),
        ("selector", "busy", "coder", 2),
        ("critic", "busy", "coder", 3),
    ]


def test_agents_shared_by_several_teams_are_tagged_for_the_team_running(server):
    """A team built per request from the same agents: each agent is wrapped once, and its calls
    carry the session of whichever of its teams is running."""
    shared = client(server)
    agents = [AssistantAgent(name, model_client=shared) for name in ("x", "y")]
    teams = [
        instrument(RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(3)), session=f"req-{i}")
        for i in range(3)
    ]
    assert not hasattr(agents[0].on_messages_stream.__agentkv_original__, "__agentkv_original__")
    assert not isinstance(agents[0]._model_client.inner, TaggedModelClient)

    async def run(team: Any) -> None:
        await team.run(task="go")
        await team.reset()

    for team, session in ((teams[2], "req-2"), (teams[0], "req-0")):
        server.requests.clear()
        asyncio.run(run(team))
        assert [t[:2] for t in server.tags()] == [("x", session), ("y", session)]


def test_a_selector_group_chat_instrumented_after_it_ran_tags_the_selector(server, monkeypatch):
    """AutoGen handed the selector's client to the manager at the first run, before ``instrument``:
    the selector's calls stayed untagged (and an error was counted); the manager found in the team's
    runtime at the next run gets the tagged client, as if instrumented before its first run."""
    monkeypatch.setattr(ERRORS, "by_kind", type(ERRORS.by_kind)())
    server.script(None, "planner", "planned")  # the run before: its calls are untagged
    server.script("selector", "coder", "critic", "planner")
    team = make_team(server, messages=2)

    async def run_instrument_then_two_runs() -> None:
        await team.run(task="plan")  # not instrumented yet
        instrument(team, session="late")
        await team.run(task="code")
        await team.run(task="review")

    asyncio.run(run_instrument_then_two_runs())
    assert server.tags()[2:] == [
        ("selector", "late", "", 0),
        ("coder", "late", "", 1),
        ("selector", "late", "coder", 1),
        ("critic", "late", "coder", 2),
    ]
    assert not ERRORS.by_kind


def test_a_manager_not_found_in_the_runtime_is_counted_once_and_the_team_still_runs(server, monkeypatch):
    """A runtime that does not hand out its agents (they run in another process): the manager created
    before ``instrument`` keeps its untagged client, which is counted (looked up once), not raised."""
    monkeypatch.setattr(ERRORS, "by_kind", type(ERRORS.by_kind)())
    server.script(None, "planner", "planned", "coder", "critic")
    team = make_team(server, messages=2)

    async def elsewhere(agent_id: Any) -> Any:
        raise LookupError(agent_id)

    async def run_instrument_then_two_runs() -> list[TaskResult]:
        await team.run(task="plan")
        monkeypatch.setattr(team._runtime, "try_get_underlying_agent_instance", elsewhere)
        instrument(team, session="elsewhere")
        return [await team.run(task="code"), await team.run(task="review")]

    results = asyncio.run(run_instrument_then_two_runs())
    assert [r.messages[-1].source for r in results] == ["coder", "critic"]
    assert server.tags()[2:] == [(None, None, None, None), ("coder", "elsewhere", "", 1),
                                 (None, None, None, None), ("critic", "elsewhere", "coder", 2)]
    assert dict(ERRORS.by_kind) == {"autogen manager": 1}
