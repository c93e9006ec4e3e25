"""Periodic snapshots of the learned state, from a daemon thread in the EngineCore.

vLLM's process manager may kill the EngineCore right after its SIGTERM, before any
shutdown hook runs there; saving every ``interval`` seconds bounds what such a kill (or
a SIGKILL) loses to one interval. The API server also asks for a save when it is told to
stop (see middleware.py), while the EngineCore still answers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["PeriodicSave"]

logger = logging.getLogger("agentkv.server")


class PeriodicSave:
    """Calls ``save`` every ``interval`` seconds until closed; a failing save is logged once
    per distinct reason and retried at the next interval, never raised into the engine."""

    def __init__(self, save: Callable[[], bool], interval: float) -> None:
        if not interval > 0:
            raise ValueError("interval must be > 0 seconds")
        self._save = save
        self.interval = interval
        self.saves = 0
        self.failures = 0
        self._reported: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentkv-snapshot", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if self._save():
                    self.saves += 1
            except Exception as exc:  # a full disk must not stop the engine
                self.failures += 1
                reason = f"{type(exc).__name__}: {exc}"
                if reason not in self._reported and len(self._reported) < 16:
                    self._reported.add(reason)
                    logger.warning("agentkv: periodic snapshot failed (%s); retrying every %.0f s", reason,
                                   self.interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
