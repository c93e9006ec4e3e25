"""A TransitionLearner's learned state in a snapshot (``_snapshot.py``): its fields, validated.

Kept: each agent's counts (transitions, entries, ends, interposed calls), the tallies and each
agent's last sighting (the dispatch number it was last seen at), so that a restored learner at
``max_agents`` recycles the agent seen least recently before the restart, as the saved one would have.
Not kept: the live sessions (transient) and the peers' counts (theirs to persist).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from agentkv.protocol import validate_id

__all__ = ["LearnerState"]

# A restored learner's counts in all: far beyond what any server learns (a decayed learner holds a
# few thousand per part), far below where sums overflow.
_MAX_TOTAL_WEIGHT = 1e15


class LearnerState(NamedTuple):
    """The counts of ``agents`` (in that order, divided by the decay weight), ``seen[i]`` the dispatch
    number of agent i's last sighting (at most ``dispatches``) and the accuracy tallies."""

    agents: list[str]
    counts: np.ndarray
    entry: np.ndarray
    ends: np.ndarray
    interposed: np.ndarray
    seen: np.ndarray
    dispatches: int
    predictions: int
    correct: int

    def document(self) -> dict[str, object]:
        """As ``TransitionLearner.export_state`` writes it (plain JSON types)."""
        return {
            "agents": list(self.agents),
            "counts": self.counts.tolist(),
            "entry": self.entry.tolist(),
            "ends": self.ends.tolist(),
            "interposed": self.interposed.tolist(),
            "seen": self.seen.tolist(),
            "dispatches": self.dispatches,
            "predictions": self.predictions,
            "correct": self.correct,
        }

    @classmethod
    def parse(cls, state: dict[str, object], max_agents: int) -> LearnerState:
        """The state ``document`` wrote; ValueError naming the first thing wrong with it.

        Written by an older agentkv, ``interposed`` may be absent (zeros), and ``seen`` too: then the
        agents count as last seen in the order of their evidence, least first (see ``_seen_by_evidence``).
        """
        agents = state["agents"]
        if not isinstance(agents, list) or len(set(map(str, agents))) != len(agents):
            raise ValueError("agents must be a list of distinct names")
        for name in agents:  # as the wire admits them (stats, /metrics and every peer read them)
            validate_id(name, "agent")
        tallies = [state.get(key, 0) for key in ("dispatches", "predictions", "correct")]
        if not all(type(n) is int and 0 <= n < 2**62 for n in tallies):
            raise ValueError("dispatches, predictions and correct must be integers in [0, 2**62)")
        n = len(agents)
        counts = np.asarray(state["counts"], dtype=float)
        if n == 0 and counts.size == 0:  # nothing learned yet: JSON's [] reads as shape (0,), not (0, 0)
            counts = counts.reshape(0, 0)
        entry = np.asarray(state["entry"], dtype=float)
        ends = np.asarray(state["ends"], dtype=float)
        interposed = np.asarray(state.get("interposed", [0.0] * n), dtype=float)
        if n > max_agents:
            raise ValueError(f"{n} agents exceed max_agents={max_agents}")
        if counts.shape != (n, n) or any(a.shape != (n,) for a in (entry, ends, interposed)):
            raise ValueError("counts must be n x n, entry, ends and interposed of length n")
        arrays = (counts, entry, ends, interposed)
        if not all(np.isfinite(a).all() and (a >= 0).all() for a in arrays):
            raise ValueError("counts must be finite and non-negative")
        if not sum(float(a.sum()) for a in arrays) <= _MAX_TOTAL_WEIGHT:  # sums would overflow the model
            raise ValueError(f"counts must total at most {_MAX_TOTAL_WEIGHT:g}")
        dispatches = tallies[0]
        if "seen" in state:
            seen = state["seen"]
            if type(seen) is not list or len(seen) != n or not all(type(d) is int and 0 <= d <= dispatches
                                                                     for d in seen):
                raise ValueError(f"seen must be {n} integers in [0, dispatches={dispatches}]")
            last_seen = np.array(seen, dtype=np.int64)
        else:
            last_seen = _seen_by_evidence(counts, entry, ends, interposed, dispatches)
        return cls(agents, counts, entry, ends, interposed, last_seen, *tallies)


def _seen_by_evidence(counts: np.ndarray, entry: np.ndarray, ends: np.ndarray, interposed: np.ndarray,
                      dispatches: int) -> np.ndarray:
    """Sightings for a snapshot that did not keep them: the agents ranked by their total evidence, least
    first (ties in agent order), as dispatches 0, 1, ..., n - 1 (capped at ``dispatches``: a sighting after
    the last dispatch would rank a restored agent above one seen after the restart)."""
    evidence = counts.sum(axis=0) + counts.sum(axis=1) + entry + ends + interposed
    seen = np.empty(len(evidence), dtype=np.int64)
    seen[np.argsort(evidence, kind="stable")] = np.arange(len(evidence))
    return np.minimum(seen, dispatches)
