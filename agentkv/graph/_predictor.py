"""Next-agent prediction: the learned transition model bounded by declared facts."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ._facts import GraphFacts
from ._learner import TransitionLearner

__all__ = ["ChainModel", "Prediction", "Predictor", "top_successors"]


@dataclass(frozen=True, slots=True)
class Prediction:
    agent: str
    probability: float


@dataclass(frozen=True, slots=True)
class ChainModel:
    """A snapshot of the effective Markov chain.

    ``matrix[i, j]`` = P(next = agents[j] | current = agents[i]); a row may sum to less
    than 1 when the declared graph lets the session end there. ``entry[j]`` is the
    probability that a new session starts at ``agents[j]``.
    """

    agents: tuple[str, ...]
    matrix: np.ndarray
    entry: np.ndarray
    index: dict[str, int]


class Predictor:
    """Combines a TransitionLearner with optional GraphFacts; facts outrank counts.

    A transition the declared graph rules out gets probability 0 and the rest of its
    row is rescaled to the row's learned total: the learned chance that a session ends
    there is kept (facts bound where a session goes, not whether it stops). The chain is
    rebuilt only when the learner or facts changed.
    """

    def __init__(self, learner: TransitionLearner, facts: GraphFacts | None = None) -> None:
        self.learner = learner
        self.facts = facts
        self._cache_key: tuple[int, int] | None = None
        self._chain: ChainModel | None = None

    def chain(self) -> ChainModel:
        key = (self.learner.version, -1 if self.facts is None else self.facts.graph_version)
        if self._chain is None or key != self._cache_key:
            self._chain = self._build()
            self._cache_key = key
        return self._chain

    def _build(self) -> ChainModel:
        agents = self.learner.agents
        matrix = self.learner.transition_matrix()
        entry = self.learner.entry_distribution()
        if self.facts is not None:
            mask = self.facts.transition_mask(agents)
            if mask is not None:
                matrix = _rescaled(np.where(mask, matrix, 0.0), matrix)
            entry_mask = self.facts.entry_mask(agents)
            if entry_mask is not None:
                entry = _rescaled(np.where(entry_mask, entry, 0.0)[None, :], entry[None, :])[0]
        return ChainModel(tuple(agents), matrix, entry, {a: i for i, a in enumerate(agents)})

    def next_distribution(self, agent: str | None) -> dict[str, float]:
        """P(next | agent); ``None`` asks for the first agent of a new session."""
        chain = self.chain()
        if agent is None:
            row = chain.entry
        elif agent in chain.index:
            row = chain.matrix[chain.index[agent]]
        else:
            return {}
        return {a: float(p) for a, p in zip(chain.agents, row, strict=True) if p > 0}

    def predict(self, agent: str | None) -> Prediction | None:
        """The most likely next agent after ``agent`` (the warm-up target), or None."""
        distribution = self.next_distribution(agent)
        if not distribution:
            return None
        best = max(distribution, key=distribution.__getitem__)
        return Prediction(best, distribution[best])


def top_successors(chain: ChainModel, agents: Iterable[str]) -> dict[str, Prediction]:
    """The most likely next agent of each of ``agents`` known to ``chain``; left out when its row
    has no single best (a tie, e.g. the uniform row of an agent never followed, says nothing)."""
    known = [a for a in agents if a in chain.index]
    if not known or not chain.agents:
        return {}
    rows = chain.matrix[[chain.index[a] for a in known]]
    best = rows.argmax(axis=1)
    top = rows[np.arange(len(known)), best]
    runner_up = np.partition(rows, -2, axis=1)[:, -2] if rows.shape[1] > 1 else np.zeros(len(known))
    return {a: Prediction(chain.agents[b], float(p)) for a, b, p, q in zip(known, best, top, runner_up, strict=True)
            if p > q}


def _rescaled(allowed: np.ndarray, learned: np.ndarray) -> np.ndarray:
    """The rows of ``allowed`` (``learned`` with ruled-out entries zeroed) scaled to sum to the
    rows of ``learned``: 1 - sum is the chance of ending there, kept. All-zero rows stay zero
    (the session can only end there)."""
    sums = allowed.sum(axis=1, keepdims=True)
    scale = np.divide(learned.sum(axis=1, keepdims=True), sums, out=np.zeros_like(sums), where=sums > 0)
    return allowed * scale
