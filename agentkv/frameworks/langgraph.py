"""LangGraph adapter: ``instrument(app)`` tags every LLM request with its agent, session and lineage.

    app = agentkv.instrument(builder.compile(checkpointer=...), events_url="http://127.0.0.1:8000")
    app.invoke({"messages": [...]}, {"configurable": {"thread_id": "t1"}})

``InstrumentedGraph`` is the app copied with the agentkv callback handler (``_langgraph_handler``)
in its config, as ``graph.with_config(callbacks=[handler])`` would: a real ``CompiledStateGraph``
sharing nodes and checkpointer. The handler is sync with ``run_inline = True``, the only kind whose
ContextVar writes reach the node's HTTP calls. See docs/frameworks.md ("LangGraph").
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from langchain_core.runnables.config import merge_configs
from langgraph.graph.state import CompiledStateGraph

from agentkv.client import (
    ERRORS,
    count,
    current_tag,
    install,
    learner_listener,
    on_dispatch,
    sanitize_id,
    set_tag,
    tracker,
)

from ._events import EventSink, SinkHandle, get_sink, session_event
from ._langgraph_facts import AgentNames, Naming, facts_event, graph_facts, topology_of
from ._langgraph_handler import AgentKVCallbackHandler

__all__ = ["AgentKVCallbackHandler", "InstrumentedGraph", "graph_facts", "instrument"]


@dataclass(slots=True)
class _Instrumentation:
    """What every copy of one instrumented app shares (``with_config`` copies share it too)."""

    original: Any
    facts: dict[str, Any]
    handler: AgentKVCallbackHandler
    sink: EventSink | SinkHandle | None
    learner_facts: Any
    learner_model: Any
    unsubscribe: Callable[[], None] | None = None


_OWN_ATTRIBUTE: Final = "_agentkv"


def _pregel_attributes(graph: Any) -> dict[str, Any]:
    """The constructor arguments of a compiled graph, as ``Pregel.copy`` collects them."""
    return {k: v for k, v in graph.__dict__.items() if k not in ("__orig_class__", _OWN_ATTRIBUTE)}


class InstrumentedGraph(CompiledStateGraph):  # type: ignore[misc]
    """A compiled LangGraph app whose LLM requests carry agentkv tags.

    It *is* a ``CompiledStateGraph`` (hence a langchain ``Runnable``): the original app copied with
    the agentkv callback handler added to its config, sharing nodes, builder and checkpointer, as
    ``original.with_config(callbacks=[handler])`` would. So it composes with ``|``, embeds as a
    subgraph node, and ``with_config``/``copy`` return InstrumentedGraphs sharing the same
    instrumentation (handler, sink, learner). Sessions begin with each root run (invoke, stream,
    ...), whichever method started it, and end with it, unless the graph keeps the thread's state
    (a checkpointer and a ``thread_id``): then the thread's next message continues the session,
    which ends with ``end_session`` (or when the server finds it idle beyond its learned gaps).
    Run as a subgraph of another graph, it belongs to that graph's run and session: it neither
    starts nor ends a session, and under an instrumented parent's dispatch its calls carry that tag.
    """

    _agentkv: _Instrumentation

    def __init__(
        self,
        graph: Any,
        *,
        session: str | Callable[[Mapping[str, Any]], str] | None = None,
        agent_names: AgentNames = None,
        learner: Any = None,
        events_url: str | Sequence[str] | None = None,
        sink: EventSink | None = None,
    ) -> None:
        install()
        topology = topology_of(graph)
        naming = Naming(topology, agent_names)
        facts = facts_event(topology, naming, getattr(graph, "name", None))
        learner_facts, learner_model = _split_learner(learner)
        if learner_facts is not None:
            try:
                learner_facts.apply(facts)
            except Exception as exc:
                ERRORS.record("learner facts", exc)
        handler = AgentKVCallbackHandler(
            topology,
            naming,
            session=session,
            on_episode_start=self._episode_started,
            on_episode_end=self._episode_ended,
            threads_persist=bool(getattr(graph, "checkpointer", None)),
        )
        own = _Instrumentation(
            original=graph,
            facts=facts,
            handler=handler,
            sink=sink if sink is not None else (get_sink(events_url) if events_url else None),
            learner_facts=learner_facts,
            learner_model=learner_model,
        )
        if learner_model is not None:
            own.unsubscribe = _subscribe_learner(learner_model, handler.app_id)
        attributes = _pregel_attributes(graph)
        attributes["config"] = merge_configs(graph.config, {"callbacks": [handler]})
        super().__init__(**attributes)
        self._agentkv = own
        if own.sink is not None:
            own.sink.post([facts])

    def copy(self, update: dict[str, Any] | None = None) -> InstrumentedGraph:
        """``Pregel.copy`` (behind ``with_config``): the copy shares this app's instrumentation."""
        clone = InstrumentedGraph.__new__(InstrumentedGraph)
        CompiledStateGraph.__init__(clone, **(_pregel_attributes(self) | (update or {})))
        clone._agentkv = self._agentkv
        return clone

    async def astream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """``Pregel.astream`` (behind ``ainvoke`` and ``astream_events``) that leaves the caller's tag as it found it.

        In async runs LangGraph calls a node's start callback (which sets the node's tag) in the
        caller's task but its end callback (which restores the tag) in a child task, whose context
        is a copy: so the caller's tag is put back after every step and when the stream ends,
        finished, failed or closed early.
        """
        outer = current_tag()
        inner = super().astream(*args, **kwargs)
        try:
            while True:
                try:
                    item = await inner.__anext__()
                except StopAsyncIteration:
                    return
                finally:
                    set_tag(outer)
                yield item
        finally:
            try:
                await inner.aclose()  # end the run now (its callbacks, its session), not at garbage collection
            finally:
                set_tag(outer)

    # -- the instrumentation -----------------------------------------------------------

    @property
    def original(self) -> Any:
        """The compiled app given to ``instrument``."""
        return self._agentkv.original

    @property
    def facts(self) -> dict[str, Any]:
        """The protocol ``graph`` event of the app (agent-level graph facts)."""
        return self._agentkv.facts

    @property
    def handler(self) -> AgentKVCallbackHandler:
        return self._agentkv.handler

    @property
    def sink(self) -> EventSink | SinkHandle | None:
        return self._agentkv.sink

    def _episode_started(self, session: str) -> None:
        sink = self._agentkv.sink
        if sink is not None:
            sink.post([self._agentkv.facts, session_event("session_start", session)])

    def _episode_ended(self, session: str, cancelled: bool, persistent: bool) -> None:
        tracker().end_session(session)  # this run's lineage; a thread's next run starts its own
        if persistent:  # a checkpointed thread goes on with its next message: not a session end
            count("langgraph_thread_runs")
            return
        self._finish(session, cancelled)

    def end_session(self, session: str) -> None:
        """The conversation of ``session`` (a thread id) is over: tell the learner and the server.

        A run on a thread whose state the graph keeps (a checkpointer) does not end its session,
        since the thread's next message continues it; call this when the app knows the thread is
        done (otherwise the server retires it once it stays idle beyond its learned gaps).
        """
        self._finish(sanitize_id(session), cancelled=False)

    def _finish(self, session: str, cancelled: bool) -> None:
        own = self._agentkv
        if own.learner_model is not None and hasattr(own.learner_model, "end_session"):
            try:
                own.learner_model.end_session(session)
            except Exception as exc:
                ERRORS.record("learner end_session", exc)
        if own.learner_facts is not None:
            try:
                own.learner_facts.end_session(session, cancelled=cancelled)
            except Exception as exc:
                ERRORS.record("learner facts end_session", exc)
        if own.sink is not None:
            own.sink.post([session_event("cancel" if cancelled else "session_end", session)])

    def close(self) -> None:
        """Stop feeding the learner (the graph keeps working, still tagged)."""
        own = self._agentkv
        if own.unsubscribe is not None:
            own.unsubscribe()
            own.unsubscribe = None

    def __repr__(self) -> str:
        return f"InstrumentedGraph({self.original!r})"


def _split_learner(learner: Any) -> tuple[Any, Any]:
    """(facts, transition model) from a GraphFacts, a TransitionLearner, a Predictor or a pair."""
    if learner is None:
        return None, None
    if isinstance(learner, tuple | list):
        facts = next((x for x in learner if hasattr(x, "declare_graph")), None)
        model = next((x for x in learner if hasattr(x, "observe")), None)
        return facts, model
    if hasattr(learner, "declare_graph"):
        return learner, None
    facts = getattr(learner, "facts", None)
    model = getattr(learner, "learner", None) if not hasattr(learner, "observe") else learner
    return facts, model


def _subscribe_learner(model: Any, app_id: str) -> Callable[[], None]:
    feed = learner_listener(model)

    def listener(dispatch: Any) -> None:
        if dispatch.app == app_id:
            feed(dispatch)

    return on_dispatch(listener)


def instrument(
    graph: Any,
    *,
    session: str | Callable[[Mapping[str, Any]], str] | None = None,
    agent_names: AgentNames = None,
    learner: Any = None,
    events_url: str | Sequence[str] | None = None,
) -> InstrumentedGraph:
    """Tag every LLM request of a compiled LangGraph app with agent, session, parent and step.

    ``session``: used when a run has no ``thread_id`` (a string, or a function of the callback
    metadata); otherwise each root run gets its run id. Per call, ``config["metadata"]
    ["agentkv_session"]`` wins over both. ``agent_names``: a mapping node -> agent id (None: not an
    agent, contracted out of the lineage and the facts) or a collection of the nodes that are agents.
    ``learner``: a ``GraphFacts`` (gets the graph facts and session ends), a ``TransitionLearner``
    (observes every dispatch), or a ``Predictor``/pair holding both. ``events_url``: the vLLM server
    (base URL or full events URL), or a list of them (every replica behind a router); graph facts
    and ``session_start``/``session_end``/``cancel`` are POSTed there in the background (no end
    for a run on a checkpointed thread: see ``InstrumentedGraph.end_session``).

    An app that is already an ``InstrumentedGraph`` is returned unchanged (the other arguments are
    ignored): a second handler would record every dispatch, and end every session, twice.
    """
    if isinstance(graph, InstrumentedGraph):
        return graph
    return InstrumentedGraph(graph, session=session, agent_names=agent_names, learner=learner, events_url=events_url)
