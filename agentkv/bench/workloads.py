"""What the tape generator simulates: apps, their agents and chains (docs/tapes.md).

A *workload* is one or more apps sharing one server. An app is a set of agents with
per-agent anchors, tool use and tool-gap distributions, and a Markov chain its sessions
walk; an app with *teams* restricts each session to the agents of one or a few teams.
Eight named workloads: the four six-agent topologies of ``topologies.py`` (fixed
parameters, unchanged since the first tapes) and the zoo (``teams``, ``multi-app``,
``heavy-tools``, ``abandoned``), whose numeric parameters are drawn from the seed, so two
seeds are two instances of one distribution.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .topologies import AGENTS, TOPOLOGIES, topology

__all__ = [
    "WORKLOADS",
    "ZOO",
    "AgentSpec",
    "AppSpec",
    "ToolGap",
    "WorkloadKind",
    "declared_graph",
    "kind",
    "stream_seed",
]


@dataclass(frozen=True)
class ToolGap:
    """Tool time in seconds: log-normal with this median and sigma, clipped to [low, high]."""

    median: float = 2.0
    sigma: float = 0.75
    low: float = 0.2
    high: float = 20.0

    def draw(self, rng: np.random.Generator) -> float:
        return float(np.clip(rng.lognormal(math.log(self.median), self.sigma), self.low, self.high))


@dataclass(frozen=True)
class AgentSpec:
    """One agent: its prompt prefix is ``shared`` (preambles other agents send too) followed by
    its own anchor ``anchor/<name>`` of ``anchor_tokens``; a call ends with a tool call with
    probability ``tool_use``, whose result arrives after a ``tool_gap`` draw."""

    name: str
    anchor_tokens: int
    tool_use: float
    tool_gap: ToolGap = ToolGap()
    shared: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class AppSpec:
    """One app: its agents and the chain its sessions walk.

    Invariants (checked): unique agent names; ``matrix`` row-stochastic and ``entry`` a
    distribution over ``agents`` (same order); ``teams`` are disjoint groups of agent names,
    and a session of an app with teams keeps to the agents outside every team plus k teams,
    k drawn from ``teams_per_session`` (P(1 team), P(2 teams), ...), the teams drawn without
    replacement with weights ``team_weights``; ``weight`` is the app's share of sessions.
    """

    name: str
    agents: tuple[AgentSpec, ...]
    matrix: tuple[tuple[float, ...], ...]
    entry: tuple[float, ...]
    dispatches: tuple[int, int] = (8, 16)  # per session, uniform inclusive
    weight: float = 1.0
    teams: tuple[tuple[str, ...], ...] = ()
    teams_per_session: tuple[float, ...] = ()
    team_weights: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        names = [a.name for a in self.agents]
        n = len(names)
        if not names or len(set(names)) != n:
            raise ValueError(f"app {self.name!r}: agent names must be unique and non-empty")
        matrix = np.asarray(self.matrix, dtype=float)
        if matrix.shape != (n, n) or (matrix < 0).any() or not np.allclose(matrix.sum(axis=1), 1.0):
            raise ValueError(f"app {self.name!r}: matrix must be row-stochastic over its {n} agents")
        if len(self.entry) != n or min(self.entry) < 0 or not math.isclose(sum(self.entry), 1.0):
            raise ValueError(f"app {self.name!r}: entry must be a distribution over its agents")
        if not 1 <= self.dispatches[0] <= self.dispatches[1] or self.weight <= 0:
            raise ValueError(f"app {self.name!r}: dispatches (lo, hi) with 1 <= lo <= hi and weight > 0")
        members = [a for team in self.teams for a in team]
        if len(set(members)) != len(members) or not set(members) <= set(names):
            raise ValueError(f"app {self.name!r}: teams must be disjoint groups of its agents")
        if self.teams and (len(self.teams_per_session) > len(self.teams) or len(self.team_weights) != len(self.teams)
                           or not math.isclose(sum(self.teams_per_session), 1.0)):
            raise ValueError(f"app {self.name!r}: teams need teams_per_session (sums to 1) and one weight per team")
        if not all(0.0 <= a.tool_use <= 1.0 and a.anchor_tokens >= 1 for a in self.agents):
            raise ValueError(f"app {self.name!r}: tool_use is a probability and anchors have >= 1 token")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.agents)

    def describe(self) -> dict[str, object]:
        """The app's parameters for a tape header (its chain is in the header's ``graph``)."""
        return {
            "name": self.name,
            "weight": self.weight,
            "dispatches": list(self.dispatches),
            "agents": [{"name": a.name, "anchor_tokens": a.anchor_tokens, "tool_use": round(a.tool_use, 4),
                        "tool_gap": [round(a.tool_gap.median, 3), round(a.tool_gap.sigma, 3), a.tool_gap.low,
                                     a.tool_gap.high],
                        "shared": [list(s) for s in a.shared]} for a in self.agents],
            "teams": [list(t) for t in self.teams],
            "teams_per_session": list(self.teams_per_session),
            "team_weights": [round(w, 4) for w in self.team_weights],
        }


def declared_graph(apps: tuple[AppSpec, ...]) -> dict[str, list]:
    """What the apps would declare: every agent, every possible transition, the entry agents."""
    nodes: list[str] = []
    edges: list[list[str]] = []
    entry: list[str] = []
    for app in apps:
        names = app.names
        nodes.extend(names)
        entry.extend(a for a, p in zip(names, app.entry, strict=True) if p > 0)
        for i, row in enumerate(app.matrix):
            edges.extend([names[i], names[j]] for j, p in enumerate(row) if p > 1e-12)
    return {"nodes": nodes, "edges": edges, "entry": entry}


# -- the four six-agent topologies (fixed parameters) -------------------------------------

# Per-agent anchor sizes (tokens after the shared team preamble) and the probability that
# a call ends with a tool call. Sizes were calibrated once, on generator statistics only,
# so that anchors make up ~57% of prompt tokens.
_ANCHORS = {"supervisor": 1000, "planner": 1150, "researcher": 1500, "coder": 1650, "reviewer": 1100, "writer": 900}
_TOOL_USE = {"supervisor": 0.0, "planner": 0.2, "researcher": 0.8, "coder": 0.7, "reviewer": 0.4, "writer": 0.2}


def _topology_apps(name: str, seed: int) -> tuple[AppSpec, ...]:
    del seed  # the six-agent topologies have fixed parameters; the seed draws their sessions
    topo = topology(name)
    agents = tuple(AgentSpec(a, _ANCHORS[a], _TOOL_USE[a], ToolGap(), (("anchor/team", 64),)) for a in AGENTS)
    return (AppSpec(name, agents, _rows(topo.matrix), tuple(float(p) for p in topo.entry)),)


# -- the zoo -------------------------------------------------------------------------------


def stream_seed(name: str, seed: int, stream: int) -> list[int]:
    """Seed of one random stream of a zoo workload (0: its sessions, 1: its instance)."""
    return [zlib.crc32(name.encode()), seed, stream]


def _rows(matrix: np.ndarray) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(p) for p in row) for row in matrix)


def _normalise(matrix: np.ndarray) -> np.ndarray:
    return matrix / matrix.sum(axis=1, keepdims=True)


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> int:
    """An anchor size in [low, high], log-uniform, rounded to 10 tokens."""
    return round(math.exp(rng.uniform(math.log(low), math.log(high))) / 10.0) * 10


def _one_hot(n: int, i: int) -> tuple[float, ...]:
    return tuple(1.0 if j == i else 0.0 for j in range(n))


_TEAMS = (("search", 4), ("data", 5), ("web", 4), ("ops", 3), ("qa", 5))


def _teams(seed: int) -> tuple[AppSpec, ...]:
    """A director, five team leads and 21 workers (27 agents); a session works with one
    team (p 0.45) or two (p 0.55), teams drawn by the director's preference."""
    rng = np.random.default_rng(stream_seed("teams", seed, 1))
    org = ("anchor/org", 64)
    agents = [AgentSpec("director", int(rng.integers(110, 141)) * 10, 0.0, ToolGap(), (org,))]
    teams: list[tuple[str, ...]] = []
    for team, size in _TEAMS:
        shared = (org, (f"anchor/org/{team}", int(rng.integers(96, 257))))
        members = [AgentSpec(f"{team}.lead", int(rng.integers(70, 131)) * 10, float(rng.uniform(0.05, 0.3)),
                             ToolGap(), shared)]
        members += [AgentSpec(f"{team}.w{i}", _log_uniform(rng, 300, 2000), float(rng.uniform(0.3, 0.9)),
                              ToolGap(), shared) for i in range(1, size + 1)]
        agents += members
        teams.append(tuple(a.name for a in members))
    index = {a.name: i for i, a in enumerate(agents)}
    n = len(agents)
    matrix = np.zeros((n, n))
    leads = [index[t[0]] for t in teams]
    preference = rng.dirichlet(np.full(len(teams), 4.0))
    matrix[0, leads] = preference
    for members in teams:
        lead, workers = index[members[0]], [index[w] for w in members[1:]]
        back, across = float(rng.uniform(0.15, 0.3)), float(rng.uniform(0.15, 0.3))
        matrix[lead, workers] = (1.0 - back - across) * rng.dirichlet(np.full(len(workers), 2.0))
        matrix[lead, 0] = back
        matrix[lead, [x for x in leads if x != lead]] = across / (len(leads) - 1)
        for w in workers:
            to_lead = float(rng.uniform(0.5, 0.7))
            matrix[w, lead] = to_lead
            matrix[w, [x for x in workers if x != w]] = (1.0 - to_lead) * rng.dirichlet(np.full(len(workers) - 1, 2.0))
    return (AppSpec("teams", tuple(agents), _rows(_normalise(matrix)), _one_hot(n, 0), (10, 25),
                    teams=tuple(teams), teams_per_session=(0.45, 0.55),
                    team_weights=tuple(float(p) for p in preference)),)


_ETL = ("extract", "parse", "enrich", "check", "load")
_CREW = ("analyst", "critic", "editor", "expert", "scout", "writer")


def _multi_app(seed: int) -> tuple[AppSpec, ...]:
    """Two apps on one server, half of the sessions each: ``etl``, a deterministic 5-agent
    pipeline (a ring), and ``crew``, 6 agents that hand over uniformly at random."""
    rng = np.random.default_rng(stream_seed("multi-app", seed, 1))

    def agents(app: str, roles: tuple[str, ...], preamble: int, tool: tuple[float, float]) -> tuple[AgentSpec, ...]:
        return tuple(AgentSpec(f"{app}.{role}", _log_uniform(rng, 500, 1800), float(rng.uniform(*tool)), ToolGap(),
                               ((f"anchor/{app}", preamble),)) for role in roles)

    n = len(_ETL)
    ring = np.roll(np.eye(n), 1, axis=1)  # extract -> parse -> ... -> load -> extract
    etl = AppSpec("etl", agents("etl", _ETL, 64, (0.0, 0.6)), _rows(ring), _one_hot(n, 0), (5, 12), weight=0.5)
    m = len(_CREW)
    uniform = (np.ones((m, m)) - np.eye(m)) / (m - 1)
    crew = AppSpec("crew", agents("crew", _CREW, 128, (0.1, 0.7)), _rows(uniform), tuple([1.0 / m] * m), (6, 14),
                   weight=0.5)
    return etl, crew


_LAB = ("hub", "search", "browse", "code", "test", "report")
_LAB_CHAIN = {  # two ping-pong pairs (search/browse, code/test) around a hub; mixed with 10% uniform noise
    "hub": {"search": 0.5, "code": 0.4, "report": 0.1},
    "search": {"browse": 0.8, "hub": 0.2},
    "browse": {"search": 0.6, "code": 0.2, "hub": 0.2},
    "code": {"test": 0.85, "hub": 0.15},
    "test": {"code": 0.7, "report": 0.3},
    "report": {"hub": 1.0},
}
_LAB_TOOLS = {"hub": 0.15, "search": 0.9, "browse": 0.85, "code": 0.8, "test": 0.9, "report": 0.25}


def _structured(roles: tuple[str, ...], chain: dict[str, dict[str, float]], noise: float) -> np.ndarray:
    n = len(roles)
    matrix = np.zeros((n, n))
    for source, targets in chain.items():
        for target, p in targets.items():
            matrix[roles.index(source), roles.index(target)] = p
    return (1.0 - noise) * matrix + noise * np.full((n, n), 1.0 / n)


def _heavy_tools(seed: int) -> tuple[AppSpec, ...]:
    """Six agents, most calls end in a tool call; per-agent log-normal tool times (median
    3-9 s, sigma 1.0-1.3, clipped to 0.3-60 s); tool loops (same step) on by default."""
    rng = np.random.default_rng(stream_seed("heavy-tools", seed, 1))
    agents = tuple(AgentSpec(f"lab.{role}", _log_uniform(rng, 900, 2000),
                             float(np.clip(_LAB_TOOLS[role] + rng.uniform(-0.05, 0.05), 0.0, 1.0)),
                             ToolGap(math.exp(rng.uniform(math.log(3.0), math.log(9.0))), float(rng.uniform(1.0, 1.3)),
                                     0.3, 60.0), (("anchor/lab", 64),)) for role in _LAB)
    matrix = _structured(_LAB, _LAB_CHAIN, 0.1)
    return (AppSpec("lab", agents, _rows(matrix), _one_hot(len(_LAB), 0), (4, 8)),)


_DESK = ("router", "billing", "tech", "account", "escalate", "summary")
_DESK_CHAIN = {  # a support desk; mixed with 20% uniform noise
    "router": {"billing": 0.35, "tech": 0.4, "account": 0.25},
    "billing": {"account": 0.3, "escalate": 0.2, "summary": 0.3, "tech": 0.2},
    "tech": {"escalate": 0.3, "account": 0.2, "summary": 0.3, "billing": 0.2},
    "account": {"billing": 0.4, "summary": 0.4, "escalate": 0.2},
    "escalate": {"tech": 0.5, "billing": 0.3, "summary": 0.2},
    "summary": {"router": 1.0},
}


def _abandoned(seed: int) -> tuple[AppSpec, ...]:
    """A six-agent support desk; the workload abandons a share of its sessions mid-way."""
    rng = np.random.default_rng(stream_seed("abandoned", seed, 1))
    agents = tuple(AgentSpec(f"desk.{role}", _log_uniform(rng, 600, 1700),
                             0.0 if role == "router" else float(rng.uniform(0.2, 0.7)), ToolGap(),
                             (("anchor/desk", 64),)) for role in _DESK)
    matrix = _structured(_DESK, _DESK_CHAIN, 0.2)
    return (AppSpec("desk", agents, _rows(matrix), _one_hot(len(_DESK), 0), (8, 18)),)


@dataclass(frozen=True)
class WorkloadKind:
    """A named workload: how to build its apps for a seed, and its generator defaults."""

    name: str
    build: Callable[[int], tuple[AppSpec, ...]]
    sessions: int = 40
    rate: float = 0.05  # session arrivals per second (Poisson)
    tool_loop: bool = False  # tool loops on regardless of --tool-loop
    max_tool_calls: int = 6
    abandon: float = 0.0  # probability that a session is abandoned mid-way
    target_r: float | None = None


def _topology_kind(name: str) -> WorkloadKind:
    return WorkloadKind(name, lambda seed: _topology_apps(name, seed), target_r=topology(name).target_r)


ZOO: tuple[str, ...] = ("teams", "multi-app", "heavy-tools", "abandoned")
_KINDS: dict[str, WorkloadKind] = {
    **{name: _topology_kind(name) for name in TOPOLOGIES},
    "teams": WorkloadKind("teams", _teams, sessions=36, rate=0.05),
    "multi-app": WorkloadKind("multi-app", _multi_app, sessions=44, rate=0.08),
    "heavy-tools": WorkloadKind("heavy-tools", _heavy_tools, sessions=36, rate=0.12, tool_loop=True,
                                max_tool_calls=5),
    "abandoned": WorkloadKind("abandoned", _abandoned, sessions=40, rate=0.05, abandon=0.3),
}
WORKLOADS: tuple[str, ...] = (*TOPOLOGIES, *ZOO)


def kind(name: str) -> WorkloadKind:
    if name not in _KINDS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return _KINDS[name]
