"""Client-side timing of every streamed model call of a LangGraph run."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler

__all__ = ["CallRecord", "CallTimer"]


@dataclass
class CallRecord:
    """One streamed model call (one agent turn): times are ``time.perf_counter()`` seconds."""

    agent: str
    session: str
    start: float
    first: float | None = None
    end: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start


class CallTimer(BaseCallbackHandler):
    """Times every chat-model call of a LangGraph run: start, first streamed chunk, end, usage.

    A sync handler with ``run_inline = True``, so it runs in the node's task right at the call
    (no executor hop between the timestamps and the request).
    """

    run_inline = True
    raise_error = False

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CallRecord] = []
        self._open: dict[Any, CallRecord] = {}
        self._lock = threading.Lock()

    def on_chat_model_start(
        self, serialized: Any, messages: Any, *, run_id: Any, metadata: Any = None, **kw: Any
    ) -> None:
        metadata = metadata or {}
        record = CallRecord(
            agent=str(metadata.get("langgraph_node", "?")),
            session=str(metadata.get("thread_id", "?")),
            start=time.perf_counter(),
        )
        with self._lock:
            self._open[run_id] = record

    def on_llm_new_token(self, token: str, *, run_id: Any, **kw: Any) -> None:
        record = self._open.get(run_id)
        if record is not None and record.first is None:
            record.first = time.perf_counter()

    def on_llm_end(self, response: Any, *, run_id: Any, **kw: Any) -> None:
        now = time.perf_counter()
        with self._lock:
            record = self._open.pop(run_id, None)
        if record is None:
            return
        record.end = now
        try:
            usage = response.generations[0][0].message.usage_metadata or {}
        except (AttributeError, IndexError):
            usage = {}
        record.prompt_tokens = int(usage.get("input_tokens") or 0)
        record.cached_tokens = int((usage.get("input_token_details") or {}).get("cache_read") or 0)
        with self._lock:
            self.records.append(record)

    def on_llm_error(self, error: BaseException, *, run_id: Any, **kw: Any) -> None:
        with self._lock:
            record = self._open.pop(run_id, None)
        if record is not None:
            record.error = f"{type(error).__name__}: {error}"[:300]
            with self._lock:
                self.records.append(record)
