"""Transition counts learned by other replicas, merged into one model.

Each replica exports the counts it learned from its own traffic. A peer's export replaces
that peer's previous one (merging is a per-peer last-writer-wins map, so re-applying an
export, or applying an older one, changes nothing); the model a replica predicts with is
its own counts plus the latest export of every peer, all peers together scaled down to weigh at
most ``peer_weight`` times its own evidence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from agentkv._bounded import BoundedDict
from agentkv.protocol import InvalidMetadata, validate_id

__all__ = ["COUNTS_FORMAT", "COUNTS_VERSION", "PEER_WEIGHT_FLOOR", "PeerCounts", "PeerExport"]

COUNTS_FORMAT = "agentkv.transition-counts"
COUNTS_VERSION = 1
PEER_WEIGHT_FLOOR = 64.0  # the local evidence a fresh replica is credited with when bounding peers


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
    def from_json(cls, document: object, *, max_agents: int = 256) -> PeerExport:
        """Validate a ``GET /agentkv/v1/state`` document; ValueError says what is wrong.

        Types are exact (no bool for a number, no string for a list), names follow the id
        rules of tags (docs/protocol.md §1.3), counts are finite non-negative JSON numbers.
        """
        if not isinstance(document, Mapping):
            raise ValueError("a counts document must be a JSON object")
        version = document.get("version")
        if document.get("format") != COUNTS_FORMAT or not _is_int(version) or version != COUNTS_VERSION:
            raise ValueError(f"not an {COUNTS_FORMAT} v{COUNTS_VERSION} document")
        replica, epoch = _id(document, "replica"), _id(document, "epoch")
        sequence = document.get("sequence")
        if not _is_int(sequence) or sequence < 0:
            raise ValueError("sequence must be a non-negative integer")
        raw_agents = document.get("agents")
        if not isinstance(raw_agents, list):
            raise ValueError("agents must be a list of agent ids")
        if len(raw_agents) > max_agents:
            raise ValueError(f"{len(raw_agents)} agents exceed the limit of {max_agents}")
        agents = tuple(_checked_id(a, "agents") for a in raw_agents)
        if len(set(agents)) != len(agents):
            raise ValueError("agents must be distinct")
        n = len(agents)
        rows = document.get("counts")
        if not isinstance(rows, list) or len(rows) != n:
            raise ValueError(f"counts must be a list of {n} rows")
        counts = np.array([_numbers(row, n, "counts") for row in rows], dtype=float).reshape(n, n)
        entry = np.array(_numbers(document.get("entry"), n, "entry"), dtype=float)
        ends = np.array(_numbers(document.get("ends"), n, "ends"), dtype=float)
        raw_interposed = document.get("interposed")  # absent in an older replica's document
        interposed = np.zeros(n) if raw_interposed is None else np.array(
            _numbers(raw_interposed, n, "interposed"), dtype=float)
        return cls(replica, epoch, sequence, agents, counts, entry, ends, interposed)  # type: ignore[arg-type]

    def total_weight(self) -> float:
        """All counts of the export summed (inf when they overflow a float)."""
        with np.errstate(over="ignore"):
            return float(self.counts.sum() + self.entry.sum() + self.ends.sum() + self.interposed.sum())

    def scaled(self, factor: float) -> PeerExport:
        """The same export with every count multiplied by ``factor`` (its predictions unchanged)."""
        return replace(self, counts=self.counts * factor, entry=self.entry * factor, ends=self.ends * factor,
                       interposed=self.interposed * factor)

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

    Invariants: ``_latest[replica]`` is the export with the greatest (epoch change,
    sequence) seen from that replica; a new epoch (the peer restarted) always replaces;
    at most ``max_replicas`` peers are kept, the least recently updated one leaving first;
    together they weigh at most ``peer_weight`` x the local evidence (``aligned``).
    """

    def __init__(self, max_replicas: int = 32, peer_weight: float = math.inf) -> None:
        if max_replicas < 1:
            raise ValueError("max_replicas must be >= 1")
        self._latest: BoundedDict[str, PeerExport] = BoundedDict(max_replicas)
        self.peer_weight = peer_weight
        self.version = 0
        self._cache_key: tuple[int, tuple[str, ...]] | None = None
        self._cache: tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], float] | None = None

    @property
    def max_replicas(self) -> int:
        return self._latest.cap

    @max_replicas.setter
    def max_replicas(self, cap: int) -> None:
        self._latest.cap = cap

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

    def aligned(self, agents: Sequence[str], own_weight: float) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                         np.ndarray]:
        """(counts, entry, ends, interposed) of all peers, rows and columns in ``agents`` order, scaled
        down together (each peer's distribution and share kept) to weigh at most ``peer_weight`` x
        ``own_weight``, the local counts' total (at least ``PEER_WEIGHT_FLOOR``): however many names
        send counts, the peers inform a fresh replica but cannot drown an experienced one."""
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
            total = float(counts.sum() + entry.sum() + ends.sum() + interposed.sum())
            self._cache_key, self._cache = key, ((counts, entry, ends, interposed), total)
        parts, total = self._cache
        cap = self.peer_weight * max(own_weight, PEER_WEIGHT_FLOOR)
        if total <= cap:
            return parts
        factor = cap / total
        return parts[0] * factor, parts[1] * factor, parts[2] * factor, parts[3] * factor


def _is_int(value: object) -> bool:
    return type(value) is int  # exactly: a JSON true is not 1


def _checked_id(value: object, field: str) -> str:
    try:
        return validate_id(value, field)  # type: ignore[arg-type]
    except InvalidMetadata as exc:
        raise ValueError(str(exc)) from None


def _id(document: Mapping[str, object], field: str) -> str:
    return _checked_id(document.get(field), field)


def _numbers(values: object, length: int, field: str) -> list[float]:
    """``values`` as floats if it is a list of ``length`` finite non-negative JSON numbers."""
    if not isinstance(values, list) or len(values) != length:
        raise ValueError(f"{field} must be lists of {length} numbers")
    numbers: list[float] = []
    for value in values:
        if type(value) not in (int, float):
            raise ValueError(f"{field} must hold numbers, got {type(value).__name__}")
        try:
            number = float(value)  # type: ignore[arg-type]
        except OverflowError:
            number = math.inf
        if not (math.isfinite(number) and number >= 0):
            raise ValueError(f"{field} must be finite and non-negative")
        numbers.append(number)
    return numbers
