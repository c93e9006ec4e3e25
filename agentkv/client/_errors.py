"""Client-side accounting: counters of what happened and of errors swallowed instead of raised."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Final

__all__ = ["COUNTS", "ERRORS", "ErrorCounter", "count", "logger"]

logger = logging.getLogger("agentkv.frameworks")


class ErrorCounter:
    """Counts swallowed errors by kind and logs the first of each kind once.

    Invariant: ``by_kind[k]`` is the number of :meth:`record` calls for ``k``; exactly one warning
    is logged per kind, at its first record.
    """

    def __init__(self, log: logging.Logger = logger) -> None:
        self.by_kind: Counter[str] = Counter()
        self._log = log
        # re-entrant: a logging handler may itself record an error
        self._lock = threading.RLock()

    def record(self, kind: str, exc: BaseException | None = None, message: str = "") -> None:
        # the warning is logged under the lock: once any record of a kind returned, its warning is out
        with self._lock:
            self.by_kind[kind] += 1
            if self.by_kind[kind] == 1:
                detail = message or (f"{type(exc).__name__}: {exc}" if exc is not None else "error")
                self._log.warning(
                    "agentkv: %s failed (%s); the application is unaffected, further failures are only counted",
                    kind,
                    detail,
                )

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


ERRORS: Final = ErrorCounter()
"""The process-wide counter of errors agentkv's client code swallowed (``stats()["errors"]``)."""

COUNTS: Final[Counter[str]] = Counter()
"""The process-wide client counters (``stats()["counts"]``): tagged requests, dispatches, events..."""
_COUNTS_LOCK: Final = threading.Lock()  # ``+=`` on a Counter is a read and a write: threads would lose counts


def count(kind: str, n: int = 1) -> None:
    """Add ``n`` to the client counter ``kind``."""
    with _COUNTS_LOCK:
        COUNTS[kind] += n
