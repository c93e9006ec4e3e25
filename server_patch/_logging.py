"""agentkv's own log lines in the server's processes.

vLLM configures only its ``vllm`` logger, and the API server's root logger stands at ERROR, so
without a handler of its own every agentkv warning there (a peer that cannot be pulled, malformed
metadata, a failed snapshot) and the engine's start-up line were dropped. The ``agentkv`` logger
gets a stderr handler beside vLLM's, at vLLM's level (``VLLM_LOGGING_LEVEL``, default INFO).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

__all__ = ["configure_logging"]

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record comes (as logging's last resort does),
    so that a stream replaced since (a test's capture, closed by now) is never written to."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stderr


def configure_logging() -> None:
    """Give the ``agentkv`` logger a stderr handler and vLLM's level, once per process."""
    root = logging.getLogger("agentkv")
    if any(isinstance(handler, _Stderr) for handler in root.handlers):
        return
    handler = _Stderr()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    root.addHandler(handler)
    level = logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    root.setLevel(level if isinstance(level, int) else logging.INFO)
