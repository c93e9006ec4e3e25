"""What became of each anchor warm-up, as the engine sees it: useful, wasted or redundant."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["WarmupLedger"]

DEFAULT_WINDOW: Final = 120.0
# Upper bounds (s) of the buckets of a useful warm-up's lead, from its admission to its agent's
# call's: a lead shorter than the warm-up's own prefill puts that prefill just ahead of the call
# (the call hits it, and waits for it), a long one overlapped other work.
LEAD_BOUNDS: Final = (0.05, 0.2, 1.0, 5.0, 30.0)
# The survival a warm-up decision reads is over this many latest outcomes, so that it follows the
# pool's pressure as the workload changes rather than the server's whole life.
SURVIVAL_WINDOW: Final = 100
# At most this many agents' warm-ups are pending (agent names are the client's): a warm-up past it
# supersedes the oldest pending one.
MAX_PENDING: Final = 1024


@dataclass(frozen=True, slots=True)
class _Warmed:
    hashes: tuple[Hashable, ...]  # the warm-up's full blocks, in prompt order
    at: float


class WarmupLedger:
    """Server-side outcome of warm-ups (requests tagged ``warmup``), per agent.

    A warm-up is ``sent`` when the engine admits it. It is ``redundant`` when it found its prompt
    cached already (every block it could hit); otherwise it is
    *pending* until the first of: the agent's next real request is admitted (``useful`` if that
    request hit every warmed block, ``wasted`` as ``missed`` if not, e.g. its prompt no longer
    starts with them), a warmed block is evicted (``wasted``: ``evicted``), ``window`` seconds pass
    (``wasted``: ``expired``), or a new warm-up of the agent replaces it (``wasted``: ``superseded``).

    Invariants: at most one pending warm-up per agent, and at most ``MAX_PENDING`` in all (the
    latest); ``sent == useful + wasted + redundant +
    pending``; ``_holders`` maps exactly the hashes of pending warm-ups to their agents; the lead
    buckets count every useful warm-up once (``sum(lead_counts) == useful``); ``_survived`` holds
    the latest ``SURVIVAL_WINDOW`` outcomes that tell survival (useful: True; evicted or missed:
    False).
    """

    def __init__(self, clock: Callable[[], float], window: float = DEFAULT_WINDOW) -> None:
        self.clock = clock
        self.window = window
        self.counts: Counter[str] = Counter()
        self.wasted: Counter[str] = Counter()
        self._pending: dict[str, _Warmed] = {}
        self._holders: dict[Hashable, set[str]] = {}
        self.lead_counts = [0] * (len(LEAD_BOUNDS) + 1)  # the last: longer than LEAD_BOUNDS[-1]
        self.lead_sum = 0.0
        self._survived: deque[bool] = deque(maxlen=SURVIVAL_WINDOW)

    def warmed(self, agent: str, block_hashes: Sequence[Hashable], hit_blocks: int, hittable_blocks: int) -> None:
        """A warm-up of ``agent`` was admitted with ``hit_blocks`` leading blocks from the cache, of
        ``hittable_blocks`` it could hit at most (vLLM always computes a prompt's last token)."""
        self.expire()
        self.counts["sent"] += 1
        if not block_hashes or hit_blocks >= hittable_blocks:
            self.counts["redundant"] += 1
            return
        if agent in self._pending:
            self._resolve(agent, "superseded")
        self._pending[agent] = _Warmed(tuple(block_hashes), self.clock())
        for block_hash in block_hashes:
            self._holders.setdefault(block_hash, set()).add(agent)
        if len(self._pending) > MAX_PENDING:
            self._resolve(next(iter(self._pending)), "superseded")  # the oldest (a dict keeps insertion order)

    def used(self, agent: str, block_hashes: Sequence[Hashable], hit_blocks: int) -> None:
        """A real request of ``agent`` was admitted with ``hit_blocks`` leading blocks from the cache."""
        self.expire()
        warmed = self._pending.get(agent)
        if warmed is None:
            return
        n = len(warmed.hashes)
        hit = hit_blocks >= n and tuple(block_hashes[:n]) == warmed.hashes
        self._resolve(agent, None if hit else "missed")

    @property
    def holding(self) -> bool:
        """True while a pending warm-up holds blocks (only then do evictions need their hashes)."""
        return bool(self._holders)

    def evicted(self, block_hash: Hashable) -> None:
        """A cached block was evicted: a pending warm-up holding it was wasted."""
        agents = self._holders.get(block_hash)
        if agents:
            for agent in list(agents):
                self._resolve(agent, "evicted")

    def expire(self) -> None:
        if not self._pending:
            return
        now = self.clock()
        for agent in [a for a, w in self._pending.items() if now - w.at > self.window]:
            self._resolve(agent, "expired")

    def _resolve(self, agent: str, waste: str | None) -> None:
        warmed = self._pending.pop(agent)
        for block_hash in warmed.hashes:
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(agent)
                if not holders:
                    del self._holders[block_hash]
        if waste is None or waste in ("evicted", "missed"):
            self._survived.append(waste is None)
        if waste is None:
            self.counts["useful"] += 1
            lead = max(0.0, self.clock() - warmed.at)
            self.lead_counts[bisect_left(LEAD_BOUNDS, lead)] += 1
            self.lead_sum += lead
        else:
            self.counts["wasted"] += 1
            self.wasted[waste] += 1

    def outcomes(self) -> tuple[int, int]:
        """(useful, failed) among the latest ``SURVIVAL_WINDOW`` warm-ups whose agent's call hit
        them or that were evicted or missed first: what a warm-up decision weighs its prediction
        by (expired and superseded ones say nothing about surviving to the call)."""
        self.expire()
        useful = sum(self._survived)
        return useful, len(self._survived) - useful

    def stats(self) -> dict[str, Any]:
        self.expire()
        return {
            "sent": self.counts["sent"],
            "useful": self.counts["useful"],
            "wasted": self.counts["wasted"],
            "redundant": self.counts["redundant"],
            "pending": len(self._pending),
            "wasted_by": {k: self.wasted[k] for k in ("evicted", "expired", "missed", "superseded")},
            "window_s": self.window,
            "useful_lead_s": {"bounds": list(LEAD_BOUNDS), "counts": list(self.lead_counts),
                              "sum": round(self.lead_sum, 6)},
        }
