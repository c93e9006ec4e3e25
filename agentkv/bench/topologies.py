"""Transition structures of the paper's six-agent supervisor framework (docs/design.md).

Each topology is a Markov chain over the same six agents; its predictability R is
tuned to the paper's figure: Pipeline 1.0, Debate 0.78, Selector-like 0.57, Random 0.12.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from agentkv.graph import transition_entropy_ratio

__all__ = ["AGENTS", "TOPOLOGIES", "Topology", "sample_dispatches", "stationary", "topology"]

AGENTS: tuple[str, ...] = ("supervisor", "planner", "researcher", "coder", "reviewer", "writer")


@dataclass(frozen=True)
class Topology:
    name: str
    matrix: np.ndarray  # row-stochastic over AGENTS
    entry: np.ndarray  # distribution of a session's first agent
    target_r: float

    @property
    def predictability(self) -> float:
        return transition_entropy_ratio(self.matrix, stationary(self.matrix))


def stationary(matrix: np.ndarray) -> np.ndarray:
    """Stationary distribution of an irreducible chain (left eigenvector for eigenvalue 1)."""
    values, vectors = np.linalg.eig(matrix.T)
    vector = np.real(vectors[:, np.argmin(np.abs(values - 1.0))])
    return vector / vector.sum()


def _mix(structure: np.ndarray, weight: float) -> np.ndarray:
    """(1 - w) * structure + w * uniform: w trades structure for noise."""
    n = structure.shape[0]
    return (1.0 - weight) * structure + weight * np.full((n, n), 1.0 / n)


def _tune(build: Callable[[float], np.ndarray], target: float) -> np.ndarray:
    """Bisect the noise weight until R(build(w)) hits ``target`` (R falls as w grows)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        matrix = build(middle)
        if transition_entropy_ratio(matrix, stationary(matrix)) > target:
            low = middle
        else:
            high = middle
    return build((low + high) / 2)


def _pipeline() -> np.ndarray:
    n = len(AGENTS)
    matrix = np.zeros((n, n))
    for i in range(n):
        matrix[i, (i + 1) % n] = 1.0  # the next session's supervisor follows the writer
    return matrix


def _debate(weight: float) -> np.ndarray:
    s, p, r, c, v, w = range(6)
    structure = np.zeros((6, 6))
    structure[s, p] = 1.0
    structure[p, c] = 1.0
    structure[r, c] = 1.0
    structure[c, v] = 1.0  # coder proposes, reviewer challenges ...
    structure[v, c] = 0.75
    structure[v, s] = 0.25  # ... and the supervisor adjudicates now and then
    structure[w, s] = 1.0
    return _mix(structure, weight)


def _selector(weight: float) -> np.ndarray:
    # an LLM selector: one favourite successor per agent, the rest spread thin
    favourite = {0: 1, 1: 2, 2: 3, 3: 4, 4: 0, 5: 0}
    structure = np.zeros((6, 6))
    for i, j in favourite.items():
        structure[i, j] = 1.0
    structure[0, 5] = 0.15
    structure[0, 1] = 0.85
    return _mix(structure, weight)


def _random(weight: float) -> np.ndarray:
    structure = np.zeros((6, 6))
    for i in range(6):
        structure[i, (i + 1) % 6] = 1.0
    return _mix(structure, weight)


def topology(name: str) -> Topology:
    uniform_entry = np.zeros(6)
    uniform_entry[0] = 1.0  # every session starts at the supervisor
    if name == "pipeline":
        return Topology(name, _pipeline(), uniform_entry, 1.0)
    builders = {"debate": (_debate, 0.78), "selector": (_selector, 0.57), "random": (_random, 0.12)}
    if name not in builders:
        raise ValueError(f"unknown topology {name!r}; choose from {', '.join(TOPOLOGIES)}")
    build, target = builders[name]
    return Topology(name, _tune(build, target), uniform_entry, target)


TOPOLOGIES: tuple[str, ...] = ("pipeline", "debate", "selector", "random")


def sample_dispatches(topo: Topology, count: int, seed: int) -> Iterator[str]:
    """A stationary dispatch sequence of ``count`` agents drawn from the chain."""
    rng = np.random.default_rng(seed)
    current = int(rng.choice(len(AGENTS), p=topo.entry))
    for _ in range(count):
        yield AGENTS[current]
        current = int(rng.choice(len(AGENTS), p=topo.matrix[current]))
