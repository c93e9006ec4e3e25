"""What became of the warm-ups the coordinator sent, as the agents' next real calls tell."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["WarmupLedger"]

_RECENT: Final = 32


@dataclass(slots=True)
class _Pending:
    tokens: int  # warmed anchor length (tokens, block-floored)
    at: float


class WarmupLedger:
    """Counts each warm-up's outcome in ``counts``: ``useful``, ``not_useful``, ``unmeasured``, ``unused``.

    Invariant: a warm-up of known length is pending until the next real call of its agent reports
    its prefix hit (``useful`` when ``cached_tokens`` >= the warmed length, ``not_useful`` when less,
    ``unmeasured`` when unknown) or until ``useful_window`` seconds pass without one (``unused``,
    counted by :meth:`expire`); a newer warm-up of the same agent replaces it. ``recent`` keeps the
    last warm-ups, each annotated with the next call's ``cached_tokens``. Not thread-safe: the
    coordinator calls it under its lock.
    """

    def __init__(self, counts: Counter[str], useful_window: float, clock: Callable[[], float]) -> None:
        self.counts = counts
        self.useful_window = useful_window
        self.clock = clock
        self.pending: dict[str, _Pending] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=_RECENT)

    def sent(self, agent: str, length: int, at: float, record: dict[str, Any]) -> None:
        self.expire()  # bounded without a stats() reader: pending holds warm-ups of the last window only
        if length:
            self.pending[agent] = _Pending(length, at)
        self.recent.append(record)

    def real_call(self, agent: str, cached_tokens: int | None) -> None:
        pending = self.pending.pop(agent, None)
        if pending is None:
            return
        if cached_tokens is None:
            self.counts["unmeasured"] += 1
        elif cached_tokens >= pending.tokens:
            self.counts["useful"] += 1
        else:
            self.counts["not_useful"] += 1
        for record in reversed(self.recent):
            if record["agent"] == agent and "next_call_cached_tokens" not in record:
                record["next_call_cached_tokens"] = cached_tokens
                break

    def expire(self) -> None:
        now = self.clock()
        for agent in [a for a, p in self.pending.items() if now - p.at > self.useful_window]:
            del self.pending[agent]
            self.counts["unused"] += 1
