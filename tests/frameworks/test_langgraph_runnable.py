"""``agentkv.instrument(app)`` is used wherever a compiled graph is: as a langchain ``Runnable``
composed with ``|``, as a subgraph node of a parent graph, and re-configured with ``with_config``."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langgraph")

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables import Runnable, RunnableLambda
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

from agentkv.frameworks.langgraph import InstrumentedGraph, instrument

from ._fakes import FakeOpenAI, cfg
from .test_langgraph import FAN_OUT_EXPECTED, Notes, fan_out_app

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
