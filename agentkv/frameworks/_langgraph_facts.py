"""Graph facts of a compiled LangGraph app: its top-level topology, contracted to the agent level.

Invariant: a declared graph never rules out a transition the app can take (untyped routers and
nodes that route only by ``Command`` are declared as able to reach every node).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final

from agentkv.client import sanitize_id

__all__ = ["END", "EXPLICIT_KEY", "START", "AgentNames", "Naming", "Topology", "facts_event", "graph_facts",
           "topology_of"]

START: Final = "__start__"
END: Final = "__end__"
EXPLICIT_KEY: Final = "agentkv_agent"

AgentNames = Mapping[str, "str | None"] | Collection[str] | None


@dataclass(slots=True)
class Topology:
    """Top-level structure of a compiled graph, by node name (before agent naming)."""

    nodes: list[str]
    static: dict[str, set[str]]  # plain and waiting (join) edges
    conditional: dict[str, set[str]]  # router targets, Command destinations, error handlers
    node_metadata: dict[str, dict[str, Any]]
    graph_metadata: dict[str, Any]


def topology_of(graph: Any) -> Topology:
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
    return Topology(nodes, static, conditional, node_metadata, graph_metadata)


class Naming:
    """Maps LangGraph node names to agent ids (None: not an agent, transparent in the lineage)."""

    def __init__(self, topology: Topology, agent_names: AgentNames) -> None:
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
        name = metadata.get(EXPLICIT_KEY) or metadata.get("lc_agent_name") or node
        return sanitize_id(name)

    def _static_metadata(self, node: str) -> dict[str, Any]:
        return {**self._topology.graph_metadata, **self._topology.node_metadata.get(node, {})}


def facts_event(topology: Topology, naming: Naming, app: str | None = None) -> dict[str, Any]:
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
    topology = topology_of(graph)  # an InstrumentedGraph is a compiled graph too
    return facts_event(topology, Naming(topology, agent_names), getattr(graph, "name", None))
