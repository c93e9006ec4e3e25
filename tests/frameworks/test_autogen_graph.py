"""AutoGen GraphFlow adapter: its graph as facts, its speakers following the edges that fired."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("autogen_agentchat")

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.base import TaskResult
from autogen_agentchat.messages import TextMessage
from autogen_agentchat.teams import DiGraphBuilder, GraphFlow

from agentkv.client import ERRORS
from agentkv.frameworks._autogen_graph import GraphLineage
from agentkv.frameworks.autogen import instrument, team_facts
from agentkv.protocol import validate_events

from ._fakes import FakeOpenAI
from .test_autogen import client


def graph_flow(server: FakeOpenAI, edges: list[tuple[str, str, Any]], **kwargs: Any) -> GraphFlow:
    """A GraphFlow of one agent per node of ``edges`` ((source, target, condition)), in order of appearance;
    the first one is its entry."""
    names = list(dict.fromkeys(n for source, target, _ in edges for n in (source, target)))
    agents = {n: AssistantAgent(n, model_client=client(server), system_message=f"You are {n}.") for n in names}
    builder = DiGraphBuilder()
    for agent in agents.values():
        builder.add_node(agent)
    for source, target, condition in edges:
        builder.add_edge(agents[source], agents[target], condition=condition)
    builder.set_entry_point(names[0])
    return GraphFlow(list(agents.values()), graph=builder.build(), **kwargs)


def test_graph_flow_facts_are_its_declared_graph():
    """A GraphFlow declares its graph: its edges, not all-to-all, and its start node as the only entry."""
    team = graph_flow(FakeOpenAI(), [("writer", "reviewer", None), ("reviewer", "writer", "REVISE"),
                                     ("reviewer", "publisher", "APPROVE")], max_turns=9)
    facts = team_facts(team)
    validate_events({"version": 1, "events": [facts]})
    assert facts["nodes"] == ["publisher", "reviewer", "writer"]
    assert facts["edges"] == [["writer", "reviewer"]]
    assert facts["conditional_edges"] == [["reviewer", "publisher"], ["reviewer", "writer"]]
    assert facts["entry"] == ["writer"]


def test_graph_flow_branches_and_join_follow_the_graph(server, dispatches):
    """Fan-out planner -> (coder, tester), join -> writer: both branches follow the planner at one
    step (siblings, not a chain), the join follows the branch that ended last, and no selector calls."""
    team = instrument(graph_flow(server, [("planner", "coder", None), ("planner", "tester", None),
                                          ("coder", "writer", None), ("tester", "writer", None)]), session="g-1")
    result = asyncio.run(team.run(task="build it"))
    speakers = [m.source for m in result.messages if isinstance(m, TextMessage)]
    assert speakers[0] == "user" and speakers[1] == "planner" and speakers[-1] == "writer"
    last_branch = speakers[-2]  # the branch whose answer completed the join
    assert sorted(server.tags()) == sorted([
        ("planner", "g-1", "", 1),
        ("coder", "g-1", "planner", 2),
        ("tester", "g-1", "planner", 2),
        ("writer", "g-1", last_branch, 3),
    ])
    assert sorted((d.agent, d.parent, d.step) for d in dispatches if d.session == "g-1") == [
        ("coder", "planner", 2), ("planner", "", 1), ("tester", "planner", 2), ("writer", last_branch, 3)]


def test_graph_flow_loop_follows_its_conditions_across_runs(server):
    """A review loop: each speaker follows the one whose edge fired; a run continuing the conversation
    starts at the entry again (parent "", the step going on), and after reset the old turns are gone."""
    server.script("reviewer", "REVISE: shorter", "APPROVE", "APPROVE", "APPROVE")
    team = instrument(graph_flow(server, [("writer", "reviewer", None), ("reviewer", "writer", "REVISE"),
                                          ("reviewer", "publisher", "APPROVE")], max_turns=9))

    async def two_runs_then_reset_and_one() -> None:
        await team.run(task="write it")
        await team.run(task="once more")  # the graph completed: it starts again at its entry
        await team.reset()
        await team.run(task="new")

    asyncio.run(two_runs_then_reset_and_one())
    first, second = server.tags()[0][1], server.tags()[-1][1]
    assert first != second
    assert server.tags() == [
        ("writer", first, "", 1),
        ("reviewer", first, "writer", 2),
        ("writer", first, "reviewer", 3),  # REVISE fired reviewer -> writer
        ("reviewer", first, "writer", 4),
        ("publisher", first, "reviewer", 5),  # APPROVE fired reviewer -> publisher
        ("writer", first, "", 6),
        ("reviewer", first, "writer", 7),
        ("publisher", first, "reviewer", 8),
        ("writer", second, "", 1),
        ("reviewer", second, "writer", 2),
        ("publisher", second, "reviewer", 3),
    ]


def test_a_run_after_the_graph_completed_starts_at_its_entry_even_where_an_edge_leads_back_to_it(server):
    """critic -> writer fires always: the second run's writer followed the first run's critic (a
    transition that never happened, at a step already used) though GraphFlow had gone back to its
    start node."""
    server.script("writer", "DRAFT 1", "FINAL", "FINAL")
    team = instrument(graph_flow(server, [("writer", "critic", "DRAFT"), ("critic", "writer", None),
                                          ("writer", "publisher", "FINAL")], max_turns=20), session="s1")

    async def two_runs() -> None:
        await team.run(task="write")
        await team.run(task="again")  # continues the conversation after the graph completed

    asyncio.run(two_runs())
    assert server.tags() == [("writer", "s1", "", 1), ("critic", "s1", "writer", 2), ("writer", "s1", "critic", 3),
                             ("publisher", "s1", "writer", 4),
                             ("writer", "s1", "", 5), ("publisher", "s1", "writer", 6)]


def test_graph_lineage_ignores_a_parent_whose_edge_did_not_fire():
    """``any`` activation: c runs after a's edge fired; b, which ended later, said no to its edge."""
    server = FakeOpenAI()
    agents = {n: AssistantAgent(n, model_client=client(server)) for n in "abc"}
    builder = DiGraphBuilder()
    for agent in agents.values():
        builder.add_node(agent)
    builder.add_edge(agents["a"], agents["c"], activation_condition="any")
    builder.add_edge(agents["b"], agents["c"], condition="go", activation_condition="any")
    lineage = GraphLineage(builder.build())
    lineage.begin_run(0)
    assert lineage.predecessor("a") == lineage.predecessor("b") == ("", 1)  # two start nodes: siblings
    lineage.turn_ended("a", "a", 1, TextMessage(content="done", source="a"))
    lineage.turn_ended("b", "b", 1, TextMessage(content="stop", source="b"))
    assert lineage.predecessor("c") == ("a", 2)
    lineage.turn_ended("b", "b", 1, TextMessage(content="go on", source="b"))
    assert lineage.predecessor("c") == ("b", 2)
    lineage.clear()
    assert lineage.predecessor("c") == ("", 1)


@pytest.mark.parametrize("last_read", ["writer", "publisher"])
def test_a_run_whose_consumer_stops_reading_early_still_ends_where_graphflow_does(server, last_read):
    """A consumer that closes ``run_stream`` before its ``TaskResult`` (it has the answer it wanted):
    AutoGen finishes the run anyway, and GraphFlow, its graph at its end, starts again at its start
    node; the next run's writer followed the previous run's critic (a false transition)."""
    server.script("writer", "DRAFT 1", "FINAL", "FINAL")
    team = instrument(graph_flow(server, [("writer", "critic", "DRAFT"), ("critic", "writer", None),
                                          ("writer", "publisher", "FINAL")], max_turns=20), session="s1")

    async def read_until_then_run_again() -> TaskResult:
        stream = team.run_stream(task="write")
        async for message in stream:
            if isinstance(message, TextMessage) and message.source == last_read:
                break
        await stream.aclose()
        return await team.run(task="again")

    again = asyncio.run(read_until_then_run_again())
    assert [m.source for m in again.messages] == ["user", "writer", "publisher"]  # from the start node
    assert server.tags() == [("writer", "s1", "", 1), ("critic", "s1", "writer", 2), ("writer", "s1", "critic", 3),
                             ("publisher", "s1", "writer", 4),
                             ("writer", "s1", "", 5), ("publisher", "s1", "writer", 6)]


def test_a_run_whose_consumer_stops_reading_early_resumes_a_graph_stopped_midway(server):
    """The run closed early stops midway (max_turns) with the critic -> writer edge fired: GraphFlow
    resumes there, and so does the lineage (the writer follows the critic)."""
    server.script("writer", "DRAFT 1", "FINAL")
    team = instrument(graph_flow(server, [("writer", "critic", "DRAFT"), ("critic", "writer", None),
                                          ("writer", "publisher", "FINAL")], max_turns=2), session="s1")

    async def read_one_then_run_again() -> TaskResult:
        stream = team.run_stream(task="write")
        async for message in stream:
            if isinstance(message, TextMessage) and message.source == "writer":
                break
        await stream.aclose()
        return await team.run(task="go on")

    again = asyncio.run(read_one_then_run_again())
    assert [m.source for m in again.messages] == ["user", "writer", "publisher"]
    assert server.tags() == [("writer", "s1", "", 1), ("critic", "s1", "writer", 2),
                             ("writer", "s1", "critic", 3), ("publisher", "s1", "writer", 4)]


def test_a_graph_flow_instrumented_after_it_ran_follows_its_graphs_end(server, monkeypatch):
    """Instrumented after a run: AutoGen created the manager then, so the factory hook comes too late;
    the manager it has is hooked at the next run. Unhooked, the third run's writer followed the second
    run's critic (a false transition) though GraphFlow had gone back to its start node."""
    monkeypatch.setattr(ERRORS, "by_kind", type(ERRORS.by_kind)())
    server.script(None, "DRAFT 1", "shorter", "FINAL", "published")  # the run before: its calls are untagged
    server.script("writer", "DRAFT 2", "FINAL", "FINAL")
    team = graph_flow(server, [("writer", "critic", "DRAFT"), ("critic", "writer", None),
                               ("writer", "publisher", "FINAL")], max_turns=20)

    async def run_instrument_then_two_runs() -> None:
        await team.run(task="write")  # not instrumented yet
        instrument(team, session="s1")
        await team.run(task="again")  # continues the conversation after the graph completed
        await team.run(task="once more")

    asyncio.run(run_instrument_then_two_runs())
    assert server.tags()[4:] == [("writer", "s1", "", 1), ("critic", "s1", "writer", 2),
                                 ("writer", "s1", "critic", 3), ("publisher", "s1", "writer", 4),
                                 ("writer", "s1", "", 5), ("publisher", "s1", "writer", 6)]
    assert not ERRORS.by_kind  # nothing it could not follow


def test_a_graph_flow_whose_manager_cannot_be_hooked_is_counted_not_raised(monkeypatch):
    """Another AutoGen version (no manager factory, or a manager without ``_reset_execution_state``): the
    lineage cannot follow the graph's resets, which is counted, and the team still runs (a manager
    the runtime does not hand out: test_autogen)."""
    monkeypatch.setattr(ERRORS, "by_kind", type(ERRORS.by_kind)())
    lineage = GraphLineage(graph_flow(FakeOpenAI(), [("a", "b", None)])._graph)
    lineage.follow_resets(object())
    team = type("Team", (), {"_create_group_chat_manager_factory": lambda self, **kw: object})()
    lineage.follow_resets(team)
    assert type(team._create_group_chat_manager_factory(name="m")()) is object
    lineage.follow(object())
    assert ERRORS.by_kind["autogen graph reset"] == 3


def test_graph_flow_conditions_are_asked_once_per_message_by_graphflow_only(server):
    """A callable condition may have side effects or cost: the lineage reads GraphFlow's answer for
    the turn's message instead of asking it a second time (it asked each reviewer edge twice)."""
    asked: list[tuple[str, str]] = []

    def says(word: str) -> Any:
        def condition(message: Any) -> bool:
            asked.append((word, message.content))
            return message.content.startswith(word)
        return condition

    server.script("reviewer", "REVISE: shorter", "APPROVE")
    team = instrument(graph_flow(server, [("writer", "reviewer", None), ("reviewer", "writer", says("REVISE")),
                                          ("reviewer", "publisher", says("APPROVE"))], max_turns=9), session="c1")
    asyncio.run(team.run(task="write it"))
    assert sorted(asked) == sorted((word, said) for word in ("REVISE", "APPROVE")
                                   for said in ("REVISE: shorter", "APPROVE"))
    assert server.tags() == [("writer", "c1", "", 1), ("reviewer", "c1", "writer", 2),
                             ("writer", "c1", "reviewer", 3), ("reviewer", "c1", "writer", 4),
                             ("publisher", "c1", "reviewer", 5)]


def test_graph_lineage_asks_a_condition_graphflow_did_not_ask_about_the_message():
    """No answer recorded for the turn's message (GraphFlow asked about another one, or runs
    elsewhere): the lineage asks the condition itself."""
    asked: list[str] = []
    server = FakeOpenAI()
    agents = {n: AssistantAgent(n, model_client=client(server)) for n in "ab"}
    builder = DiGraphBuilder()
    for agent in agents.values():
        builder.add_node(agent)
    builder.add_edge(agents["a"], agents["b"], condition=lambda m: asked.append(m.content) or m.content == "go")
    graph = builder.build()
    lineage = GraphLineage(graph)
    edge = graph.nodes["a"].edges[0]
    seen = TextMessage(content="go", source="a")
    assert edge.check_condition(seen)  # as GraphFlow asks it
    lineage.turn_ended("a", "a", 1, seen)
    assert lineage.predecessor("b") == ("a", 2) and asked == ["go"]
    lineage.turn_ended("a", "a", 3, TextMessage(content="stop", source="a"))
    assert lineage.predecessor("b") == ("", 1) and asked == ["go", "stop"]
