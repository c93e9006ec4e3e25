"""Sessions the TransitionLearner ended for idling past its TTL, remembered in case they come back."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["MAX_EXPIRED", "ExpiredSession", "ExpiredSessions"]

MAX_EXPIRED = 4096  # as many as SessionTiming remembers; the least recently expired is forgotten first


@dataclass(slots=True)
class ExpiredSession:
    """A session's lineage when it expired: the slot of its last agent, its step, and ``end``, the
    weight its end added to ``_ends[index]`` (divided like the counts when they are rescaled)."""

    index: int
    step: int | None
    end: float


class ExpiredSessions:
    """Bounded memo of expired sessions; an entry naming a slot goes when the slot is recycled (the
    slot's end count is cleared with it, and its agent is no session's last agent any more)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, ExpiredSession] = OrderedDict()
        self._by_slot: dict[int, set[str]] = {}

    def add(self, session: str, expired: ExpiredSession) -> None:
        """Remember a session that was live until now (a live session is never remembered as well)."""
        self._entries[session] = expired
        self._by_slot.setdefault(expired.index, set()).add(session)
        if len(self._entries) > MAX_EXPIRED:
            self.pop(next(iter(self._entries)))

    def pop(self, session: str) -> ExpiredSession | None:
        """Forget the session; what was remembered of it (None: nothing)."""
        expired = self._entries.pop(session, None)
        if expired is not None:
            naming = self._by_slot[expired.index]
            naming.discard(session)
            if not naming:
                del self._by_slot[expired.index]
        return expired

    def forget_slot(self, index: int) -> None:
        for session in self._by_slot.pop(index, ()):
            del self._entries[session]

    def rescale(self, divisor: float) -> None:
        """The counts were divided by ``divisor``: so is each remembered end, to stay exact."""
        for expired in self._entries.values():
            expired.end /= divisor
