"""``agentkv.instrument(app)`` is used wherever a compiled graph is: as a langchain ``Runnable``
composed with ``|``, as a subgraph node of a parent graph, and re-configured with ``with_config``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytest.importorskip("langgraph")

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables import Runnable, RunnableLambda
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

from agentkv.frameworks import EventSink
from agentkv.frameworks.langgraph import InstrumentedGraph, instrument

from ._fakes import FakeOpenAI, cfg
from .test_langgraph import FAN_OUT_EXPECTED, Notes, draft_review, fan_out_app

SIX_NOTES = sorted(["plan", "left", "right", "worker", "worker", "join"])


def _tags(server: FakeOpenAI, thread: str) -> dict[str, tuple[str | None, str | None, int | None]]:
    """node text -> (agent, parent, step); every request belongs to ``thread``."""
    got = server.tags_by_text()
    assert {session for (_, session, _, _) in got.values()} == {thread}
    return {text: (agent, parent, step) for text, (agent, _, parent, step) in got.items()}


def test_the_instrumented_app_is_a_compiled_graph_and_a_runnable(server):
    compiled = fan_out_app(server)
    app = instrument(compiled)
    assert isinstance(app, Runnable) and isinstance(app, CompiledStateGraph) and isinstance(app, InstrumentedGraph)
    assert app.nodes.keys() == compiled.nodes.keys() and app.checkpointer is compiled.checkpointer


def test_composed_with_the_pipe_operator(server, thread):
    app = instrument(fan_out_app(server))
    chain = RunnableLambda(lambda notes: {"notes": notes}) | app | (lambda state: sorted(state["notes"]))
    assert chain.invoke([], cfg(thread)) == SIX_NOTES
    assert len(server.requests) == 6 and _tags(server, thread) == FAN_OUT_EXPECTED
    server.requests.clear()
    assert chain.batch([[], []], [cfg(thread + "-a"), cfg(thread + "-b")]) == [SIX_NOTES, SIX_NOTES]
    assert len(server.requests) == 12


def test_embedded_as_a_subgraph_node(server, thread):
    app = instrument(fan_out_app(server))
    parent = StateGraph(Notes)
    parent.add_node("intake", lambda state: {"notes": ["intake"]})
    parent.add_node("team", app)
    parent.add_edge(START, "intake")
    parent.add_edge("intake", "team")
    parent.add_edge("team", END)
    outer = parent.compile(checkpointer=InMemorySaver())
    assert dict(outer.get_subgraphs()) == {"team": app}  # langgraph sees a subgraph, not a function
    result = outer.invoke({"notes": []}, cfg(thread))
    assert sorted(result["notes"]) == sorted(["intake", "intake", *SIX_NOTES])  # the subgraph got intake's state
    assert len(server.requests) == 6 and _tags(server, thread) == FAN_OUT_EXPECTED


class _Recorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.chain_starts = 0

    def on_chain_start(self, *args: Any, **kwargs: Any) -> None:
        self.chain_starts += 1


def test_with_config_stays_instrumented_and_keeps_user_callbacks(server, thread):
    app = instrument(fan_out_app(server))
    recorder = _Recorder()
    again = app.with_config(tags=["team"], callbacks=[recorder])
    assert isinstance(again, InstrumentedGraph) and again.handler is app.handler and again.facts is app.facts
    assert again.config["tags"] == ["team"] and again.config["callbacks"] == [app.handler, recorder]
    assert app.config["callbacks"] == [app.handler]  # the original instrumented app is unchanged
    assert sorted(again.invoke({"notes": []}, cfg(thread))["notes"]) == SIX_NOTES
    assert recorder.chain_starts > 0
    assert len(server.requests) == 6 and _tags(server, thread) == FAN_OUT_EXPECTED


def _recording_sink(posted: list[tuple[str, str | None]]) -> EventSink:
    """A sink whose deliveries land in ``posted`` as (type, session), graph facts left out."""

    def record(request: httpx.Request) -> httpx.Response:
        events = json.loads(request.content)["events"]
        posted.extend((e["type"], e.get("session")) for e in events if e["type"] != "graph")
        return httpx.Response(200, json={"accepted": len(events), "duplicates": 0})

    return EventSink("http://127.0.0.1:9", transport=httpx.MockTransport(record))


def _draft_team(server: FakeOpenAI, sink: EventSink) -> InstrumentedGraph:
    """An instrumented two-node app compiled without a checkpointer, as a subgraph usually is."""
    return InstrumentedGraph(draft_review(server.chat_openai()).compile(), sink=sink)


def test_embedded_in_a_checkpointed_parent_it_does_not_end_the_parents_thread(server, thread):
    """The parent's run owns the session: each message of a chat runs the subgraph, which must not
    post a session_end for the thread (the server would evict the conversation)."""
    posted: list[tuple[str, str | None]] = []
    sink = _recording_sink(posted)
    parent = StateGraph(Notes)
    parent.add_node("team", _draft_team(server, sink))
    parent.add_edge(START, "team")
    chat = parent.compile(checkpointer=InMemorySaver())
    chat.invoke({"notes": []}, cfg(thread))
    chat.invoke({"notes": []}, cfg(thread))
    assert sink.flush(5)
    assert posted == []
    assert server.tags()[:2] == [("draft", thread, "", 1), ("review", thread, "draft", 2)]
    assert server.tags()[2][:3] == ("draft", thread, "review")  # the parent's run goes on: so does the lineage
    sink.close()


def test_embedded_in_an_instrumented_parent_it_is_transparent(server, thread, dispatches):
    """Inside an instrumented parent's dispatch the subgraph's calls belong to that dispatch, as a
    plain subgraph's do: no dispatches, no lineage reset and no session events of its own."""
    posted: list[tuple[str, str | None]] = []
    sink = _recording_sink(posted)
    llm = server.chat_openai()
    parent = StateGraph(Notes)
    parent.add_node("intake", lambda s: {"notes": [llm.invoke("intake").content]})
    parent.add_node("team", _draft_team(server, sink))
    parent.add_node("final", lambda s: {"notes": [llm.invoke("final").content]})
    parent.add_edge(START, "intake")
    parent.add_edge("intake", "team")
    parent.add_edge("team", "final")
    app = InstrumentedGraph(parent.compile(checkpointer=InMemorySaver()), sink=sink)
    app.invoke({"notes": []}, cfg(thread))
    assert sink.flush(5)
    assert server.tags() == [
        ("intake", thread, "", 1),
        ("team", thread, "intake", 2),
        ("team", thread, "intake", 2),
        ("final", thread, "team", 3),
    ]
    assert [(d.agent, d.parent, d.step) for d in dispatches] == [
        ("intake", "", 1),
        ("team", "intake", 2),
        ("final", "team", 3),
    ]
    assert posted == [("session_start", thread)]  # the parent's; a checkpointed thread goes on
    sink.close()
