"""LangGraph adapter: ``instrument(app)`` tags every LLM request with its agent, session and lineage.

    app = agentkv.instrument(builder.compile(checkpointer=...), events_url="http://127.0.0.1:8000")
    app.invoke({"messages": [...]}, {"configurable": {"thread_id": "t1"}})

Mechanics (verified on langgraph 1.2.x, see the field notes):

* ``graph.with_config(callbacks=[handler])`` gives a real ``CompiledStateGraph`` sharing nodes and
  checkpointer; per-call user callbacks still merge.
* The handler is a sync ``BaseCallbackHandler`` with ``run_inline = True``: only such a handler runs
  in the context of the node task, so the ContextVar it sets reaches the HTTP call (for ``invoke`` and
  ``ainvoke`` alike). It sets the tag on the node task's chain start (so raw OpenAI SDK calls inside a
  node are tagged too) and again on every chat-model/LLM start.
* A *dispatch* is one run of a top-level node (a task of the instrumented graph). Nested runs
  (subgraphs, prebuilt agents' ``model``/``tools`` nodes) belong to the dispatch of their top-level
  node, found from the first segment of ``langgraph_checkpoint_ns``.
* The parent of a dispatch is found causally, not by arrival order: the most recent earlier
  dispatch that routed to this node -- observed routes (router results, ``Send``, ``Command.goto``,
  ``Command(graph=PARENT)`` from handoff tools) first, then declared edges -- so parallel branches and
  ``Send`` fan-out each get the node that triggered them.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables.config import merge_configs
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import Command, Send

from agentkv.client import (
    ERRORS,
    Dispatch,
    count,
    dispatch_ended,
    install,
    learner_listener,
    on_dispatch,
    sanitize_id,
    set_tag,
    tracker,
)
from agentkv.protocol import AgentTag

from ._events import EventSink, get_sink, session_event

__all__ = ["AgentKVCallbackHandler", "InstrumentedGraph", "graph_facts", "instrument"]

START: Final = "__start__"
END: Final = "__end__"
_NS_SEP: Final = "|"
_NS_END: Final = ":"
_EXPLICIT_KEY: Final = "agentkv_agent"
_SESSION_KEY: Final = "agentkv_session"
_MAX_OPEN_RUNS: Final = 100_000

AgentNames = Mapping[str, "str | None"] | Collection[str] | None


# --------------------------------------------------------------------------------------
# Graph facts
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Topology:
    """Top-level structure of a compiled graph, by node name (before agent naming)."""

    nodes: list[str]
    static: dict[str, set[str]]  # plain and waiting (join) edges
    conditional: dict[str, set[str]]  # router targets, Command destinations, error handlers
    node_metadata: dict[str, dict[str, Any]]
    graph_metadata: dict[str, Any]


def _topology(graph: Any) -> _Topology:
    builder = getattr(graph, "builder", None)
    if builder is None or not hasattr(builder, "nodes"):
        raise TypeError("agentkv.instrument expects a compiled LangGraph StateGraph (graph.builder is missing)")
    nodes = [str(n) for n in builder.nodes]
    everything = [*nodes, END]
    static: dict[str, set[str]] = {n: set() for n in [START, *nodes]}
    conditional: dict[str, set[str]] = {n: set() for n in [START, *nodes]}
    for source, target in getattr(builder, "edges", ()):
        static.setdefault(source, set()).add(target)
    for sources, target in getattr(builder, "waiting_edges", ()):
        for source in sources:
            static.setdefault(source, set()).add(target)
    for source, branches in getattr(builder, "branches", {}).items():
        for spec in branches.values():
            ends = getattr(spec, "ends", None)
            # An untyped router (no path_map, no Literal return type) may go anywhere: declare all
            # targets, since a declared graph that rules out a real transition would hurt predictions.
            targets = everything if not ends else list(ends.values())
            conditional.setdefault(source, set()).update(str(t) for t in targets)
    node_metadata: dict[str, dict[str, Any]] = {}
    for name, spec in builder.nodes.items():
        node_metadata[str(name)] = dict(getattr(spec, "metadata", None) or {})
        ends = getattr(spec, "ends", None) or ()
        targets = ends.values() if isinstance(ends, Mapping) else ends
        conditional[str(name)].update(str(t) for t in targets)
        handler = getattr(spec, "error_handler_node", None)
        if handler:
            conditional[str(name)].add(str(handler))
    for name in nodes:
        if not static[name] and not conditional[name]:
            # No declared way out: the node routes with an unannotated Command (or ends the run).
            conditional[name].update(everything)
    config = getattr(graph, "config", None) or {}
    graph_metadata = dict(config.get("metadata") or {}) if isinstance(config, Mapping) else {}
    return _Topology(nodes, static, conditional, node_metadata, graph_metadata)


class _Naming:
    """Maps LangGraph node names to agent ids (None: not an agent, transparent in the lineage)."""

    def __init__(self, topology: _Topology, agent_names: AgentNames) -> None:
        self._topology = topology
        self._mapping: Mapping[str, str | None] | None = None
        self._only: frozenset[str] | None = None
        if isinstance(agent_names, Mapping):
            self._mapping = agent_names
        elif agent_names is not None:
            if isinstance(agent_names, str):
                raise TypeError("agent_names must be a mapping or a collection of node names, not a string")
            self._only = frozenset(agent_names)

    def agent(self, node: str, metadata: Mapping[str, Any] | None = None) -> str | None:
        if self._mapping is not None and node in self._mapping:
            name = self._mapping[node]
            return None if name is None else sanitize_id(name)
        if self._only is not None and node not in self._only:
            return None
        metadata = metadata if metadata is not None else self._static_metadata(node)
        name = metadata.get(_EXPLICIT_KEY) or metadata.get("lc_agent_name") or node
        return sanitize_id(name)

    def _static_metadata(self, node: str) -> dict[str, Any]:
        return {**self._topology.graph_metadata, **self._topology.node_metadata.get(node, {})}


def _facts_event(topology: _Topology, naming: _Naming, app: str | None = None) -> dict[str, Any]:
    """Contract the node graph to the agent graph: non-agent nodes become pass-through."""
    agent_of = {n: naming.agent(n) for n in topology.nodes}
    agent_of[START] = START
    agent_of[END] = END

    def successors(node: str) -> list[tuple[str, bool]]:
        out = [(t, False) for t in topology.static.get(node, ())]
        out += [(t, True) for t in topology.conditional.get(node, ()) if t not in topology.static.get(node, ())]
        return out

    static_edges: set[tuple[str, str]] = set()
    cond_edges: set[tuple[str, str]] = set()
    for source in [START, *topology.nodes]:
        if agent_of.get(source) is None:
            continue
        # walk through non-agent nodes; an edge is conditional if any hop on the way is
        seen: set[tuple[str, bool]] = set()
        stack = successors(source)
        while stack:
            target, conditional = stack.pop()
            if (target, conditional) in seen or target not in agent_of:
                continue
            seen.add((target, conditional))
            target_agent = agent_of[target]
            if target_agent is None:
                stack.extend((t, conditional or c) for t, c in successors(target))
                continue
            pair = (agent_of[source], target_agent)
            (cond_edges if conditional else static_edges).add(pair)  # type: ignore[arg-type]
    cond_edges -= static_edges
    nodes = sorted({a for a in agent_of.values() if a is not None and a not in (START, END)})
    entry = sorted({b for a, b in static_edges | cond_edges if a == START and b != END})
    event: dict[str, Any] = {
        "type": "graph",
        "nodes": nodes,
        "edges": sorted([a, b] for a, b in static_edges),
        "conditional_edges": sorted([a, b] for a, b in cond_edges),
        "entry": entry,
    }
    if app:
        event["app"] = sanitize_id(app)
    digest = hashlib.sha1(json.dumps(event, sort_keys=True).encode()).hexdigest()[:16]
    event["id"] = f"graph-{digest}"
    return event


def graph_facts(graph: Any, agent_names: AgentNames = None) -> dict[str, Any]:
    """The protocol ``graph`` event of a compiled graph, at the agent level.

    Nodes are top-level nodes named as agents (``agent_names`` mapping, node metadata
    ``agentkv_agent``, the graph's ``lc_agent_name``, else the node name); ``__start__``/``__end__``
    edges are kept (the server turns them into entry/exit facts). Untyped routers and nodes that
    route only by ``Command`` are declared as able to reach every node, since ``get_graph()``
    cannot see their targets. Nodes mapped to None are contracted away.
    """
    topology = _topology(graph)  # an InstrumentedGraph is a compiled graph too
    return _facts_event(topology, _Naming(topology, agent_names), getattr(graph, "name", None))


# --------------------------------------------------------------------------------------
# Runtime state
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Record:
    """One dispatch: a run of a top-level node."""

    node: str
    agent: str | None  # None: transparent node
    lineage: str | None  # the agent this record stands for in the lineage (its own, or its parent's)
    parent: str | None
    step: int | None
    tag: AgentTag | None
    dispatch: Dispatch | None = None
    routes: set[str] = field(default_factory=set)
    end_seq: int = 1 << 62  # still running: newer than anything ended


@dataclass(slots=True)
class _Episode:
    """The dispatches of one root run (one invoke/stream) of the graph."""

    session: str
    base_depth: int
    initial_parent: str
    records: list[_Record] = field(default_factory=list)
    by_ns: dict[str, _Record] = field(default_factory=dict)
    seq: int = 0


@dataclass(slots=True)
class _Run:
    episode: _Episode
    depth: int  # checkpoint-namespace depth relative to the episode's graph (0: the graph itself)
    record: _Record | None
    previous_tag: AgentTag | None
    sets_tag: bool
    is_root: bool = False
    is_dispatch: bool = False


def _ns_segments(metadata: Mapping[str, Any] | None) -> list[str]:
    ns = (metadata or {}).get("langgraph_checkpoint_ns") or (metadata or {}).get("checkpoint_ns") or ""
    return [s for s in str(ns).split(_NS_SEP) if s] if ns else []


def _segment_node(segment: str) -> str:
    return segment.rsplit(_NS_END, 1)[0] if _NS_END in segment else segment


class AgentKVCallbackHandler(BaseCallbackHandler):
    """Sets the agentkv tag for LangGraph node runs and LLM calls; detects dispatches.

    A sync handler with ``run_inline = True``: the only kind whose ContextVar writes reach the HTTP
    call. Every method swallows its own errors (``raise_error`` stays False as well).
    """

    run_inline = True
    raise_error = False

    def __init__(
        self,
        topology: _Topology,
        naming: _Naming,
        *,
        session: str | Callable[[Mapping[str, Any]], str] | None = None,
        on_episode_start: Callable[[str], None] | None = None,
        on_episode_end: Callable[[str, bool], None] | None = None,
    ) -> None:
        super().__init__()
        self._topology = topology
        self._naming = naming
        self._session = session
        self._on_episode_start = on_episode_start
        self._on_episode_end = on_episode_end
        self._runs: dict[Any, _Run] = {}
        self._lock = threading.RLock()
        self._node_names = frozenset(topology.nodes)
        self.app_id = f"langgraph-{id(self):x}"

    # -- run bookkeeping -------------------------------------------------------------

    def _session_for(self, metadata: Mapping[str, Any], run_id: Any) -> str:
        explicit = metadata.get(_SESSION_KEY)
        if explicit:
            return sanitize_id(explicit)
        thread = metadata.get("thread_id")
        if thread not in (None, ""):
            return sanitize_id(thread)
        if callable(self._session):
            return sanitize_id(self._session(metadata))
        if self._session:
            return sanitize_id(self._session)
        return sanitize_id(str(run_id))

    def _start(
        self,
        run_id: Any,
        parent_run_id: Any,
        metadata: Mapping[str, Any] | None,
        *,
        inputs: Any = None,
        chain: bool,
        llm: bool = False,
    ) -> None:
        metadata = metadata or {}
        segments = _ns_segments(metadata)
        with self._lock:
            parent = self._runs.get(parent_run_id) if parent_run_id is not None else None
            if parent is None:
                if chain:
                    self._start_root(run_id, metadata, segments, inputs)
                elif llm:  # a model run with our callbacks outside any graph run we know
                    session = self._session_for(metadata, run_id)
                    tag = self._metadata_tag(metadata, session, None)
                    self._runs[run_id] = _Run(_Episode(session, 0, ""), 0, None, set_tag(tag), True)
                return
            episode = parent.episode
            depth = len(segments) - episode.base_depth
            record: _Record | None = None
            created = False
            if depth >= 1:
                key = segments[episode.base_depth]
                record = episode.by_ns.get(key)
                if record is None and chain and depth == 1:
                    record = self._dispatch(episode, key, metadata)
                    created = True
            run = _Run(episode, depth, record, None, False, is_dispatch=created)
            self._runs[run_id] = run
            if len(self._runs) > _MAX_OPEN_RUNS:  # end callbacks that never came: drop the oldest
                del self._runs[next(iter(self._runs))]
            tag: AgentTag | None = None
            if llm:
                tag = record.tag if record is not None and record.tag is not None else None
                if tag is None:  # inside a transparent node, or a namespace we did not see start
                    tag = self._metadata_tag(metadata, episode.session, record)
            elif chain and depth == 1 and record is not None:
                tag = record.tag
            if tag is not None:
                run.previous_tag = set_tag(tag)
                run.sets_tag = True

    def _start_root(self, run_id: Any, metadata: Mapping[str, Any], segments: list[str], inputs: Any) -> None:
        session = self._session_for(metadata, run_id)
        resume = isinstance(inputs, Command) or inputs is None
        initial = tracker().parent_for(session) if resume else ""
        tracker().start_session(session, keep_lineage=resume)
        episode = _Episode(session, len(segments), initial or "")
        self._runs[run_id] = _Run(episode, 0, None, None, False, is_root=True)
        count("langgraph_runs")
        if self._on_episode_start is not None:
            self._on_episode_start(session)

    def _metadata_agent(self, metadata: Mapping[str, Any]) -> str:
        segments = _ns_segments(metadata)
        name = (
            metadata.get(_EXPLICIT_KEY)
            or metadata.get("lc_agent_name")
            or (_segment_node(segments[0]) if segments else None)
            or metadata.get("langgraph_node")
            or "llm"
        )
        return sanitize_id(name)

    def _metadata_tag(self, metadata: Mapping[str, Any], session: str, record: _Record | None) -> AgentTag:
        if record is not None:
            parent, step = record.parent, record.step
        else:
            parent, step = tracker().parent_for(session), _step(metadata.get("langgraph_step"))
        return AgentTag(self._metadata_agent(metadata), session=session, parent=parent, step=step)

    def _dispatch(self, episode: _Episode, key: str, metadata: Mapping[str, Any]) -> _Record:
        node = str(metadata.get("langgraph_node") or _segment_node(key))
        agent = self._naming.agent(node, metadata)
        step = _step(metadata.get("langgraph_step"))
        parent = self._parent(episode, node, step)
        lineage = agent if agent is not None else parent
        record = _Record(node=node, agent=agent, lineage=lineage, parent=parent, step=step, tag=None)
        if agent is not None:
            d = tracker().dispatch(
                agent, episode.session, parent=parent, step=step, framework="langgraph", node=node, app=self.app_id
            )
            record.tag = d.tag
            record.dispatch = d
        else:
            record.tag = None
        episode.records.append(record)
        episode.by_ns[key] = record
        if len(episode.records) > 4096:  # bound memory of very long runs
            old = episode.records.pop(0)
            for k, v in list(episode.by_ns.items()):
                if v is old:
                    del episode.by_ns[k]
        return record

    def _parent(self, episode: _Episode, node: str, step: int | None) -> str:
        """The lineage agent of the most recent earlier dispatch that routed to ``node``."""
        earlier = [r for r in episode.records if step is None or r.step is None or r.step < step]
        if not earlier:
            return episode.initial_parent
        # newest step first; within a step, the one that ended last first
        earlier.sort(key=lambda r: (-1 if r.step is None else r.step, r.end_seq), reverse=True)
        steps: list[list[_Record]] = []
        for r in earlier:
            if steps and steps[-1][0].step == r.step:
                steps[-1].append(r)
            else:
                steps.append([r])
        for group in steps:
            for match in (
                lambda r: node in r.routes,
                lambda r: node in self._topology.static.get(r.node, ()),
                lambda r: node in self._topology.conditional.get(r.node, ()),
            ):
                found = [r for r in group if match(r)]
                if found:
                    return found[0].lineage or ""
        return earlier[0].lineage or ""

    def _end(self, run_id: Any, outputs: Any, *, error: BaseException | None = None) -> None:
        with self._lock:
            run = self._runs.pop(run_id, None)
            if run is None:
                return
            if run.sets_tag:
                set_tag(run.previous_tag)
            if run.is_root:
                self._end_root(run, error)
                return
            record = run.record
            if record is None:
                return
            if error is None and run.depth in (1, 2):
                record.routes.update(_targets(outputs, run.depth - 1, self._node_names))
            if run.is_dispatch:
                run.episode.seq += 1
                record.end_seq = run.episode.seq
                if record.dispatch is not None:
                    dispatch_ended(record.dispatch)

    def _end_root(self, run: _Run, error: BaseException | None) -> None:
        session = run.episode.session
        interrupted = error is not None
        if self._on_episode_end is not None:
            self._on_episode_end(session, interrupted)

    # -- callback API ------------------------------------------------------------------

    def on_chain_start(
        self, serialized: Any, inputs: Any, *, run_id: Any, parent_run_id: Any = None, metadata: Any = None, **kw: Any
    ) -> None:
        try:
            self._start(run_id, parent_run_id, metadata, inputs=inputs, chain=True)
        except Exception as exc:
            ERRORS.record("langgraph chain start", exc)

    def on_chain_end(self, outputs: Any, *, run_id: Any, **kw: Any) -> None:
        try:
            self._end(run_id, outputs)
        except Exception as exc:
            ERRORS.record("langgraph chain end", exc)

    def on_chain_error(self, error: BaseException, *, run_id: Any, **kw: Any) -> None:
        try:
            self._end(run_id, None, error=error)
        except Exception as exc:
            ERRORS.record("langgraph chain error", exc)

    def on_tool_start(
        self,
        serialized: Any,
        input_str: Any,
        *,
        run_id: Any,
        parent_run_id: Any = None,
        metadata: Any = None,
        **kw: Any,
    ) -> None:
        try:
            self._start(run_id, parent_run_id, metadata, chain=False)
        except Exception as exc:
            ERRORS.record("langgraph tool start", exc)

    def on_tool_end(self, output: Any, *, run_id: Any, **kw: Any) -> None:
        try:
            self._end(run_id, output)
        except Exception as exc:
            ERRORS.record("langgraph tool end", exc)

    def on_tool_error(self, error: BaseException, *, run_id: Any, **kw: Any) -> None:
        try:
            self._end(run_id, None, error=error)
        except Exception as exc:
            ERRORS.record("langgraph tool error", exc)

    def on_retriever_start(
        self, serialized: Any, query: Any, *, run_id: Any, parent_run_id: Any = None, metadata: Any = None, **kw: Any
    ) -> None:
        try:
            self._start(run_id, parent_run_id, metadata, chain=False)
        except Exception as exc:
            ERRORS.record("langgraph retriever start", exc)

    def on_retriever_end(self, documents: Any, *, run_id: Any, **kw: Any) -> None:
        self.on_tool_end(None, run_id=run_id)

    def on_retriever_error(self, error: BaseException, *, run_id: Any, **kw: Any) -> None:
        self.on_tool_error(error, run_id=run_id)

    def on_chat_model_start(
        self, serialized: Any, messages: Any, *, run_id: Any, parent_run_id: Any = None, metadata: Any = None, **kw: Any
    ) -> None:
        try:
            self._start(run_id, parent_run_id, metadata, chain=False, llm=True)
        except Exception as exc:
            ERRORS.record("langgraph chat model start", exc)

    def on_llm_start(
        self, serialized: Any, prompts: Any, *, run_id: Any, parent_run_id: Any = None, metadata: Any = None, **kw: Any
    ) -> None:
        try:
            self._start(run_id, parent_run_id, metadata, chain=False, llm=True)
        except Exception as exc:
            ERRORS.record("langgraph llm start", exc)

    def on_llm_end(self, response: Any, *, run_id: Any, **kw: Any) -> None:
        try:
            self._end(run_id, None)
        except Exception as exc:
            ERRORS.record("langgraph llm end", exc)

    def on_llm_error(self, error: BaseException, *, run_id: Any, **kw: Any) -> None:
        try:
            self._end(run_id, None, error=error)
        except Exception as exc:
            ERRORS.record("langgraph llm error", exc)


def _step(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _targets(obj: Any, level: int, nodes: frozenset[str], _depth: int = 0) -> set[str]:
    """Top-level node names an output routes to.

    ``level`` 0: output of a run at the dispatch's own level (router results, ``Send``, ``Command``);
    ``level`` 1: one level deeper, where only ``Command(graph=Command.PARENT)`` (handoffs) counts.
    """
    out: set[str] = set()
    if _depth > 4:
        return out
    if isinstance(obj, Send):
        if level == 0:
            out.add(str(obj.node))
    elif isinstance(obj, Command):
        applies = obj.graph is None if level == 0 else obj.graph == Command.PARENT
        if applies and obj.goto:
            gotos = obj.goto if isinstance(obj.goto, list | tuple) else [obj.goto]
            for goto in gotos:
                if isinstance(goto, Send):
                    out.add(str(goto.node))
                elif isinstance(goto, str) and goto in nodes:
                    out.add(goto)
    elif isinstance(obj, str):
        if level == 0 and obj in nodes:
            out.add(obj)
    elif isinstance(obj, list | tuple):
        for item in obj[:256]:
            out |= _targets(item, level, nodes, _depth + 1)
    return out


# --------------------------------------------------------------------------------------
# The instrumented graph
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Instrumentation:
    """What every copy of one instrumented app shares (``with_config`` copies share it too)."""

    original: Any
    facts: dict[str, Any]
    handler: AgentKVCallbackHandler
    sink: EventSink | None
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
    instrumentation (handler, sink, learner). Sessions begin and end with each root run (invoke,
    stream, ...), whichever method started it.
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
        topology = _topology(graph)
        naming = _Naming(topology, agent_names)
        facts = _facts_event(topology, naming, getattr(graph, "name", None))
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
    def sink(self) -> EventSink | None:
        return self._agentkv.sink

    def _episode_started(self, session: str) -> None:
        sink = self._agentkv.sink
        if sink is not None:
            sink.post([self._agentkv.facts, session_event("session_start", session)])

    def _episode_ended(self, session: str, cancelled: bool) -> None:
        own = self._agentkv
        tracker().end_session(session)
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
    and ``session_start``/``session_end``/``cancel`` are POSTed there in the background.
    """
    return InstrumentedGraph(graph, session=session, agent_names=agent_names, learner=learner, events_url=events_url)
