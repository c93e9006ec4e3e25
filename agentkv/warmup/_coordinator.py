"""Background anchor warm-up: after each dispatch, re-prefill the anchor of the agent predicted next.

Seed 001 §3.4: in the pause after an agent's turn, predict the next agent (a* = argmax P(a | a_t))
and, if execution is predictable enough (R >= R_min) and a rate limit allows, send a request
holding only that agent's anchor with ``max_tokens=1``, tagged as a warm-up so the server serves it
normally but never learns from it. Off the critical path: the user's calls never wait for it.

Design (see docs/frameworks.md, "Warm-up"):

* Hooks: the first answer of a dispatch's model call (``_responses``; a stream at its first bytes)
  enqueues a job: the rest of the dispatch (decoding, its tool step) is the pause before the next
  agent; ``on_dispatch_end`` enqueues it for dispatches without an observed answer; ``on_dispatch`` feeds the optional
  client-side learner and marks the session's pause as over (a job that is still queued when the
  next agent already started is skipped as ``late``: the real call is computing the prefix anyway);
  ``on_session_end`` drops the session's pending jobs; ``on_request`` captures anchors
  (:class:`~agentkv.warmup.AnchorBook`) and the agents' last use; responses (see ``_responses``)
  tell whether a warm-up was useful.
* One daemon worker thread and a bounded queue (the oldest job is dropped and counted when full).
  Every network call has an httpx timeout; every error is counted by kind and logged once. Nothing
  raises into, blocks or slows the application's calls.
* The decision is :class:`~agentkv.warmup.WarmupPolicy` (``_decision``), the same pure function the
  replay's ``agentkv+warmup`` runs; each gate that stops a job is counted in ``skipped``. Its inputs
  come from the server's ``/metrics``, read at most every ``metrics_interval`` seconds: requests
  running and waiting (``vllm:num_requests_*``), free KV blocks (``agentkv_kv_free_blocks``) and
  whether the predicted agent's anchor is resident (``agentkv_anchor_resident_blocks`` >=
  ``agentkv_anchor_length_blocks``). What a server cannot tell (vanilla vLLM, an agent whose anchor
  it has not learned yet, metrics that fail) does not block a warm-up and is counted in
  ``fallbacks``.
* The warm-up replays the anchor's exact token ids as ``POST /v1/completions`` ``prompt: [ids]``
  (``max_tokens: 1``) with ``AgentTag(agent, warmup=True).to_headers()``; without a ``/tokenize``
  endpoint it replays ``messages[0]`` + tools as a chat request. The tag carries no session: the
  warmed blocks are the agent's anchor, not any session's history, and an ended session is never
  revived by a late warm-up.
* ``useful``: the predicted agent's next real call (non-streaming) reported ``cached_tokens`` >=
  the warmed anchor length; ``not_useful`` when it reported less; ``unmeasured`` when it did not
  report it; ``unused`` when no call of that agent came within ``useful_window`` seconds.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import httpx

from agentkv.client import (
    Dispatch,
    ErrorCounter,
    TaggedResponse,
    install,
    learner_listener,
    on_dispatch,
    on_dispatch_end,
    on_response,
    on_session_end,
    routing_header,
    usage_of,
)
from agentkv.protocol import STATS_PATH, AgentTag

from ._anchors import DEFAULT_BLOCK_SIZE, Anchor, AnchorBook, same_server
from ._decision import JobState, TargetState, TokenBucket, WarmupPolicy

__all__ = ["CLOSE_TIMEOUT", "TokenBucket", "WarmupCoordinator"]

logger = logging.getLogger("agentkv.warmup")

CLOSE_TIMEOUT: Final = 1.0  # seconds close() waits for the job in progress
_MAX_SESSIONS: Final = 65_536
_RECENT: Final = 32


@dataclass(frozen=True, slots=True)
class _Job:
    agent: str  # the agent whose dispatch ended (predict from it), or the agent to warm (manual)
    session: str | None
    seq: int | None  # the session's dispatch count when the job was queued
    manual: bool = False
    queued: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Pending:
    tokens: int  # warmed anchor length (tokens, block-floored)
    at: float


def _server_root(url: str) -> str:
    """``http://host:port`` from a base URL that may end in ``/v1``."""
    parts = urlsplit(url.rstrip("/"))
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


@dataclass(slots=True)
class ServerView:
    """What one ``GET /metrics`` tells about the engine (None: the server did not say).

    ``anchors``: agent -> (leading anchor blocks resident, learned anchor length in blocks).
    """

    running: float | None = None
    waiting: float | None = None
    free_blocks: int | None = None
    anchors: dict[str, tuple[int, int]] = field(default_factory=dict)

    def resident(self, agent: str) -> bool | None:
        resident, length = self.anchors.get(agent, (0, 0))
        return None if length <= 0 else resident >= length


_SAMPLE: Final = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_AGENT_LABEL: Final = re.compile(r'agent="((?:[^"\\]|\\.)*)"')


def parse_server_view(text: str) -> ServerView:
    """The engine's queue (summed over engines), free blocks and anchor residency from Prometheus text."""
    view = ServerView()
    resident: dict[str, int] = {}
    length: dict[str, int] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, raw = match.groups()
        if name == "vllm:num_requests_running":
            view.running = (view.running or 0.0) + float(raw)
        elif name == "vllm:num_requests_waiting":
            view.waiting = (view.waiting or 0.0) + float(raw)
        elif name == "agentkv_kv_free_blocks":
            view.free_blocks = int(float(raw))
        elif name in ("agentkv_anchor_resident_blocks", "agentkv_anchor_length_blocks"):
            agent = _AGENT_LABEL.search(labels or "")
            if agent is not None:
                table = resident if name == "agentkv_anchor_resident_blocks" else length
                table[_unescape(agent.group(1))] = int(float(raw))
    view.anchors = {a: (resident.get(a, 0), n) for a, n in length.items()}
    return view


def _unescape(label: str) -> str:
    """A Prometheus label value as written: ``\\\\``, ``\\"`` and ``\\n`` are escapes."""
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), label)


class WarmupCoordinator:
    """Warms the predicted next agent's anchor in the pause after each dispatch (see module doc).

    ``base_url``: the vLLM server (``http://host:port``, with or without ``/v1``). ``model``: the
    served model name for warm-ups (default: the one the agent's calls used). ``learner``: a
    client-side ``TransitionLearner`` or ``Predictor`` to predict with (fed from ``on_dispatch``
    unless ``feed_learner=False``, e.g. when ``instrument(learner=...)`` already feeds it); without
    one, the server's learned ``transitions`` and ``predictability`` (``GET /agentkv/v1/stats``, read
    at most every ``stats_interval`` s) are used. ``block_size``: default the server's (stats), else 32.
    ``r_min``, ``min_probability``, ``max_waiting``, ``max_load``, ``min_free_blocks``: the thresholds
    of :class:`~agentkv.warmup.WarmupPolicy`; ``max_per_second`` and ``burst``: its rate limiter.
    ``transport``: an httpx transport (tests). Use as a context manager or call ``start``/``close``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        learner: Any = None,
        feed_learner: bool = True,
        r_min: float = 0.3,
        min_probability: float = 0.0,
        max_per_second: float = 2.0,
        burst: float | None = None,
        max_waiting: int | None = 0,
        max_load: int | None = None,
        min_free_blocks: int = 0,
        metrics_interval: float = 0.5,
        stats_interval: float = 2.0,
        useful_window: float = 120.0,
        queue_size: int = 8,
        timeout: float = 10.0,
        block_size: int | None = None,
        anchors: AnchorBook | None = None,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base_url = _server_root(base_url)
        self.model = model
        self.policy = WarmupPolicy(r_min=r_min, min_probability=min_probability, max_waiting=max_waiting,
                                   max_load=max_load, min_free_blocks=min_free_blocks)
        self.metrics_interval = metrics_interval
        self.stats_interval = stats_interval
        self.useful_window = useful_window
        self.timeout = timeout
        self.clock = clock
        self.anchors = anchors if anchors is not None else AnchorBook(base_url=self.base_url, clock=clock)
        if block_size is not None:
            self.anchors.block_size = block_size
        self._block_size_known = block_size is not None
        self._predictor, self._learner = _predictor_of(learner)
        self._feed = feed_learner and self._learner is not None
        self._observe = learner_listener(self._learner) if self._feed else None
        self._learner_lock = threading.Lock()  # the learner is fed on app threads and read by the worker
        self._bucket = TokenBucket(max_per_second, burst if burst is not None else max(1.0, max_per_second), clock)
        self._transport = transport
        self.errors = ErrorCounter(logger)

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[_Job] = deque()
        self._queue_size = max(1, queue_size)
        self._busy_worker = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._unsubscribe: list[Callable[[], None]] = []
        self._client: httpx.Client | None = None

        self._seq: OrderedDict[str, int] = OrderedDict()  # session -> dispatches seen
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._predicted: OrderedDict[str, str] = OrderedDict()  # session -> agent a warm-up bet on
        self._answered: OrderedDict[str, int] = OrderedDict()  # session -> dispatch whose call answered
        self._pending: dict[str, _Pending] = {}
        self._view: tuple[float, ServerView] | None = None  # (read at, what /metrics said)
        self._server_stats: tuple[float, Mapping[str, Any] | None] | None = None
        self._chat_mode = False
        self.counts: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self.recent: deque[dict[str, Any]] = deque(maxlen=_RECENT)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> WarmupCoordinator:
        """Subscribe to the hooks and start the worker thread (idempotent)."""
        with self._lock:
            if self._thread is not None or self._closed:
                return self
            self._thread = threading.Thread(target=self._run, name="agentkv-warmup", daemon=True)
        install()
        self.anchors.attach()
        self._unsubscribe = [
            on_dispatch(self._on_dispatch),
            on_dispatch_end(self._on_dispatch_end),
            on_session_end(self._on_session_end),
            on_response(self._on_response),
        ]
        self._thread.start()
        return self

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Unsubscribe, drop the queued jobs (counted in ``dropped``), give the job in progress up
        to ``timeout`` seconds (default :data:`CLOSE_TIMEOUT`) to finish, and stop the worker. Never
        blocks longer than ``timeout``: a job stuck on a hanging server ends with its own httpx
        timeout on the daemon worker thread."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []
        self.anchors.detach()
        with self._lock:
            self._closed = True
            self.counts["dropped"] += len(self._queue)
            self._queue.clear()
            self._wake.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> WarmupCoordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until the queue is empty and no job is in progress; False on timeout."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._queue and not self._busy_worker, timeout)

    # -- hooks (run on the application's threads: only cheap bookkeeping) ---------------

    def _on_dispatch(self, d: Dispatch) -> None:
        if self._feed:
            try:
                with self._learner_lock:
                    self._observe(d)
            except Exception as exc:
                self.errors.record("learner observe", exc)
        if d.session is None:
            return
        with self._lock:
            self._seq[d.session] = self._seq.get(d.session, 0) + 1
            self._seq.move_to_end(d.session)
            if len(self._seq) > _MAX_SESSIONS:
                self._seq.popitem(last=False)
            self._ended.pop(d.session, None)
            bet = self._predicted.pop(d.session, None)
            if bet is not None:
                self.counts["predicted_right" if bet == d.agent else "predicted_wrong"] += 1

    def _on_dispatch_end(self, d: Dispatch) -> None:
        with self._lock:
            seq = None if d.session is None else self._seq.get(d.session, 0)
            if d.session is not None and self._answered.get(d.session) == seq:
                return  # this dispatch's job was queued when its model call answered
            self._enqueue(_Job(d.agent, d.session, seq, queued=self.clock()))

    def _on_session_end(self, session: str) -> None:
        if self._feed and hasattr(self._learner, "end_session"):
            try:
                with self._learner_lock:
                    self._learner.end_session(session)
            except Exception as exc:
                self.errors.record("learner end_session", exc)
        with self._lock:
            self._ended[session] = None
            if len(self._ended) > _MAX_SESSIONS:
                self._ended.popitem(last=False)
            self._predicted.pop(session, None)

    def _on_response(self, response: TaggedResponse) -> None:
        if response.tag.warmup or not same_server(response.base_url, self.base_url):
            return
        agent, session = response.tag.agent, response.tag.session
        with self._lock:
            seq = None if session is None else self._seq.get(session)
            if seq is not None and self._answered.get(session) != seq:
                # The model answered: the rest of the dispatch (decoding, the tool step) is the
                # pause before the next agent; a job queued at the dispatch's end would be late.
                self._answered[session] = seq
                self._answered.move_to_end(session)
                if len(self._answered) > _MAX_SESSIONS:
                    self._answered.popitem(last=False)
                self._enqueue(_Job(agent, session, seq, queued=self.clock()))
            pending = self._pending.pop(agent, None)
            if pending is None:
                return
            if response.cached_tokens is None:
                self.counts["unmeasured"] += 1
            elif response.cached_tokens >= pending.tokens:
                self.counts["useful"] += 1
            else:
                self.counts["not_useful"] += 1
            for record in reversed(self.recent):
                if record["agent"] == agent and "next_call_cached_tokens" not in record:
                    record["next_call_cached_tokens"] = response.cached_tokens
                    break

    def warm(self, agent: str) -> None:
        """Queue a warm-up of ``agent``'s anchor now (no prediction, no predictability gate)."""
        with self._lock:
            self._enqueue(_Job(agent, None, None, manual=True, queued=self.clock()))

    def _enqueue(self, job: _Job) -> None:
        """Under the lock: append, dropping the oldest job when the queue is full."""
        if self._closed or self._thread is None:
            return
        if len(self._queue) >= self._queue_size:
            self._queue.popleft()
            self.counts["dropped"] += 1
        self._queue.append(job)
        self._wake.notify_all()

    # -- worker ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            timeout = httpx.Timeout(self.timeout, connect=min(2.0, self.timeout))
            self._client = httpx.Client(base_url=self.base_url, timeout=timeout, trust_env=False,
                                        transport=self._transport)
        except Exception as exc:
            self.errors.record("warm-up client", exc)
            return
        try:
            while True:
                with self._wake:
                    while not self._queue and not self._closed:
                        self._wake.wait()
                    if self._closed:
                        return
                    job = self._queue.popleft()
                    self._busy_worker = True
                try:
                    self._handle(job)
                except Exception as exc:  # a bug here must not kill the worker
                    self.errors.record("warm-up job", exc)
                finally:
                    with self._wake:
                        self._busy_worker = False
                        self._wake.notify_all()
        finally:
            try:
                self._client.close()
            except Exception:
                pass

    def _skip(self, reason: str) -> None:
        with self._lock:
            self.skipped[reason] += 1

    def _handle(self, job: _Job) -> None:
        with self._lock:
            ended = job.session is not None and job.session in self._ended
            late = job.session is not None and self._seq.get(job.session, 0) != job.seq
        if job.manual or ended or late:
            target: str | None = job.agent if job.manual else None
            state = JobState(target, session_ended=ended, late=late, manual=job.manual)
        else:
            prediction = self._predict(job.agent)
            target = None if prediction is None else prediction[0]
            state = JobState(None) if prediction is None else JobState(*prediction)
        anchor: Anchor | None = None

        def target_state() -> TargetState:
            nonlocal anchor
            assert target is not None
            self._ensure_block_size()
            anchor = self._anchor(target)
            view = self._server_view()
            return TargetState(_blocks_to_warm(anchor, view, target), view.resident(target), view.waiting,
                               view.running, view.free_blocks)

        decision = self.policy.decide(state, target_state, self._take)
        with self._lock:
            self.fallbacks.update(decision.fallbacks)
        if not decision.warm:
            self._skip(decision.reason)
            return
        with self._lock:  # the pause may have ended while we were deciding
            late = job.session is not None and (job.session in self._ended or self._seq.get(job.session, 0) != job.seq)
        if late:
            self._skip("late")
            return
        assert target is not None and anchor is not None
        self._send(target, anchor, job)

    def _take(self) -> bool:
        with self._lock:
            return self._bucket.take()

    # -- prediction --------------------------------------------------------------------

    def _predict(self, agent: str) -> tuple[str, float, bool, float] | None:
        """(next agent, its probability, whether that transition was observed, predictability R) or None."""
        if self._predictor is not None:
            try:
                with self._learner_lock:
                    prediction = self._predictor.predict(agent)
                    if prediction is None:
                        return None
                    # a smoothed row without any observed successor predicts nothing
                    observed = _observed(self._learner, agent, prediction.agent)
                    return (prediction.agent, float(prediction.probability), observed,
                            float(self._learner.predictability()))
            except Exception as exc:
                self.errors.record("client-side prediction", exc)
                return None
        stats = self._stats()
        if stats is None:
            return None
        row = (stats.get("transitions") or {}).get(agent) or {}
        if not isinstance(row, Mapping) or not row:
            return None
        ranked = sorted(((float(p), str(a)) for a, p in row.items()), reverse=True)
        if len(ranked) > 1 and ranked[0][0] <= ranked[1][0]:
            return None  # a tie (e.g. the uniform row of an agent never followed): no information
        return ranked[0][1], ranked[0][0], True, float(stats.get("predictability") or 0.0)

    def _stats(self) -> Mapping[str, Any] | None:
        now = self.clock()
        cached = self._server_stats
        if cached is not None and now - cached[0] < self.stats_interval:
            return cached[1]
        try:
            response = self._client.get(STATS_PATH)
            response.raise_for_status()
            stats = response.json()
            if not isinstance(stats, Mapping):
                raise ValueError("stats are not a JSON object")
        except Exception as exc:
            self.errors.record(f"GET {STATS_PATH}", exc)
            self._server_stats = (now, None)  # do not ask again before stats_interval
            return None
        self._server_stats = (now, stats)
        return stats

    def _ensure_block_size(self) -> None:
        if self._block_size_known:
            return
        stats = self._stats()
        if stats is None:
            return  # unknown for now (the default applies); asked again after stats_interval
        size = stats.get("block_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            self.anchors.block_size = size
        else:
            self.anchors.block_size = self.anchors.block_size or DEFAULT_BLOCK_SIZE
        self._block_size_known = True

    # -- anchors -----------------------------------------------------------------------

    def _tokenize(self, payload: Mapping[str, Any]) -> list[int]:
        body = dict(payload)
        if self.model is not None:
            body["model"] = self.model
        response = self._client.post("/tokenize", json=body)
        if response.status_code in (404, 405):
            raise _NoTokenizer(f"HTTP {response.status_code}")
        response.raise_for_status()
        tokens = response.json().get("tokens")
        if not isinstance(tokens, list):
            raise ValueError("/tokenize answered without tokens")
        return tokens

    def _anchor(self, agent: str) -> Anchor | None:
        if not self._chat_mode:
            try:
                return self.anchors.resolve(agent, self._tokenize)
            except _NoTokenizer as exc:
                note = "the server has no /tokenize: warm-ups replay messages[0] + tools"
                self.errors.record("POST /tokenize", exc, note)
                self._chat_mode = True
            except Exception as exc:
                self.errors.record("POST /tokenize", exc)
                return None
        return self.anchors.resolve(agent, None)

    # -- server load -------------------------------------------------------------------

    def _server_view(self) -> ServerView:
        """What ``/metrics`` says, read at most every ``metrics_interval`` s (empty when unreadable)."""
        now = self.clock()
        cached = self._view
        if cached is not None and now - cached[0] < self.metrics_interval:
            return cached[1]
        view = ServerView()
        try:
            response = self._client.get("/metrics")
            response.raise_for_status()
            view = parse_server_view(response.text)
            if view.waiting is None:
                self.errors.record("GET /metrics", message="no vllm:num_requests_* gauges: the busy gate is off")
        except Exception as exc:
            self.errors.record("GET /metrics", exc)
        self._view = (now, view)
        return view

    # -- sending -----------------------------------------------------------------------

    def _send(self, agent: str, anchor: Anchor, job: _Job) -> None:
        model = self.model or anchor.model
        # through a router, the warm-up must take the path the predicted call will take
        headers = {**AgentTag(agent, warmup=True).to_headers(), **routing_header(agent, job.session)}
        if anchor.tokens:
            path = "/v1/completions"
            body: dict[str, Any] = {"model": model, "prompt": list(anchor.tokens), "max_tokens": 1, "temperature": 0}
        else:
            path = "/v1/chat/completions"
            body = {**(anchor.chat or {}), "model": model, "max_tokens": 1, "temperature": 0}
        body.update(anchor.extra)
        if model is None:
            body.pop("model")
        started = self.clock()
        try:
            response = self._client.post(path, json=body, headers=headers)
            if response.status_code >= 400:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            prompt_tokens, cached = usage_of(response.json())
        except Exception as exc:
            with self._lock:
                self.counts["failed"] += 1
            self.errors.record(f"warm-up POST {path}", exc)
            return
        done = self.clock()
        length = anchor.length
        if not length and prompt_tokens:  # chat replay: its own prompt is the anchor
            length = prompt_tokens // anchor.block_size * anchor.block_size
        with self._lock:
            self.counts["sent"] += 1
            # vLLM recomputes the last block of a fully cached prompt: it reports length - block_size
            if cached and length and cached >= length - anchor.block_size:
                self.counts["already_warm"] += 1
            if self._view is not None and agent in self._view[1].anchors:
                # until the next /metrics read, the anchor just warmed counts as resident
                learned = self._view[1].anchors[agent][1]
                self._view[1].anchors[agent] = (learned, learned)
            if length:
                self._pending[agent] = _Pending(length, done)
            if job.session is not None and not job.manual:
                self._predicted[job.session] = agent
                self._predicted.move_to_end(job.session)
                if len(self._predicted) > _MAX_SESSIONS:
                    self._predicted.popitem(last=False)
            self.recent.append({
                "agent": agent,
                "after": None if job.manual else job.agent,
                "session": job.session,
                "anchor_tokens": length,
                "source": anchor.source,
                "cached_tokens": cached,
                "prompt_tokens": prompt_tokens,
                "seconds": round(done - started, 4),
            })

    # -- reporting ---------------------------------------------------------------------

    def _expire_pending(self) -> None:
        now = self.clock()
        for agent in [a for a, p in self._pending.items() if now - p.at > self.useful_window]:
            del self._pending[agent]
            self.counts["unused"] += 1

    def stats(self) -> dict[str, Any]:
        """Counters: sent, skipped by reason, failed, dropped, useful/not_useful/unmeasured/unused, anchors, lint."""
        with self._lock:
            self._expire_pending()
            counts = dict(self.counts)
            out = {
                "sent": counts.get("sent", 0),
                "failed": counts.get("failed", 0),
                "dropped": counts.get("dropped", 0),
                "skipped": dict(self.skipped),
                "fallbacks": dict(self.fallbacks),
                "useful": counts.get("useful", 0),
                "not_useful": counts.get("not_useful", 0),
                "unmeasured": counts.get("unmeasured", 0),
                "unused": counts.get("unused", 0),
                "already_warm": counts.get("already_warm", 0),
                "predictions": {"right": counts.get("predicted_right", 0), "wrong": counts.get("predicted_wrong", 0)},
                "pending": len(self._pending),
                "queued": len(self._queue),
                "mode": "chat" if self._chat_mode else "tokens",
                "recent": [dict(r) for r in self.recent],
            }
        anchors = self.anchors.stats()
        out["anchors"] = anchors["agents"]
        out["unstable_prefixes"] = self.anchors.divergences()
        out["errors"] = {**anchors["errors"], **dict(self.errors.by_kind)}
        return out


def _blocks_to_warm(anchor: Anchor | None, view: ServerView, agent: str) -> int:
    """Blocks a warm-up of ``anchor`` prefills: its token length, or for a chat replay (length known
    only from the answer) the server's learned anchor length, at least one block."""
    if anchor is None:
        return 0
    if anchor.tokens:
        return anchor.blocks
    return max(1, view.anchors.get(agent, (0, 0))[1])


class _NoTokenizer(RuntimeError):
    """The server has no ``POST /tokenize``."""


def _observed(learner: Any, agent: str, target: str) -> bool:
    """Whether ``learner`` has actually seen ``agent -> target`` (True if it cannot tell)."""
    counts = getattr(learner, "counts", None)
    if counts is None:
        return True
    agents = list(learner.agents)
    if agent not in agents or target not in agents:
        return False
    return bool(counts()[agents.index(agent), agents.index(target)] > 0)


def _predictor_of(learner: Any) -> tuple[Any, Any]:
    """(predictor, learner) from a TransitionLearner, a Predictor, or None."""
    if learner is None:
        return None, None
    if hasattr(learner, "predict") and hasattr(learner, "learner"):
        return learner, learner.learner
    if hasattr(learner, "observe"):
        from agentkv.graph import Predictor

        return Predictor(learner), learner
    raise TypeError(f"learner must be a TransitionLearner or a Predictor, not {type(learner).__name__}")
