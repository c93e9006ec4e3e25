"""Fire-and-forget delivery of ``POST /agentkv/v1/events`` (graph facts, session lifecycle).

A background thread drains a bounded queue and posts batches with httpx (2 s timeout). The user's
code never waits on the server and never sees an error: failures are counted and logged once.
Events carry an ``id``, so the server skips replays; a failed batch is dropped, not retried
(graph facts are re-sent with every ``session_start``). Several endpoints (the replicas behind a
router, which sends ``/agentkv/*`` to one replica of its choosing) each get every batch; one
failing endpoint does not stop delivery to the others. Nothing is lost silently: every event is
counted as sent, failed or dropped, and closing (explicitly or at interpreter exit) waits at most
``CLOSE_TIMEOUT`` seconds before counting what is still queued or in flight as dropped.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import httpx

from agentkv.client import ERRORS, count
from agentkv.protocol import EVENTS_PATH, PROTOCOL_VERSION, validate_events

__all__ = ["CLOSE_TIMEOUT", "EventSink", "SinkHandle", "events_endpoint", "get_sink", "new_event_id", "session_event"]

_MAX_BATCH: Final = 1000  # the schema's maxItems
CLOSE_TIMEOUT: Final = 1.0  # seconds EventSink.close() (and interpreter exit) waits for pending deliveries

logger = logging.getLogger("agentkv.frameworks")
_LIVE_SINKS: weakref.WeakSet[EventSink] = weakref.WeakSet()


def new_event_id() -> str:
    return uuid.uuid4().hex


def session_event(kind: str, session: str) -> dict[str, Any]:
    return {"type": kind, "id": new_event_id(), "session": session}


def events_endpoint(url: str) -> str:
    """Accept a full events URL or a server base URL (``http://host:port`` or ``.../v1``)."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if path.endswith(EVENTS_PATH):
        return url
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path + EVENTS_PATH, "", ""))


class EventSink:
    """Posts agentkv events from a daemon thread to every endpoint in ``urls``; ``post`` never
    blocks and never raises.

    Accounting invariant: every event handed to ``post`` is counted exactly once per endpoint (one
    *delivery*) in ``sent`` (the endpoint answered below 400), ``failed`` (a connection error, an
    HTTP error status or the client timeout) or ``dropped`` (invalid, queue full, posted after
    ``close``, or still queued or in flight when ``close`` stopped waiting); ``pending`` holds the
    deliveries not counted yet. After ``close``, ``pending == 0`` and ``sent + failed + dropped``
    is the number of events posted times ``len(urls)`` (an unreadable post counts as one event).

    ``close`` never waits longer than its ``timeout`` (default :data:`CLOSE_TIMEOUT` seconds); it is
    also run at interpreter exit, so a dead or hanging server costs at most that much at exit.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        timeout: float = 2.0,
        max_queue: int = 10_000,
        transport: httpx.BaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        """``api_key`` (default ``VLLM_API_KEY``) is sent as vLLM expects it, when the server has one."""
        self.urls = _endpoints(url)
        key = os.environ.get("VLLM_API_KEY") if api_key is None else api_key
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout = timeout
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self.pending = 0
        self._transport = transport
        self._queue: queue.Queue[list[dict[str, Any]] | None] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()  # guards the counters, _thread, _closed and _abandoned
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._abandoned = False  # close() counted what was left as dropped: the worker counts nothing more
        _LIVE_SINKS.add(self)

    def post(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Queue events for delivery (invalid ones are dropped and counted)."""
        batch: list[dict[str, Any]] = []
        try:
            batch = [dict(e) for e in events]
            if not batch:
                return
            validate_events({"version": PROTOCOL_VERSION, "events": batch[:_MAX_BATCH]})
        except Exception as exc:
            self._drop(max(1, len(batch)) * len(self.urls))
            ERRORS.record("events post", exc)
            return
        deliveries = len(batch) * len(self.urls)
        self._start()
        with self._lock:
            if self._closed:
                reason = "sink closed, events dropped"
            else:
                try:
                    self._queue.put_nowait(batch)
                    self.pending += deliveries
                    return
                except queue.Full:
                    reason = "queue full, events dropped"
        self._drop(deliveries)
        ERRORS.record("events queue", message=reason)

    def discard(self, events: Iterable[Mapping[str, Any]], reason: str) -> None:
        """Count ``events`` as dropped without queueing them (their poster is closed)."""
        try:
            n = len(list(events))
        except Exception:
            n = 1  # an unreadable post counts as one event
        if n:
            self._drop(n * len(self.urls))
            ERRORS.record("events queue", message=reason)

    def flush(self, timeout: float | None = 5.0) -> bool:
        """Wait until every queued delivery was counted; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self.pending == 0, timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Wait up to ``timeout`` seconds for pending deliveries, count the rest as dropped, stop."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._idle:
            self._closed = True
            self._idle.wait_for(lambda: self.pending == 0, max(0.0, timeout))
            self._drop_pending()
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put_nowait(None)  # the queue is empty: wakes the worker, which then exits
        _LIVE_SINKS.discard(self)
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.failed or self.dropped:
            logger.warning("agentkv events to %s: sent %d, failed %d, dropped %d",
                           ", ".join(self.urls), self.sent, self.failed, self.dropped)

    def _drop_pending(self) -> None:
        """Count whatever is still queued or in flight as dropped (under ``_idle``): nothing more is sent."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self.pending:
            self.dropped += self.pending
            count("events_dropped", self.pending)
            self.pending = 0
            self._abandoned = True
            self._idle.notify_all()

    def _drop(self, deliveries: int) -> None:
        with self._lock:
            self.dropped += deliveries
        count("events_dropped", deliveries)

    def _count(self, outcome: str, deliveries: int) -> None:
        """Move ``deliveries`` from pending to ``outcome`` (sent or failed), unless close() gave up."""
        with self._idle:
            if self._abandoned:
                return
            setattr(self, outcome, getattr(self, outcome) + deliveries)
            self.pending -= deliveries
            count(f"events_{outcome}", deliveries)
            self._idle.notify_all()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="agentkv-events", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # e.g. no client can be built (an API key httpx cannot encode)
            ERRORS.record("events worker", exc)
            with self._idle:  # the sink closes: what is queued and what comes later is dropped, never awaited
                self._closed = True
                self._drop_pending()

    def _serve(self) -> None:
        with httpx.Client(timeout=self.timeout, transport=self._transport, trust_env=False,
                          headers=self._headers) as client:
            while True:
                first = self._queue.get()
                if first is None:
                    return
                # coalesce whatever else is waiting into one POST (a slow server costs one timeout, not N)
                batches, stop = [first], False
                while sum(len(b) for b in batches) < _MAX_BATCH:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        stop = True
                        break
                    batches.append(more)
                events = [e for b in batches for e in b]
                for url in self.urls:
                    self._deliver(client, url, events)
                if stop:
                    return

    def _deliver(self, client: httpx.Client, url: str, events: list[dict[str, Any]]) -> None:
        delivered = 0
        try:
            for start in range(0, len(events), _MAX_BATCH):
                chunk = events[start : start + _MAX_BATCH]
                response = client.post(url, json={"version": PROTOCOL_VERSION, "events": chunk})
                if response.status_code >= 400:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
                delivered += len(chunk)
                self._count("sent", len(chunk))
        except Exception as exc:
            # recorded (and logged) before it is counted: whoever flush() wakes sees the error too
            ERRORS.record(f"events POST to {url}", exc)
            self._count("failed", len(events) - delivered)


def _endpoints(url: str | Sequence[str]) -> tuple[str, ...]:
    urls = (url,) if isinstance(url, str) else tuple(url)
    if not urls:
        raise ValueError("no events endpoint given")
    return tuple(dict.fromkeys(events_endpoint(u) for u in urls))  # de-duplicated, in order


@dataclass(slots=True)
class _Shared:
    """The sink shared by every app posting to one set of endpoints, and how many still use it."""

    sink: EventSink
    users: int = 0


_SINKS: dict[tuple[str, ...], _Shared] = {}
_SINKS_LOCK = threading.Lock()


class SinkHandle:
    """One app's use of the :class:`EventSink` shared by every app with the same endpoints.

    It posts, flushes and counts as the shared sink (``sent``, ``dropped``, ``urls``, ... are the
    shared sink's). ``close`` detaches this app only: its later posts are dropped and counted, the
    other apps' go on, and the shared sink itself closes when the last app detaches.
    """

    def __init__(self, shared: _Shared) -> None:
        self._shared = shared
        self._detached = False

    @property
    def sink(self) -> EventSink:
        return self._shared.sink

    def post(self, events: Iterable[Mapping[str, Any]]) -> None:
        if self._detached:
            self.sink.discard(events, "sink closed, events dropped")
        else:
            self.sink.post(events)

    def flush(self, timeout: float | None = 5.0) -> bool:
        return self.sink.flush(timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Detach this app (once): the last one closes the shared sink, the others wait up to
        ``timeout`` seconds for what is pending, as ``EventSink.close`` would."""
        with _SINKS_LOCK:
            if self._detached:
                return
            self._detached = True
            self._shared.users -= 1
            last = self._shared.users == 0
            if last and _SINKS.get(self.sink.urls) is self._shared:
                del _SINKS[self.sink.urls]
        if last:
            self.sink.close(timeout)
        else:
            self.sink.flush(max(0.0, timeout))

    def __getattr__(self, name: str) -> Any:  # the counters and settings are the shared sink's
        if name in ("_shared", "_detached"):
            raise AttributeError(name)
        return getattr(self._shared.sink, name)


def get_sink(url: str | Sequence[str]) -> SinkHandle:
    """A handle on the one sink (and thread) shared per set of events endpoints."""
    endpoints = _endpoints(url)
    with _SINKS_LOCK:
        shared = _SINKS.get(endpoints)
        if shared is None or shared.sink._closed:
            shared = _SINKS[endpoints] = _Shared(EventSink(endpoints))
        shared.users += 1
        return SinkHandle(shared)


@atexit.register
def _close_at_exit() -> None:
    """Count what could not be delivered before the process ends; at most CLOSE_TIMEOUT in all."""
    deadline = time.monotonic() + CLOSE_TIMEOUT
    for sink in list(_LIVE_SINKS):
        sink.close(max(0.0, deadline - time.monotonic()))
