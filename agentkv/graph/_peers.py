"""Transition counts learned by other replicas, merged into one model.

Each replica exports the counts it learned from its own traffic. A peer's export replaces
that peer's previous one (merging is a per-peer last-writer-wins map, so re-applying an
export, or applying an older one, changes nothing); the model a replica predicts with is
its own counts plus the latest export of every peer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["COUNTS_FORMAT", "COUNTS_VERSION", "PeerCounts", "PeerExport"]

COUNTS_FORMAT = "agentkv.transition-counts"
COUNTS_VERSION = 1


@dataclass(frozen=True)
class PeerExport:
    """One replica's own counts at one moment; (epoch, sequence) orders its exports.

    ``interposed`` counts each agent's interposed calls (see ``TransitionLearner.observe``);
    a document without it (an older replica) reads as zeros.
    """

    replica: str
    epoch: str
    sequence: int
    agents: tuple[str, ...]
    counts: np.ndarray
    entry: np.ndarray
    ends: np.ndarray
    interposed: np.ndarray

    @classmethod
    def from_json(cls, document: Mapping[str, object]) -> PeerExport:
        """Validate a ``GET /agentkv/v1/state`` document; ValueError says what is wrong."""
        if document.get("format") != COUNTS_FORMAT or document.get("version") != COUNTS_VERSION:
            raise ValueError(f"not an {COUNTS_FORMAT} v{COUNTS_VERSION} document")
        try:
            agents = tuple(document["agents"])  # type: ignore[arg-type]
            n = len(agents)
            counts = np.asarray(document["counts"], dtype=float).reshape(n, n)
            entry = np.asarray(document["entry"], dtype=float).reshape(n)
            ends = np.asarray(document["ends"], dtype=float).reshape(n)
            interposed = np.asarray(document.get("interposed", [0.0] * n), dtype=float).reshape(n)
            replica, epoch, sequence = str(document["replica"]), str(document["epoch"]), int(document["sequence"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed counts document: {exc!r}") from exc
        if len(set(agents)) != n or not all(isinstance(a, str) for a in agents):
            raise ValueError("agents must be distinct strings")
        if not all(np.isfinite(a).all() and (a >= 0).all() for a in (counts, entry, ends, interposed)):
            raise ValueError("counts must be finite and non-negative")
        return cls(replica, epoch, sequence, agents, counts, entry, ends, interposed)

    def to_json(self) -> dict[str, object]:
        return {
            "format": COUNTS_FORMAT,
            "version": COUNTS_VERSION,
            "replica": self.replica,
            "epoch": self.epoch,
            "sequence": self.sequence,
            "agents": list(self.agents),
            "counts": self.counts.tolist(),
            "entry": self.entry.tolist(),
            "ends": self.ends.tolist(),
            "interposed": self.interposed.tolist(),
        }


class PeerCounts:
    """The latest export of every peer, summed and aligned to a learner's agent order.

    Invariant: ``_latest[replica]`` is the export with the greatest (epoch change,
    sequence) seen from that replica; a new epoch (the peer restarted) always replaces.
    """

    def __init__(self) -> None:
        self._latest: dict[str, PeerExport] = {}
        self.version = 0
        self._cache_key: tuple[int, tuple[str, ...]] | None = None
        self._cache: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def merge(self, export: PeerExport) -> bool:
        """Keep ``export`` if it is newer than what this peer sent before; False if not."""
        current = self._latest.get(export.replica)
        if current is not None and current.epoch == export.epoch and export.sequence <= current.sequence:
            return False
        self._latest[export.replica] = export
        self.version += 1
        return True

    @property
    def agents(self) -> set[str]:
        return {a for export in self._latest.values() for a in export.agents}

    def replicas(self) -> dict[str, int]:
        return {replica: export.sequence for replica, export in self._latest.items()}

    def aligned(self, agents: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(counts, entry, ends, interposed) of all peers, rows and columns in ``agents`` order."""
        key = (self.version, tuple(agents))
        if self._cache_key != key or self._cache is None:
            n = len(agents)
            counts, entry, ends, interposed = np.zeros((n, n)), np.zeros(n), np.zeros(n), np.zeros(n)
            index = {a: i for i, a in enumerate(agents)}
            for export in self._latest.values():
                mine = [index.get(a, -1) for a in export.agents]
                keep = np.array([i for i, m in enumerate(mine) if m >= 0], dtype=np.intp)
                target = np.array([mine[i] for i in keep], dtype=np.intp)
                counts[np.ix_(target, target)] += export.counts[np.ix_(keep, keep)]
                entry[target] += export.entry[keep]
                ends[target] += export.ends[keep]
                interposed[target] += export.interposed[keep]
            self._cache_key, self._cache = key, (counts, entry, ends, interposed)
        return self._cache
