"""The request trace (``AGENTKV_TRACE``): what an offline bound on eviction needs, one line per admission."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from agentkv.protocol import AgentTag

__all__ = ["MAX_TRACE_BYTES", "RequestTrace", "block_key"]

logger = logging.getLogger("agentkv.server")

MAX_TRACE_BYTES = 512 * 2**20  # a trace stops growing here (later admissions are counted as dropped)


def block_key(block_hash: object) -> str:
    """A prompt block's chained hash as 16 hex digits: equal keys, equal prefixes up to that block."""
    if isinstance(block_hash, (bytes, bytearray)):
        return bytes(block_hash[:8]).hex()
    return format(hash(block_hash) & 0xFFFF_FFFF_FFFF_FFFF, "016x")


class RequestTrace:
    """Appends one JSON line per admitted request to ``path``.

    A line holds what a replay of the cache needs and no prompt text: the wall-clock arrival,
    the request id, the agent, session and parent the server took it for (tag or recognition),
    whether it was a warm-up, its prompt tokens, the tokens it found cached, the keys of its
    prompt's full blocks, the block size and the pool's blocks (``agentkv bench bound`` reads it).
    Each line is one unbuffered append (one ``write`` of the whole line), so that a reader, or
    the other engines of a data-parallel server writing the same file, never see half a line.
    Invariant: no line takes the file past ``limit`` bytes (its own size: the lines of a
    restart on the same path, or of the other engines, count too); a write error stops the
    trace for good (logged once) and never fails the request.
    """

    def __init__(self, path: str, *, limit: int = MAX_TRACE_BYTES, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.limit = limit
        self.clock = clock
        self.written = 0
        self.dropped = 0
        self.error: str | None = None
        self._file: Any = None  # a raw FileIO, opened at the first line

    def admitted(self, request_id: str, tag: AgentTag | None, tokens: int, hit_tokens: int,
                 block_hashes: Sequence[object], block_size: int, pool_blocks: int) -> None:
        if self.error is not None:
            return
        line = json.dumps({
            "t": round(self.clock(), 4), "id": request_id,
            "agent": None if tag is None else tag.agent, "session": None if tag is None else tag.session,
            "parent": None if tag is None else tag.parent, "step": None if tag is None else tag.step,
            "warmup": tag is not None and tag.warmup,
            "tokens": tokens, "hit": hit_tokens, "block_size": block_size, "pool_blocks": pool_blocks,
            "blocks": [block_key(h) for h in block_hashes],
        }, separators=(",", ":")).encode() + b"\n"
        try:
            if self._file is None:
                self._file = open(self.path, "ab", buffering=0)  # kept open for the server's life
            if os.fstat(self._file.fileno()).st_size + len(line) > self.limit:
                self.dropped += 1
                return
            if self._file.write(line) != len(line):
                raise OSError(f"short write ({len(line)} bytes)")
        except OSError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("agentkv: the request trace %s stopped: %s", self.path, self.error)
            return
        self.written += 1

    def stats(self) -> dict[str, Any]:
        return {"path": self.path, "written": self.written, "dropped": self.dropped, "error": self.error}
