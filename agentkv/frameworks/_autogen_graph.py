"""An AutoGen team's graph facts, and the predecessor of each speaker of a ``GraphFlow``.

A ``GraphFlow`` (autogen-agentchat 0.6+) declares its graph (a ``DiGraph``: edges, conditions, start
nodes) and runs a node once its parents' edges fired, several at once after a fan-out: its
speakers' real predecessors are the graph's, not the previous speaker. Other teams pick one speaker
after another (a selector, a round robin, handoffs).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agentkv.client import ERRORS, sanitize_id

__all__ = ["GraphLineage", "digraph_of", "team_facts"]


def digraph_of(team: Any) -> Any | None:
    """The ``DiGraph`` a ``GraphFlow`` runs, else None."""
    graph = getattr(team, "_graph", None)
    nodes = getattr(graph, "nodes", None)
    if isinstance(nodes, Mapping) and callable(getattr(graph, "get_start_nodes", None)):
        return graph
    return None


def _conditional(edge: Any) -> bool:
    return getattr(edge, "condition", None) is not None or getattr(edge, "condition_function", None) is not None


def team_facts(team: Any) -> dict[str, Any]:
    """The protocol ``graph`` event of a team: participants and the speaker transitions allowed.

    A ``GraphFlow``'s declared edges (unconditional ones as edges, the others conditional) and
    start nodes; ``allowed_transitions`` (a mapping speaker -> next speakers) when the team has
    one; a round robin's cycle; a swarm's handoffs; otherwise all-to-all (without self-loops when
    ``allow_repeated_speaker`` is False). A ``candidate_func``/``selector_func`` cannot be
    enumerated, so it keeps all-to-all.
    """
    participants = [str(getattr(p, "name", p)) for p in getattr(team, "_participants", [])]
    ids = {p: sanitize_id(p) for p in participants}
    edges: set[tuple[str, str]] = set()
    conditional: set[tuple[str, str]] = set()
    entry: list[str] = []
    allowed = getattr(team, "allowed_transitions", None) or getattr(team, "_allowed_transitions", None)
    kind = type(team).__name__
    graph = digraph_of(team)
    if graph is not None:
        for name, node in graph.nodes.items():
            ids.setdefault(str(name), sanitize_id(str(name)))
            for edge in node.edges:
                pair = (sanitize_id(str(name)), sanitize_id(str(edge.target)))
                (conditional if _conditional(edge) else edges).add(pair)
        entry = [sanitize_id(str(n)) for n in graph.get_start_nodes()]
    elif isinstance(allowed, Mapping):
        for source, targets in allowed.items():
            for target in targets:
                conditional.add((sanitize_id(source), sanitize_id(target)))
        entry = [ids[p] for p in participants]
    elif kind == "RoundRobinGroupChat" and participants:
        for i, p in enumerate(participants):
            edges.add((ids[p], ids[participants[(i + 1) % len(participants)]]))
        entry = [ids[participants[0]]]
    elif kind == "Swarm" and participants:
        for p in getattr(team, "_participants", []):
            for handoff in (getattr(p, "_handoffs", None) or {}).values():
                target = getattr(handoff, "target", None)
                if target:
                    conditional.add((sanitize_id(p.name), sanitize_id(target)))
        entry = [ids[participants[0]]]
    else:
        repeat = bool(getattr(team, "_allow_repeated_speaker", True)) or getattr(team, "_candidate_func", None)
        for a in participants:
            for b in participants:
                if a != b or repeat:
                    conditional.add((ids[a], ids[b]))
        entry = [ids[p] for p in participants]
    event: dict[str, Any] = {
        "type": "graph",
        "nodes": sorted(set(ids.values())),
        "edges": sorted([a, b] for a, b in edges),
        "conditional_edges": sorted([a, b] for a, b in conditional - edges),
        "entry": sorted(set(entry)),
    }
    name = getattr(team, "name", None) or kind
    event["app"] = sanitize_id(name)
    digest = hashlib.sha1(json.dumps(event, sort_keys=True).encode()).hexdigest()[:16]
    event["id"] = f"graph-{digest}"
    return event


_UNFOLLOWED = "GraphFlow's manager cannot be hooked: a run after its graph's end follows the turns before it"


@dataclass(frozen=True, slots=True)
class _Turn:
    seq: int  # order of the turns' ends
    agent: str  # the dispatch's agent id
    step: int
    message: Any  # the turn's final chat message (what GraphFlow checks its edge conditions on), or None


class GraphLineage:
    """Who each ``GraphFlow`` speaker follows: the participant whose turn, ended most recently, has an
    edge to it that fires (no condition, or its condition holds on that turn's final message), as
    GraphFlow's own manager decides which nodes are ready; a speaker no edge led to (a start node) is
    an entry. Its step is one more than its predecessor's (an entry's: one more than any step before
    the run), so the branches of a fan-out are siblings of one step.

    Remembers each participant's latest turn only, until GraphFlow goes back to its start nodes
    (:meth:`follow_resets`) or the team's conversation ends (a reset, a state loaded: :meth:`resume`).
    """

    def __init__(self, graph: Any) -> None:
        self._parents: dict[str, list[tuple[str, Any]]] = {}  # node -> its (parent, edge)
        for name, node in graph.nodes.items():
            for edge in node.edges:
                self._parents.setdefault(str(edge.target), []).append((str(name), edge))
                _record_answers(edge)
        self._latest: dict[str, _Turn] = {}  # by node name
        self._seq = 0
        self._run_step = 0  # the highest step before the running run
        self._lock = threading.Lock()

    def begin_run(self, step: int) -> None:
        with self._lock:
            self._run_step = step

    def clear(self) -> None:
        with self._lock:
            self._latest.clear()

    def follow_resets(self, team: Any) -> None:
        """Clear whenever ``team`` (a ``GraphFlow``) goes back to its start nodes: its graph ran to its
        end, or the team was reset.

        Its manager does that within the run, so it holds whether or not the run's consumer reads
        ``run_stream`` on to the ``TaskResult``: AutoGen lets a run closed or cancelled early go on
        until its runtime is idle (the graph's end, or a termination condition). Hooks the manager
        the team creates at its first run (autogen-agentchat 0.7.5: ``_reset_execution_state``); a
        team that ran before it was instrumented has its manager already, which is found and
        :meth:`follow`-ed at its next run.
        """
        create_factory = getattr(team, "_create_group_chat_manager_factory", None)
        if not callable(create_factory):
            ERRORS.record("autogen graph reset", message=_UNFOLLOWED)
            return

        def create_following_factory(*args: Any, **kwargs: Any) -> Callable[[], Any]:
            factory = create_factory(*args, **kwargs)

            def create_manager() -> Any:
                manager = factory()
                self.follow(manager)
                return manager

            return create_manager

        team._create_group_chat_manager_factory = create_following_factory

    def follow(self, manager: Any) -> None:
        """Clear whenever ``manager`` (the team's ``GraphFlowManager``) goes back to its start nodes."""
        reset_execution_state = getattr(manager, "_reset_execution_state", None)
        if not callable(reset_execution_state):
            ERRORS.record("autogen graph reset", message=_UNFOLLOWED)
            return
        if getattr(reset_execution_state, "__agentkv_lineage__", None) is self:
            return  # created through the hooked factory: followed already

        def reset_and_clear() -> None:
            reset_execution_state()
            self.clear()

        reset_and_clear.__agentkv_lineage__ = self  # type: ignore[attr-defined]
        manager._reset_execution_state = reset_and_clear

    def predecessor(self, node: str) -> tuple[str, int]:
        """``(parent, step)`` for a turn of ``node`` starting now (parent ``""`` for an entry)."""
        with self._lock:
            fired = [turn for parent, edge in self._parents.get(node, ())
                     if (turn := self._latest.get(parent)) is not None and _fires(edge, turn.message)]
            run_step = self._run_step
        if not fired:
            return "", run_step + 1
        turn = max(fired, key=lambda t: t.seq)
        return turn.agent, turn.step + 1

    def resume(self, turns: Iterable[tuple[str, int, Any]]) -> None:
        """Go on after ``turns`` ((node, step, last message), in order): a conversation loaded midway
        through the graph, whose nodes' latest turns ran elsewhere."""
        with self._lock:
            self._latest.clear()
            for node, step, message in turns:
                self._seq += 1
                self._latest[node] = _Turn(self._seq, sanitize_id(node), step, message)

    def turn_ended(self, node: str, agent: str, step: int, message: Any) -> None:
        with self._lock:
            self._seq += 1
            self._latest[node] = _Turn(self._seq, agent, step, message)


class _RecordedCondition:
    """An edge's condition function that keeps its latest answer, for the message it was asked about."""

    __slots__ = ("_latest", "function")

    def __init__(self, function: Callable[[Any], Any]) -> None:
        self.function = function
        self._latest: tuple[Any, Any] | None = None  # (message, answer)

    def __call__(self, message: Any) -> Any:
        answer = self.function(message)
        self._latest = (message, answer)
        return answer

    def answer_for(self, message: Any) -> bool | None:
        """The answer given about ``message`` (this very object), or None if not asked about it last."""
        latest = self._latest
        return bool(latest[1]) if latest is not None and latest[0] is message else None


def _record_answers(edge: Any) -> None:
    """Have ``edge``'s condition function, if any, keep GraphFlow's answers: its manager asks it about
    each turn's final message before picking the next speakers, so :func:`_fires` reads that answer
    instead of calling the app's function (side effects, cost) a second time."""
    function = getattr(edge, "condition_function", None)
    if not callable(function) or isinstance(function, _RecordedCondition):
        return
    try:
        edge.condition_function = _RecordedCondition(function)
    except Exception as exc:  # e.g. a frozen edge: the lineage asks the condition itself
        ERRORS.record("autogen graph condition record", exc)


def _fires(edge: Any, message: Any) -> bool:
    """Whether GraphFlow follows ``edge`` after ``message`` (``DiGraphEdge.check_condition``): its own
    answer when it recorded one, else the condition asked here (a string condition: a substring test)."""
    if not _conditional(edge):
        return True
    if message is None:
        return False
    function = getattr(edge, "condition_function", None)
    if isinstance(function, _RecordedCondition) and (answer := function.answer_for(message)) is not None:
        return answer
    try:
        return bool(edge.check_condition(message))
    except Exception as exc:  # the app's condition: it raises in GraphFlow too, never here
        ERRORS.record("autogen graph condition", exc)
        return False
