"""LangGraph adapter: exact tags across graph shapes, sync/async/streaming, facts, learner."""

from __future__ import annotations

import asyncio
import operator
import uuid
import warnings
from typing import Annotated, Any, Literal, TypedDict

import httpx
import pytest

pytest.importorskip("langgraph")

from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Command, Send, interrupt

import agentkv
from agentkv.frameworks import Dispatch, current_tag, on_dispatch_end, stats
from agentkv.frameworks.langgraph import InstrumentedGraph, graph_facts, instrument
from agentkv.graph import GraphFacts, Predictor, TransitionLearner
from agentkv.protocol import validate_events

from ._fakes import FakeOpenAI, cfg, tool_call


class Notes(TypedDict):
    notes: Annotated[list[str], operator.add]


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


# --------------------------------------------------------------------------------------
# Plain nodes, parallel branches, Send fan-out, joins
# --------------------------------------------------------------------------------------


def fan_out_app(server: FakeOpenAI, *, use_async: bool = False) -> Any:
    llm = server.chat_openai()

    def node(name: str):
        def run(state: dict[str, Any]) -> dict[str, Any]:
            llm.invoke(f"{name}{state.get('x', '')}")
            return {"notes": [name]}

        async def arun(state: dict[str, Any]) -> dict[str, Any]:
            await llm.ainvoke(f"{name}{state.get('x', '')}")
            return {"notes": [name]}

        return arun if use_async else run

    g = StateGraph(Notes)
    g.add_node("plan", node("plan"), metadata={"agentkv_agent": "Planner"})
    g.add_node("left", node("left"))
    g.add_node("right", node("right"))
    g.add_node("worker", node("worker"))
    g.add_node("join", node("join"))
    g.add_edge(START, "plan")
    g.add_edge("plan", "left")  # parallel branches
    g.add_edge("plan", "right")
    g.add_conditional_edges("left", lambda s: [Send("worker", {"x": "1"}), Send("worker", {"x": "2"})])
    g.add_edge(["worker", "right"], "join")  # waiting edge
    g.add_edge("join", END)
    return g.compile(checkpointer=InMemorySaver())


FAN_OUT_EXPECTED = {
    "plan": ("Planner", "", 1),
    "left": ("left", "Planner", 2),
    "right": ("right", "Planner", 2),
    "worker1": ("worker", "left", 3),
    "worker2": ("worker", "left", 3),
    "join": ("join", "worker", 4),
}


def _check_fan_out(server: FakeOpenAI, thread: str) -> None:
    got = server.tags_by_text()
    assert len(server.requests) == 6
    assert {k: (a, p, st) for k, (a, s, p, st) in got.items()} == FAN_OUT_EXPECTED
    assert {s for (_, s, _, _) in got.values()} == {thread}
    assert all(r.headers["x-session-id"] == thread for r in server.requests)


def test_parallel_branches_and_send_fan_out_sync(server, thread, dispatches):
    app = instrument(fan_out_app(server))
    assert isinstance(app, InstrumentedGraph)
    ended: list[Dispatch] = []
    unsubscribe = on_dispatch_end(ended.append)
    try:
        result = app.invoke({"notes": []}, cfg(thread))
    finally:
        unsubscribe()
    assert sorted(ended, key=id) == sorted((d for d in dispatches if d.session == thread), key=id)
    assert sorted(result["notes"]) == sorted(["plan", "left", "right", "worker", "worker", "join"])
    _check_fan_out(server, thread)
    # parallel tasks start in any order; each gets the parent that triggered it
    assert sorted((d.agent, d.parent, d.step) for d in dispatches if d.session == thread) == sorted(
        (a, p, s) for a, p, s in FAN_OUT_EXPECTED.values()
    )
    assert all(d.framework == "langgraph" for d in dispatches)
    assert current_tag() is None  # nothing leaks out of the run


def test_parallel_branches_and_send_fan_out_async(server, thread):
    app = instrument(fan_out_app(server, use_async=True))
    asyncio.run(app.ainvoke({"notes": []}, cfg(thread)))
    _check_fan_out(server, thread)


def test_stream_and_astream_and_astream_events(server, thread):
    app = instrument(fan_out_app(server))
    chunks = list(app.stream({"notes": []}, cfg(thread), stream_mode="updates"))
    assert len(chunks) == 6
    _check_fan_out(server, thread)

    server.requests.clear()

    async def consume() -> int:
        n = 0
        async for _ in app.astream({"notes": []}, cfg(thread + "a")):
            n += 1
        async for _ in app.astream_events({"notes": []}, cfg(thread + "e"), version="v2"):
            n += 1
        return n

    assert asyncio.run(consume()) > 0
    by_session: dict[str, list[Any]] = {}
    for r in server.requests:
        by_session.setdefault(r.tag[1], []).append(r)
    assert set(by_session) == {thread + "a", thread + "e"}
    for sess, reqs in by_session.items():
        server_view = FakeOpenAI(requests=reqs)
        _check_fan_out(server_view, sess)


def test_streaming_llm_tokens_inside_nodes(server, thread):
    llm = server.chat_openai(streaming=True)

    def a(state: Notes) -> dict[str, Any]:
        text = "".join(chunk.content for chunk in llm.stream("a"))
        return {"notes": [text]}

    async def b(state: Notes) -> dict[str, Any]:
        text = ""
        async for chunk in llm.astream("b"):
            text += chunk.content
        return {"notes": [text]}

    g = StateGraph(Notes)
    g.add_node("a", a)
    g.add_node("b", b)
    g.add_edge(START, "a")
    g.add_edge("a", "b")
    app = instrument(g.compile())

    async def run() -> list[Any]:
        return [m async for m in app.astream({"notes": []}, cfg(thread), stream_mode="messages")]

    messages = asyncio.run(run())
    assert messages and all(r.body.get("stream") for r in server.requests)
    assert server.tags() == [("a", thread, "", 1), ("b", thread, "a", 2)]


def test_raw_openai_sdk_inside_nodes_is_tagged(server, thread):
    sync_client, async_client = server.openai(), server.async_openai()

    def a(state: Notes) -> dict[str, Any]:
        sync_client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        return {"notes": ["a"]}

    async def b(state: Notes) -> dict[str, Any]:
        await async_client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}])
        return {"notes": ["b"]}

    g = StateGraph(Notes)
    g.add_node("a", a)
    g.add_node("b", b)
    g.add_edge(START, "a")
    g.add_edge("a", "b")
    app = instrument(g.compile())
    asyncio.run(app.ainvoke({"notes": []}, cfg(thread)))
    assert server.tags() == [("a", thread, "", 1), ("b", thread, "a", 2)]


def test_session_without_thread_id_is_the_root_run_id_or_explicit(server):
    llm = server.chat_openai()
    g = StateGraph(Notes)
    g.add_node("only", lambda s: {"notes": [llm.invoke("x").content]})
    g.add_edge(START, "only")
    app = instrument(g.compile())
    run_id = uuid.uuid4()
    app.invoke({"notes": []}, {"run_id": run_id})
    app.invoke({"notes": []})
    app.invoke({"notes": []}, {"metadata": {"agentkv_session": "explicit one"}})
    sessions = [r.tag[1] for r in server.requests]
    assert sessions[0] == str(run_id)
    assert sessions[1] not in (None, sessions[0])
    assert sessions[2] == "explicit_one"

    server.requests.clear()
    fixed = instrument(g.compile(), session="fixed-session")
    fixed.invoke({"notes": []})
    assert server.tags() == [("only", "fixed-session", "", 1)]

    # in the documented order: the metadata, else the thread, else instrument(session=)
    server.requests.clear()
    fixed.invoke({"notes": []}, {"configurable": {"thread_id": "t-9"}})
    fixed.invoke({"notes": []}, {"configurable": {"thread_id": "t-9"}, "metadata": {"agentkv_session": "m-9"}})
    assert [r.tag[1] for r in server.requests] == ["t-9", "m-9"]


# --------------------------------------------------------------------------------------
# Prebuilt agents, supervisors, subgraphs
# --------------------------------------------------------------------------------------


def test_create_agent_standalone_with_tool_round_trip(server, thread):
    create_agent = pytest.importorskip("langchain.agents").create_agent
    server.script("researcher", tool_call("add", {"a": 1, "b": 2}), "three")
    agent = create_agent(server.chat_openai(), [add], name="researcher")
    app = instrument(agent)
    out = app.invoke({"messages": [HumanMessage("1+2?")]}, cfg(thread))
    assert out["messages"][-1].content == "three"
    # the whole app is one agent (lc_agent_name): model -> tools -> model
    assert server.tags() == [("researcher", thread, "", 1), ("researcher", thread, "researcher", 3)]
    assert server.requests[1].body["messages"][-1]["role"] == "tool"
    assert app.facts["nodes"] == ["researcher"]


def test_create_react_agent_in_a_pipeline_with_tool_round_trip(server, thread):
    from langgraph.prebuilt import create_react_agent

    server.script("math", tool_call("add", {"a": 2, "b": 2}), "four")
    server.script("reporter", "report")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        math_agent = create_react_agent(server.chat_openai(), [add], name="math")
    llm = server.chat_openai()
    g = StateGraph(MessagesState)
    g.add_node("math", math_agent)
    g.add_node("reporter", lambda s: {"messages": [llm.invoke(s["messages"])]})
    g.add_edge(START, "math")
    g.add_edge("math", "reporter")
    app = instrument(g.compile())
    app.invoke({"messages": [HumanMessage("2+2?")]}, cfg(thread))
    # both model calls of the prebuilt agent (inner nodes agent/tools/agent) belong to the outer node
    assert server.tags() == [
        ("math", thread, "", 1),
        ("math", thread, "", 1),
        ("reporter", thread, "math", 2),
    ]


def test_create_react_agent_standalone_with_transparent_tools_node(server, thread):
    from langgraph.prebuilt import create_react_agent

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        react = create_react_agent(server.chat_openai(), [add])
    server.script("agent", tool_call("add", {"a": 1, "b": 1}), "two")
    instrument(react).invoke({"messages": [HumanMessage("1+1")]}, cfg(thread))
    assert server.tags() == [("agent", thread, "", 1), ("agent", thread, "tools", 3)]

    server.requests.clear()
    server.script("assistant", tool_call("add", {"a": 1, "b": 1}), "two")
    app = instrument(react, agent_names={"agent": "assistant", "tools": None})
    app.invoke({"messages": [HumanMessage("1+1")]}, cfg(thread + "x"))
    assert server.tags() == [("assistant", thread + "x", "", 1), ("assistant", thread + "x", "assistant", 3)]
    assert app.facts["nodes"] == ["assistant"]
    assert ["assistant", "assistant"] in app.facts["conditional_edges"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_langgraph_supervisor_app(server, thread, dispatches):
    create_supervisor = pytest.importorskip("langgraph_supervisor").create_supervisor
    create_agent = pytest.importorskip("langchain.agents").create_agent
    server.script("boss", tool_call("transfer_to_researcher"), tool_call("transfer_to_writer", call_id="c2"), "done")
    server.script("researcher", tool_call("add", {"a": 1, "b": 2}), "found 3")
    server.script("writer", "written")
    researcher = create_agent(server.chat_openai(), [add], name="researcher")
    writer = create_agent(server.chat_openai(), [], name="writer")
    app = instrument(
        create_supervisor([researcher, writer], model=server.chat_openai(), supervisor_name="boss").compile()
    )
    out = app.invoke({"messages": [HumanMessage("go")]}, cfg(thread))
    assert isinstance(out["messages"][-1], AIMessage) and out["messages"][-1].content == "done"
    assert server.tags() == [
        ("boss", thread, "", 1),
        ("researcher", thread, "boss", 2),
        ("researcher", thread, "boss", 2),
        ("boss", thread, "researcher", 3),
        ("writer", thread, "boss", 4),
        ("boss", thread, "writer", 5),
    ]
    assert [(d.agent, d.parent) for d in dispatches if d.session == thread] == [
        ("boss", ""),
        ("researcher", "boss"),
        ("boss", "researcher"),
        ("writer", "boss"),
        ("boss", "writer"),
    ]
    facts = app.facts
    assert facts["nodes"] == ["boss", "researcher", "writer"] and facts["entry"] == ["boss"]
    assert ["researcher", "boss"] in facts["edges"]
    assert {("boss", "researcher"), ("boss", "writer")} <= {tuple(e) for e in facts["conditional_edges"]}


def test_hand_built_supervisor_with_command_routing(server, thread):
    llm = server.chat_openai()
    server.script("supervisor", "coder", "critic", "FINISH")

    def supervisor(state: MessagesState) -> Command[Literal["coder", "critic", "__end__"]]:
        choice = llm.invoke(state["messages"]).content
        return Command(goto=END if choice == "FINISH" else choice)

    def worker(name: str):
        def run(state: MessagesState) -> dict[str, Any]:
            return {"messages": [AIMessage(llm.invoke(state["messages"]).content, name=name)]}

        return run

    g = StateGraph(MessagesState)
    g.add_node("supervisor", supervisor)
    g.add_node("coder", worker("coder"))
    g.add_node("critic", worker("critic"))
    g.add_edge(START, "supervisor")
    g.add_edge("coder", "supervisor")
    g.add_edge("critic", "supervisor")
    app = instrument(g.compile())
    app.invoke({"messages": [HumanMessage("task")]}, cfg(thread))
    assert server.tags() == [
        ("supervisor", thread, "", 1),
        ("coder", thread, "supervisor", 2),
        ("supervisor", thread, "coder", 3),
        ("critic", thread, "supervisor", 4),
        ("supervisor", thread, "critic", 5),
    ]
    assert {("supervisor", "coder"), ("supervisor", "critic")} <= {tuple(e) for e in app.facts["conditional_edges"]}


def draft_review(llm: Any) -> StateGraph:
    """A two-node graph (draft, then review), each node one call of ``llm``: a typical subgraph."""
    inner = StateGraph(Notes)
    inner.add_node("draft", lambda s: {"notes": [llm.invoke("draft").content]})
    inner.add_node("review", lambda s: {"notes": [llm.invoke("review").content]})
    inner.add_edge(START, "draft")
    inner.add_edge("draft", "review")
    return inner


def test_subgraph_calls_belong_to_the_outer_agent(server, thread):
    llm = server.chat_openai()
    team = draft_review(llm).compile()

    outer = StateGraph(Notes)
    outer.add_node("intake", lambda s: {"notes": [llm.invoke("intake").content]})
    outer.add_node("team", team)  # subgraph as a node
    outer.add_node("wrapper", lambda s: team.invoke(s))  # subgraph invoked inside a node
    outer.add_edge(START, "intake")
    outer.add_edge("intake", "team")
    outer.add_edge("team", "wrapper")
    app = instrument(outer.compile(checkpointer=InMemorySaver()))
    app.invoke({"notes": []}, cfg(thread))
    assert server.tags() == [
        ("intake", thread, "", 1),
        ("team", thread, "intake", 2),
        ("team", thread, "intake", 2),
        ("wrapper", thread, "team", 3),
        ("wrapper", thread, "team", 3),
    ]


def test_interrupt_resume_continues_the_lineage(server, thread):
    llm = server.chat_openai()

    def ask(state: Notes) -> dict[str, Any]:
        llm.invoke("ask")
        return {"notes": ["asked"]}

    def human(state: Notes) -> dict[str, Any]:
        return {"notes": [interrupt("approve?")]}

    def act(state: Notes) -> dict[str, Any]:
        llm.invoke("act")
        return {"notes": ["acted"]}

    g = StateGraph(Notes)
    for name, fn in (("ask", ask), ("human", human), ("act", act)):
        g.add_node(name, fn)
    g.add_edge(START, "ask")
    g.add_edge("ask", "human")
    g.add_edge("human", "act")
    app = instrument(g.compile(checkpointer=InMemorySaver()), agent_names={"human": None})
    app.invoke({"notes": []}, cfg(thread))
    app.invoke(Command(resume="yes"), cfg(thread))
    assert server.tags() == [("ask", thread, "", 1), ("act", thread, "ask", 3)]
    assert app.get_state(cfg(thread)).values["notes"] == ["asked", "yes", "acted"]


# --------------------------------------------------------------------------------------
# Facts, passthrough, learner
# --------------------------------------------------------------------------------------


def test_facts_include_untyped_router_targets_hidden_by_get_graph(server):
    g = StateGraph(Notes)
    for n in ("a", "b", "c"):
        g.add_node(n, lambda s: {})
    g.add_edge(START, "a")
    g.add_conditional_edges("a", lambda s: "b")  # untyped: get_graph() cannot see targets
    g.add_conditional_edges("b", lambda s: "x", {"x": "c", "y": END})  # typed by path_map
    g.add_edge("c", END)
    compiled = g.compile()
    drawn = {(e.source, e.target) for e in compiled.get_graph().edges}
    assert ("a", "b") not in drawn  # an untyped router draws no edge
    facts = graph_facts(compiled)
    validate_events({"version": 1, "events": [facts]})
    assert facts["nodes"] == ["a", "b", "c"] and facts["entry"] == ["a"]
    assert {("a", "b"), ("a", "c"), ("a", "__end__"), ("b", "c"), ("b", "__end__")} <= {
        tuple(e) for e in facts["conditional_edges"]
    }
    assert ("b", "a") not in {tuple(e) for e in facts["conditional_edges"]}
    assert ["c", "__end__"] in facts["edges"] and ["__start__", "a"] in facts["edges"]

    # a node mapped to None is contracted away: a -> (b) -> c
    contracted = graph_facts(compiled, agent_names={"b": None})
    assert contracted["nodes"] == ["a", "c"]
    assert ["a", "c"] in contracted["conditional_edges"]

    facts_store = GraphFacts()
    facts_store.apply(facts)
    assert facts_store.successors("b") == {"c"} and facts_store.entry == {"a"}


def test_passthrough_of_the_compiled_app(server, thread):
    compiled = fan_out_app(server)
    app = instrument(compiled)
    assert app.original is compiled
    assert app.checkpointer is compiled.checkpointer
    assert app.config["callbacks"] == [app.handler]
    assert app.get_graph().nodes.keys() == compiled.get_graph().nodes.keys()
    assert app.name == compiled.name and app.builder is compiled.builder
    app.invoke({"notes": []}, cfg(thread))
    assert len(app.get_state(cfg(thread)).values["notes"]) == 6
    assert len(compiled.get_state(cfg(thread)).values["notes"]) == 6  # same checkpointer
    again = app.with_config(tags=["x"])
    server.requests.clear()
    again.invoke({"notes": []}, cfg(thread + "w"))
    assert len(server.requests) == 6 and server.requests[0].tag == ("Planner", thread + "w", "", 1)


def test_user_callbacks_still_run(server, thread):
    from langchain_core.callbacks import BaseCallbackHandler

    class Counter(BaseCallbackHandler):
        starts = 0

        def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
            Counter.starts += 1

    app = instrument(fan_out_app(server))
    app.invoke({"notes": []}, {**cfg(thread), "callbacks": [Counter()]})
    assert Counter.starts == 6
    _check_fan_out(server, thread)


def test_learner_gets_facts_and_dispatches(server, thread):
    learner = Predictor(TransitionLearner(), GraphFacts())
    app = instrument(fan_out_app(server), learner=learner)
    assert learner.facts.has_graph and learner.facts.entry == {"Planner"}
    app.invoke({"notes": []}, cfg(thread))
    assert learner.learner.dispatches == 6
    assert learner.next_distribution("Planner").keys() == {"left", "right"}
    assert not learner.facts.is_ended(thread)  # a checkpointed thread goes on
    app.end_session(thread)
    assert learner.facts.is_ended(thread)
    app.close()
    app.invoke({"notes": []}, cfg(thread + "2"))
    assert learner.learner.dispatches == 6


def test_a_warmup_coordinator_beside_instrument_feeds_a_shared_learner_once(server, thread):
    from agentkv.warmup import WarmupCoordinator

    learner = TransitionLearner()
    app = instrument(fan_out_app(server), learner=learner)
    down = httpx.MockTransport(lambda request: httpx.Response(503))  # its warm-ups fail, counted
    with WarmupCoordinator("http://127.0.0.1:9", learner=learner, feed_learner=False, transport=down):
        app.invoke({"notes": []}, cfg(thread))
    assert learner.dispatches == 6  # instrument's feed only
    with WarmupCoordinator("http://127.0.0.1:9", learner=learner, transport=down):
        app.invoke({"notes": []}, cfg(thread + "-twice"))
    assert learner.dispatches == 6 + 2 * 6  # both feed it: what feed_learner=False is for
    app.close()


def test_top_level_instrument_is_the_langgraph_one(server, thread):
    app = agentkv.instrument(fan_out_app(server))
    app.invoke({"notes": []}, cfg(thread))
    _check_fan_out(server, thread)
    assert stats()["counts"]["langgraph_runs"] >= 1


def test_a_run_ends_its_session_unless_the_graph_keeps_the_thread(server, thread):
    """A chat's next message continues a checkpointed thread: its runs do not end the session
    (an end would make the server evict the conversation first); a run without kept thread
    state, or without a thread, is the whole session."""
    from agentkv.frameworks import on_session_end  # local episode ends: every run
    from agentkv.graph import GraphFacts

    llm = server.chat_openai()
    g = StateGraph(Notes)
    g.add_node("only", lambda s: {"notes": [llm.invoke("x").content]})
    g.add_edge(START, "only")
    runs: list[str] = []
    unsubscribe = on_session_end(runs.append)
    try:
        kept, facts = GraphFacts(), GraphFacts()
        chat = instrument(g.compile(checkpointer=InMemorySaver()), learner=kept)
        chat.invoke({"notes": []}, cfg(thread))
        chat.invoke({"notes": []}, cfg(thread))
        assert not kept.is_ended(thread) and runs == [thread, thread]
        chat.end_session(thread)
        assert kept.is_ended(thread)
        one_shot = instrument(g.compile(), learner=facts)
        one_shot.invoke({"notes": []}, cfg(thread + "-once"))
        assert facts.is_ended(thread + "-once")
    finally:
        unsubscribe()


def test_a_new_invoke_on_the_same_thread_starts_a_new_lineage(server, thread):
    app = instrument(fan_out_app(server))
    app.invoke({"notes": []}, cfg(thread))
    server.requests.clear()
    app.invoke({"notes": []}, cfg(thread))
    first = server.tags_by_text()["plan"]
    assert first[:3] == ("Planner", thread, "")  # an entry dispatch again
    assert first[3] > 4  # LangGraph's step continues along the thread's checkpoints
    assert server.tags_by_text()["join"][2] == "worker"


def test_an_async_run_leaves_the_callers_tag_as_it_found_it(server, thread):
    """LangGraph calls an async node's start callback in the caller's task but its end callback in a
    child task: after ainvoke or an astream (finished or closed early) the caller's requests must
    not carry the last node's tag, and an enclosing scope's tag must be current again."""
    app = instrument(fan_out_app(server, use_async=True))
    plain = server.async_openai()

    async def runs() -> list[Any]:
        seen = []
        await app.ainvoke({"notes": []}, cfg(thread))
        seen.append(current_tag())
        async for _ in app.astream({"notes": []}, cfg(thread + "-all")):
            pass
        seen.append(current_tag())
        stream = app.astream({"notes": []}, cfg(thread + "-one"))
        await anext(stream)
        await stream.aclose()
        seen.append(current_tag())
        await plain.chat.completions.create(model="m", messages=[{"role": "user", "content": "after"}])
        async with agentkv.agent("outer", session=thread + "-outer") as outer:
            await app.ainvoke({"notes": []}, cfg(thread + "-in"))
            seen.append(current_tag() == outer)
        return seen

    assert asyncio.run(runs()) == [None, None, None, True]
    assert server.tags_by_text()["after"] == (None, None, None, None)


def test_instrumenting_an_instrumented_app_returns_it(server, thread, dispatches):
    app = instrument(fan_out_app(server))
    assert instrument(app) is app and agentkv.instrument(app, learner=TransitionLearner()) is app
    assert app.config["callbacks"] == [app.handler]
    app.invoke({"notes": []}, cfg(thread))
    assert len([d for d in dispatches if d.session == thread]) == 6  # each once


def test_a_model_run_outside_any_graph_run_is_tagged_with_the_apps_session(server):
    """A chat model given the app's callbacks but run outside the graph (no graph run known)."""
    session = f"outside-{uuid.uuid4().hex[:8]}"  # a session no other test's lineage names
    app = instrument(fan_out_app(server), session=session)
    kind = "langgraph chat model start"
    errors_before = stats()["errors"].get(kind, 0)
    server.chat_openai().invoke("hi", config={"callbacks": [app.handler], "metadata": {"langgraph_node": "plan"}})
    assert server.tags() == [("plan", session, "", None)]
    assert stats()["errors"].get(kind, 0) == errors_before
    assert current_tag() is None
