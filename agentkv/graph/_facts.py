"""Graph facts: what the application declares, kept apart from what is learned.

A fact outranks a prediction: a declared graph bounds which transitions can happen at
all, and an ended or cancelled session is retired before anything predicted useful.
Events are idempotent: replaying an event (same ``id``) changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import networkx as nx
import numpy as np

from agentkv._bounded import BoundedDict, ChangeSet

__all__ = ["END", "START", "FactsFull", "GraphFacts"]

# LangGraph's virtual entry and exit nodes; they are not agents.
START = "__start__"
END = "__end__"


class FactsFull(ValueError):
    """A graph declaration that would take the declared graph past its node or edge cap."""


class GraphFacts:
    """Declared agent graph plus session lifecycle facts.

    Invariants: ``graph`` holds only declared agents (never START/END); ``entry`` holds
    the agents a session may start with; ``ended`` is bounded by ``max_ended`` and
    ordered oldest first; the graph never holds more than ``max_nodes`` nodes and
    ``max_edges`` edges (a declaration that would exceed them is refused whole).
    ``version`` changes with every applied fact; ``graph_version`` only with a declaration
    that changes the graph, the only fact the chain depends on (session events leave it, and
    what is built on the chain, alone). A session event changes only whether its session is ended, which
    ``take_ended_changes`` tells (a session forgotten past ``max_ended`` included).
    """

    def __init__(
        self, *, max_ended: int = 100_000, max_event_ids: int = 100_000, max_nodes: int = 1024, max_edges: int = 4096
    ) -> None:
        self.graph: nx.DiGraph = nx.DiGraph()
        self.entry: set[str] = set()
        self.ended: BoundedDict[str, str] = BoundedDict(max_ended)  # session -> "session_end" | "cancel"
        self.started: BoundedDict[str, None] = BoundedDict(max_ended)
        self._seen_ids: BoundedDict[str, None] = BoundedDict(max_event_ids)
        self.max_nodes = max_nodes
        self.max_edges = max_edges
        self.version = 0
        self.graph_version = 0
        self._ended_changes: ChangeSet[str] = ChangeSet(max_ended)  # see take_ended_changes

    # -- declaring -----------------------------------------------------------------

    def declare_graph(
        self,
        nodes: Iterable[str],
        edges: Iterable[tuple[str, str]] = (),
        conditional_edges: Iterable[tuple[str, str]] = (),
        entry: Iterable[str] = (),
    ) -> None:
        """Add declared agents and edges (declarations accumulate; several apps may share a server).

        Raises FactsFull, changing nothing, if the result would exceed the caps.
        """
        nodes, entry = list(nodes), list(entry)
        edges, conditional_edges = list(edges), list(conditional_edges)
        self._check_room(nodes, [*edges, *conditional_edges], entry)
        before = self.export()
        for node in nodes:
            if node not in (START, END):
                self.graph.add_node(node)
        for kind, pairs in (("static", edges), ("conditional", conditional_edges)):
            for source, target in pairs:
                if source == START:
                    if target != END:
                        self.entry.add(target)
                        self.graph.add_node(target)
                elif target != END:
                    self.graph.add_edge(source, target, kind=kind)
                else:
                    self.graph.add_node(source)
        self.entry.update(a for a in entry if a not in (START, END))
        self.graph.add_nodes_from(self.entry)
        self.version += 1
        if self.export() != before:  # an app declaring its graph again at every start changes nothing
            self.graph_version += 1

    def _check_room(self, nodes: list[str], pairs: list[tuple[str, str]], entry: list[str]) -> None:
        named = {*nodes, *entry, *(a for pair in pairs for a in pair)} - {START, END}
        new_nodes = sum(1 for a in named if a not in self.graph)
        new_edges = len({(u, v) for u, v in pairs if START not in (u, v) and END not in (u, v)} - set(self.graph.edges))
        if self.graph.number_of_nodes() + new_nodes > self.max_nodes:
            raise FactsFull(f"the declared graph would exceed {self.max_nodes} nodes")
        if self.graph.number_of_edges() + new_edges > self.max_edges:
            raise FactsFull(f"the declared graph would exceed {self.max_edges} edges")

    def start_session(self, session: str) -> None:
        if self.ended.pop(session, None) is not None:
            self._ended_changes.add(session)
        self.started[session] = None
        self.version += 1

    def end_session(self, session: str, *, cancelled: bool = False) -> None:
        self.started.pop(session, None)
        if session not in self.ended:
            self._ended_changes.add(session)
            if self.ended and len(self.ended) >= self.ended.cap:  # the oldest ended session is forgotten
                self._ended_changes.add(next(iter(self.ended)))
        self.ended[session] = "cancel" if cancelled else "session_end"
        self.version += 1

    def take_ended_changes(self) -> set[str] | None:
        """The sessions whose ``is_ended`` may have changed since the last call (None: too many to
        list, take every session as changed); the next call starts afresh."""
        return self._ended_changes.take()

    def apply(self, event: Mapping[str, Any]) -> bool:
        """Apply one validated event (see agentkv.protocol.EVENTS_SCHEMA); False if a replay."""
        event_id = event.get("id")
        key = None if event_id is None else f"{event['type']}:{event_id}"
        if key is not None and key in self._seen_ids:
            return False
        kind = event["type"]
        if kind == "graph":
            self.declare_graph(
                event["nodes"],
                [tuple(e) for e in event.get("edges", ())],
                [tuple(e) for e in event.get("conditional_edges", ())],
                event.get("entry", ()),
            )
        elif kind == "session_start":
            self.start_session(event["session"])
        elif kind in ("session_end", "cancel"):
            self.end_session(event["session"], cancelled=kind == "cancel")
        else:
            raise ValueError(f"unknown event type {kind!r}")
        if key is not None:  # only once applied: a refused event may be sent again
            self._seen_ids[key] = None
        return True

    # -- reading -------------------------------------------------------------------

    @property
    def has_graph(self) -> bool:
        return self.graph.number_of_nodes() > 0

    def is_ended(self, session: str) -> bool:
        return session in self.ended

    def successors(self, agent: str) -> set[str] | None:
        """Declared successors of ``agent``; None when the graph says nothing about it."""
        if agent not in self.graph:
            return None
        return set(self.graph.successors(agent))

    def transition_mask(self, agents: list[str]) -> np.ndarray | None:
        """mask[i, j] = False where the declared graph rules out agents[i] -> agents[j].

        Rows of undeclared agents are all True (no fact, no constraint); a declared agent
        may always reach an undeclared one, since the graph may simply not know it yet.
        """
        if not self.has_graph:
            return None
        declared = np.array([a in self.graph for a in agents], dtype=bool)
        mask = np.ones((len(agents), len(agents)), dtype=bool)
        index = {a: i for i, a in enumerate(agents)}
        for i, agent in enumerate(agents):
            if declared[i]:
                mask[i, declared] = False
                for succ in self.graph.successors(agent):
                    if succ in index:
                        mask[i, index[succ]] = True
        return mask

    def entry_mask(self, agents: list[str]) -> np.ndarray | None:
        """mask[j] = False where the declared entry points rule out a session starting at agents[j]."""
        if not self.entry:
            return None
        return np.array([a in self.entry or a not in self.graph for a in agents], dtype=bool)

    def export(self) -> dict[str, Any]:
        return {
            "nodes": sorted(self.graph.nodes),
            "edges": sorted([u, v] for u, v, k in self.graph.edges(data="kind") if k == "static"),
            "conditional_edges": sorted([u, v] for u, v, k in self.graph.edges(data="kind") if k == "conditional"),
            "entry": sorted(self.entry),
        }
