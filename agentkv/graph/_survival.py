"""Survival scoring: how likely each agent is to run again soon (seed 001 §3.3)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import networkx as nx
import numpy as np

from ._predictor import ChainModel, Predictor

__all__ = [
    "SurvivalConfig",
    "SurvivalScorer",
    "SurvivalTable",
    "block_score",
    "first_passage_within",
    "heap_key",
    "hop_survival",
]

_ALMOST_ONE = 1.0 - 1e-12


@dataclass(frozen=True, slots=True)
class SurvivalConfig:
    """``horizon`` is K (dispatches); below ``r_min`` predictability, every agent scores alike.

    ``method`` picks exact first-passage probabilities or the paper's hop-distance form
    (edges with P >= ``tau``, normalised by ``e_max``). ``delta`` and ``decay`` (per second)
    are the δ and λ of Score(b) = (p + δ)(e^{-λ·age} + δ)·|b|. ``new_sessions`` is the
    expected number of sessions that start within the horizon, which keeps entry agents'
    anchors alive between sessions.
    """

    horizon: int = 4
    r_min: float = 0.2
    method: Literal["exact", "hops"] = "exact"
    tau: float = 0.1
    e_max: int = 4
    delta: float = 0.01
    decay: float = 0.01
    new_sessions: float = 1.0

    def __post_init__(self) -> None:
        if self.horizon < 1 or self.e_max < 1:
            raise ValueError("horizon and e_max must be >= 1")
        if not (0 <= self.r_min <= 1 and 0 < self.tau <= 1):
            raise ValueError("r_min must be in [0, 1] and tau in (0, 1]")
        if self.delta <= 0 or self.decay < 0 or self.new_sessions < 0:
            raise ValueError("delta must be > 0; decay and new_sessions >= 0")
        if self.method not in ("exact", "hops"):
            raise ValueError(f"unknown method {self.method!r}")


def first_passage_within(matrix: np.ndarray, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """H[i, a] = P(the chain started at i visits a at some step 1..horizon).

    Returns (H_horizon, H_{horizon-1}). Recursion on all targets at once:
    H_k[i, a] = P[i, a] + sum_{j != a} P[i, j] H_{k-1}[j, a].
    """
    n = matrix.shape[0]
    previous = np.zeros((n, n))
    current = np.zeros((n, n))
    for _ in range(horizon):
        previous, current = current, matrix + matrix @ current - matrix * np.diag(current)[None, :]
    return np.clip(current, 0.0, 1.0), np.clip(previous, 0.0, 1.0)


def hop_survival(chain: ChainModel, starts: Iterable[int], *, tau: float, e_max: int, entry: bool) -> np.ndarray:
    """p~(a) = 1 - min(E[a], e_max) / e_max, E = fewest hops over edges with P >= tau."""
    n = len(chain.agents)
    graph = nx.DiGraph()
    graph.add_nodes_from(range(n + 1))  # node n stands for "a new session"
    rows, cols = np.nonzero(chain.matrix >= tau)
    graph.add_edges_from(zip(rows.tolist(), cols.tolist(), strict=True))
    sources = set(starts)
    if entry:
        graph.add_edges_from((n, int(j)) for j in np.flatnonzero(chain.entry >= tau))
        sources.add(n)
    hops = np.full(n, float(e_max))
    if sources:
        distances = nx.multi_source_dijkstra_path_length(graph, sources, cutoff=e_max)
        for node, distance in distances.items():
            if node < n:
                hops[node] = min(hops[node], distance)
    return 1.0 - np.minimum(hops, e_max) / e_max


@dataclass(frozen=True)
class SurvivalTable:
    """One refresh of the scorer: read-only, safe to share with the eviction path.

    ``passage[i, a]`` is the per-session survival of agent a for a session currently at
    agents[i]; ``aggregate[a]`` the probability that at least one active session (or a
    new one) runs a within the horizon. When not ``predictable`` every lookup returns
    1.0 so ordering falls back to pure recency.
    """

    agents: tuple[str, ...]
    index: dict[str, int]
    aggregate: np.ndarray
    passage: np.ndarray
    predictability: float
    predictable: bool
    config: SurvivalConfig

    def agent(self, agent: str) -> float:
        if not self.predictable:
            return 1.0
        i = self.index.get(agent)
        return 0.0 if i is None else float(self.aggregate[i])

    def block(self, agents: Iterable[str]) -> float:
        """A block shared by several agents survives as well as its best-placed agent."""
        return max((self.agent(a) for a in agents), default=0.0 if self.predictable else 1.0)

    def session(self, current: str | None, agents: Iterable[str]) -> float:
        """Survival of a session's history under ``agents`` for a session now at ``current``."""
        if not self.predictable:
            return 1.0
        i = None if current is None else self.index.get(current)
        if i is None:
            return 0.0
        return max((float(self.passage[i, j]) for a in agents if (j := self.index.get(a)) is not None), default=0.0)

    def as_dict(self) -> dict[str, float]:
        return {a: self.agent(a) for a in self.agents}


class SurvivalScorer:
    """Turns the predictor's chain and the live sessions into a SurvivalTable.

    Ended or cancelled sessions (facts) do not count towards any agent's survival.
    """

    def __init__(self, predictor: Predictor, config: SurvivalConfig | None = None) -> None:
        self.predictor = predictor
        self.config = config or SurvivalConfig()

    def refresh(self) -> SurvivalTable:
        config = self.config
        learner = self.predictor.learner
        facts = self.predictor.facts
        chain = self.predictor.chain()
        n = len(chain.agents)
        predictability = learner.predictability()
        starts = [
            chain.index[agent]
            for session, agent in learner.session_agents().items()
            if agent in chain.index and not (facts is not None and facts.is_ended(session))
        ]
        passage, before_last = first_passage_within(chain.matrix, config.horizon)
        if config.method == "hops":
            aggregate = hop_survival(
                chain, starts, tau=config.tau, e_max=config.e_max, entry=config.new_sessions > 0
            )
        else:
            counts = np.bincount(np.asarray(starts, dtype=np.intp), minlength=n).astype(float)
            new = chain.entry + chain.entry @ before_last - chain.entry * np.diag(before_last)
            # clip below 1 so that log1p stays finite: 0 sessions x log(0) would be nan
            log_miss = counts @ np.log1p(-np.minimum(passage, _ALMOST_ONE)) + config.new_sessions * np.log1p(
                -np.clip(new, 0.0, _ALMOST_ONE)
            )
            aggregate = -np.expm1(log_miss) if n else np.zeros(0)
        return SurvivalTable(
            agents=chain.agents,
            index=chain.index,
            aggregate=np.clip(aggregate, 0.0, 1.0),
            passage=passage,
            predictability=predictability,
            predictable=predictability >= config.r_min,
            config=config,
        )


def block_score(p: float, age: float, size: int, *, delta: float, decay: float) -> float:
    """Score(b) = (p + δ)(e^{-λ·age} + δ)·|b|: higher is kept longer."""
    return (p + delta) * (math.exp(-decay * age) + delta) * size


def heap_key(p: float, t_free: float, size: int, *, delta: float, decay: float) -> float:
    """Time-invariant log key: log(p + δ) + λ·t_free + log|b|, smaller is evicted first.

    log((p + δ)·e^{-λ(now - t_free)}·|b|) = heap_key - λ·now, and λ·now is common to all
    blocks, so the key orders blocks as the score does at every instant and never needs
    updating until p changes. (The δ floor on the recency term is dropped here: keeping
    it would tie the key to ``now``.)
    """
    return math.log(p + delta) + decay * t_free + math.log(size)
