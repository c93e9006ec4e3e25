"""The LangGraph callback handler: sets the agentkv tag for node runs and LLM calls, detects dispatches.

A *dispatch* is one run of a top-level node (a task of the instrumented graph); nested runs
(subgraphs, prebuilt agents' ``model``/``tools`` nodes) belong to the dispatch of their top-level
node, found from the first segment of ``langgraph_checkpoint_ns``. The parent of a dispatch is found
causally: the most recent earlier dispatch that routed to this node (observed routes first, then
declared edges), so parallel branches and ``Send`` fan-out each get the node that triggered them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from langchain_core.callbacks import BaseCallbackHandler
from langgraph.types import Command, Send

from agentkv._bounded import BoundedDict
from agentkv.client import (
    ERRORS,
    Dispatch,
    count,
    current_tag,
    dispatch_ended,
    install,
    sanitize_id,
    set_tag,
    tracker,
)
from agentkv.protocol import AgentTag

from ._langgraph_facts import EXPLICIT_KEY, Naming, Topology

__all__ = ["AgentKVCallbackHandler"]

_NS_SEP: Final = "|"
_NS_END: Final = ":"
_SESSION_KEY: Final = "agentkv_session"
_MAX_OPEN_RUNS: Final = 100_000


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
    """The dispatches of one root run (one invoke/stream) of the graph.

    A *nested* root run (this app as a subgraph of another graph's run) is part of that run's
    session, not an episode of its own: it neither starts nor ends the session. A *transparent* one
    (nested under an agentkv tag) records no dispatch and sets no tag: its calls carry that tag.
    """

    session: str
    base_depth: int
    initial_parent: str
    persistent: bool = False  # a checkpointed thread: the session outlives this run
    nested: bool = False
    transparent: bool = False
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
        topology: Topology,
        naming: Naming,
        *,
        session: str | Callable[[Mapping[str, Any]], str] | None = None,
        on_episode_start: Callable[[str], None] | None = None,
        on_episode_end: Callable[[str, bool, bool], None] | None = None,
        threads_persist: bool = False,
    ) -> None:
        super().__init__()
        self._topology = topology
        self._naming = naming
        self._session = session
        self._on_episode_start = on_episode_start
        self._on_episode_end = on_episode_end
        self._threads_persist = threads_persist  # the graph keeps each thread's state between runs
        self._runs: BoundedDict[Any, _Run] = BoundedDict(_MAX_OPEN_RUNS)  # end callbacks may never come
        self._lock = threading.RLock()
        self._node_names = frozenset(topology.nodes)
        self.app_id = f"langgraph-{id(self):x}"

    # -- run bookkeeping -------------------------------------------------------------

    def _session_for(self, metadata: Mapping[str, Any], run_id: Any) -> tuple[str, bool]:
        """(the run's session, whether it outlives the run: a thread whose state the graph keeps)."""
        thread = metadata.get("thread_id")
        persistent = self._threads_persist and thread not in (None, "")
        explicit = metadata.get(_SESSION_KEY)
        if explicit:
            return sanitize_id(explicit), persistent
        if thread not in (None, ""):
            return sanitize_id(thread), persistent
        if callable(self._session):
            return sanitize_id(self._session(metadata)), False
        if self._session:
            return sanitize_id(self._session), False
        return sanitize_id(str(run_id)), False

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
                    session, _ = self._session_for(metadata, run_id)
                    tag = self._metadata_tag(metadata, session, None)
                    self._runs[run_id] = _Run(_Episode(session, 0, ""), 0, None, set_tag(tag), True)
                return
            episode = parent.episode
            depth = len(segments) - episode.base_depth
            if episode.transparent:  # known, so that its own runs are too, but no dispatch and no tag
                self._runs[run_id] = _Run(episode, depth, None, None, False)
                return
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
        install()  # an SDK the app imported since it was instrumented (e.g. anthropic) is tagged too
        session, persistent = self._session_for(metadata, run_id)
        if segments:  # a checkpoint namespace already: the run of a node of another graph
            self._start_nested(run_id, session, len(segments))
            return
        resume = isinstance(inputs, Command) or inputs is None
        initial = tracker().parent_for(session) if resume else ""
        tracker().start_session(session, keep_lineage=resume)
        episode = _Episode(session, len(segments), initial or "", persistent)
        self._runs[run_id] = _Run(episode, 0, None, None, False, is_root=True)
        count("langgraph_runs")
        if self._on_episode_start is not None:
            self._on_episode_start(session)

    def _start_nested(self, run_id: Any, session: str, base_depth: int) -> None:
        """This app runs as a subgraph inside another graph's run, which owns the session.

        So the lineage goes on (no ``start_session``) and no episode starts or ends. Under an
        agentkv tag (an instrumented parent's dispatch, an ``agentkv.agent`` scope) the run is
        transparent, as a plain subgraph is to an instrumented parent: its calls carry that tag.
        """
        transparent = current_tag() is not None
        initial = "" if transparent else tracker().parent_for(session) or ""
        episode = _Episode(session, base_depth, initial, nested=True, transparent=transparent)
        self._runs[run_id] = _Run(episode, 0, None, None, False, is_root=True)
        count("langgraph_nested_runs")

    def _metadata_agent(self, metadata: Mapping[str, Any]) -> str:
        segments = _ns_segments(metadata)
        name = (
            metadata.get(EXPLICIT_KEY)
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
        interrupted = error is not None
        if self._on_episode_end is not None and not run.episode.nested:
            self._on_episode_end(run.episode.session, interrupted, run.episode.persistent)

    # -- callback API ------------------------------------------------------------------

    def on_chain_start(
        self, serialized: Any, inputs: Any, *, run_id: Any, parent_run_id: Any = None, metadata: Any = None, **kw: Any
    ) -> None:
        _guarded("chain start", self._start, run_id, parent_run_id, metadata, inputs=inputs, chain=True)

    def on_chain_end(self, outputs: Any, *, run_id: Any, **kw: Any) -> None:
        _guarded("chain end", self._end, run_id, outputs)

    def on_chain_error(self, error: BaseException, *, run_id: Any, **kw: Any) -> None:
        _guarded("chain error", self._end, run_id, None, error=error)

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
        _guarded("tool start", self._start, run_id, parent_run_id, metadata, chain=False)

    def on_tool_end(self, output: Any, *, run_id: Any, **kw: Any) -> None:
        _guarded("tool end", self._end, run_id, output)

    def on_tool_error(self, error: BaseException, *, run_id: Any, **kw: Any) -> None:
        _guarded("tool error", self._end, run_id, None, error=error)

    def on_retriever_start(
        self, serialized: Any, query: Any, *, run_id: Any, parent_run_id: Any = None, metadata: Any = None, **kw: Any
    ) -> None:
        _guarded("retriever start", self._start, run_id, parent_run_id, metadata, chain=False)

    def on_retriever_end(self, documents: Any, *, run_id: Any, **kw: Any) -> None:
        self.on_tool_end(None, run_id=run_id)

    def on_retriever_error(self, error: BaseException, *, run_id: Any, **kw: Any) -> None:
        self.on_tool_error(error, run_id=run_id)

    def on_chat_model_start(
        self, serialized: Any, messages: Any, *, run_id: Any, parent_run_id: Any = None, metadata: Any = None, **kw: Any
    ) -> None:
        _guarded("chat model start", self._start, run_id, parent_run_id, metadata, chain=False, llm=True)

    def on_llm_start(
        self, serialized: Any, prompts: Any, *, run_id: Any, parent_run_id: Any = None, metadata: Any = None, **kw: Any
    ) -> None:
        _guarded("llm start", self._start, run_id, parent_run_id, metadata, chain=False, llm=True)

    def on_llm_end(self, response: Any, *, run_id: Any, **kw: Any) -> None:
        _guarded("llm end", self._end, run_id, None)

    def on_llm_error(self, error: BaseException, *, run_id: Any, **kw: Any) -> None:
        _guarded("llm error", self._end, run_id, None, error=error)


def _guarded(event: str, method: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """Run a callback's work; an error is counted as ``langgraph <event>``, never raised into LangGraph."""
    try:
        method(*args, **kwargs)
    except Exception as exc:
        ERRORS.record(f"langgraph {event}", exc)


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
