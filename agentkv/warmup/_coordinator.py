"""Background anchor warm-up: after each dispatch, re-prefill the anchor of the agent predicted next.

In the pause after an agent's turn (from its model call's answer, or the dispatch's end), predict the
next agent and, when :class:`~agentkv.warmup.WarmupPolicy` allows, send a ``max_tokens=1`` request
holding only that agent's anchor, tagged as a warm-up and without a session. Off the critical path:
hooks only queue jobs; one daemon worker decides and sends. See docs/frameworks.md ("Warm-up").
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import httpx

from agentkv._bounded import BoundedDict
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
)

from ._anchors import DEFAULT_BLOCK_SIZE, Anchor, AnchorBook
from ._config import WarmupConfig
from ._decision import JobState, TargetState, TokenBucket
from ._ledger import WarmupLedger
from ._prediction import Prediction, predict_from_stats, predict_from_view, predict_with_learner, predictor_of
from ._server import NoTokenizer, WarmupServer, blocks_to_warm, warmup_request
from ._urls import same_server, server_root

__all__ = ["CLOSE_TIMEOUT", "WarmupCoordinator"]

logger = logging.getLogger("agentkv.warmup")

CLOSE_TIMEOUT: Final = 1.0  # seconds close() waits for the job in progress
_MAX_SESSIONS: Final = 65_536


@dataclass(frozen=True, slots=True)
class _Job:
    agent: str  # the agent whose dispatch ended (predict from it), or the agent to warm (manual)
    session: str | None
    seq: int | None  # the session's dispatch count when the job was queued
    manual: bool = False
    queued: float = field(default_factory=time.monotonic)


class WarmupCoordinator:
    """Warms the predicted next agent's anchor in the pause after each dispatch (see module doc).

    ``base_url``: the vLLM server (``http://host:port``, with or without ``/v1``). ``config``: a
    :class:`WarmupConfig`; keyword ``settings`` (``max_per_second=5``, ...) override its fields.
    ``learner``: a client-side ``TransitionLearner`` or ``Predictor`` to predict with (fed from
    ``on_dispatch`` unless ``feed_learner=False``, e.g. when ``instrument(learner=...)`` already
    feeds it); without one, the server's learned ``transitions`` and ``predictability`` (``GET
    /agentkv/v1/stats``) are used. ``anchors``: an :class:`~agentkv.warmup.AnchorBook` to share.
    ``transport``: an httpx transport (tests). Behind a router, ``replicas=[url, ...]`` (a
    :class:`WarmupConfig` field) names the servers whose views are read. Use as a context manager or
    call ``start``/``close``.

    Invariants: hooks never block or raise into the application (errors are counted by kind and
    logged once); at most ``queue_size`` jobs wait, the oldest dropped and counted; ``close`` never
    waits longer than its ``timeout``.
    """

    def __init__(
        self,
        base_url: str,
        config: WarmupConfig | None = None,
        *,
        learner: Any = None,
        feed_learner: bool = True,
        anchors: AnchorBook | None = None,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        **settings: Any,
    ) -> None:
        config = dataclasses.replace(config or WarmupConfig(), **settings)
        replicas = (config.replicas,) if isinstance(config.replicas, str) else config.replicas
        self.config = config = dataclasses.replace(config, replicas=tuple(server_root(url) for url in replicas))
        self.base_url = server_root(base_url)
        self.policy = config.policy()
        self.clock = clock
        self.anchors = anchors if anchors is not None else AnchorBook(base_url=self.base_url, clock=clock)
        if config.block_size is not None:
            self.anchors.block_size = config.block_size
        self._block_size_known = config.block_size is not None
        self._predictor, self._learner = predictor_of(learner)
        self._feed = feed_learner and self._learner is not None
        self._observe = learner_listener(self._learner) if self._feed else None
        self._learner_lock = threading.Lock()  # the learner is fed on app threads and read by the worker
        self._bucket = TokenBucket(config.max_per_second, config.bucket_capacity, clock)
        self._transport = transport
        self.errors = ErrorCounter(logger)

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[_Job] = deque()
        self._queue_size = max(1, config.queue_size)
        self._busy_worker = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._unsubscribe: list[Callable[[], None]] = []
        self._lifecycle = threading.Lock()  # start() and close() one at a time (not _lock: the hooks take that)
        self._server: WarmupServer | None = None  # created by the worker

        self._seq: BoundedDict[str, int] = BoundedDict(_MAX_SESSIONS)  # session -> dispatches seen
        self._ended: BoundedDict[str, None] = BoundedDict(_MAX_SESSIONS)
        self._predicted: BoundedDict[str, str] = BoundedDict(_MAX_SESSIONS)  # session -> agent a warm-up bet on
        self._answered: BoundedDict[str, int] = BoundedDict(_MAX_SESSIONS)  # session -> dispatch whose call answered
        self._chat_mode = False
        self.counts: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self._ledger = WarmupLedger(self.counts, config.useful_window, clock)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> WarmupCoordinator:
        """Subscribe to the hooks and start the worker thread (idempotent)."""
        with self._lifecycle:
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
        with self._lifecycle:
            unsubscribe, self._unsubscribe = self._unsubscribe, []
            for undo in unsubscribe:
                undo()
            if unsubscribe:  # started: the book was attached
                self.anchors.detach()
            with self._lock:
                self._stop()
                thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _stop(self) -> None:
        """Close (under ``_lock``): the queued jobs are dropped (counted) and the worker wakes to exit."""
        self._closed = True
        self.counts["dropped"] += len(self._queue)
        self._queue.clear()
        self._wake.notify_all()

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
                self._enqueue(_Job(agent, session, seq, queued=self.clock()))
            self._ledger.real_call(agent, response.cached_tokens)

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
        clients: list[httpx.Client] = []
        try:
            try:
                timeout = httpx.Timeout(self.config.timeout, connect=min(2.0, self.config.timeout))
                for url in (self.base_url, *self.config.replicas):  # the server (or router), then those behind it
                    clients.append(httpx.Client(base_url=url, timeout=timeout, trust_env=False,
                                                transport=self._transport, headers=self.config.headers()))
                server = WarmupServer(clients[0], self.errors, self.clock, stats_interval=self.config.stats_interval,
                                      metrics_interval=self.config.metrics_interval, model=self.config.model,
                                      replicas=clients[1:])
            except Exception as exc:
                self.errors.record("warm-up client", exc)
                with self._lock:  # no job can run: what is queued and what comes later is dropped, never awaited
                    self._stop()
                return
            while True:
                with self._wake:
                    while not self._queue and not self._closed:
                        self._wake.wait()
                    if self._closed:
                        return
                    job = self._queue.popleft()
                    self._busy_worker = True
                try:
                    self._handle(job, server)
                except Exception as exc:  # a bug here must not kill the worker
                    self.errors.record("warm-up job", exc)
                finally:
                    with self._wake:
                        self._busy_worker = False
                        self._wake.notify_all()
        finally:
            for client in clients:
                try:
                    client.close()
                except Exception:
                    pass

    def _skip(self, reason: str) -> None:
        with self._lock:
            self.skipped[reason] += 1

    def _handle(self, job: _Job, server: WarmupServer) -> None:
        with self._lock:
            ended = job.session is not None and job.session in self._ended
            late = job.session is not None and self._seq.get(job.session, 0) != job.seq
        if job.manual or ended or late:
            target: str | None = job.agent if job.manual else None
            state = JobState(target, session_ended=ended, late=late, manual=job.manual)
        else:
            prediction = self._predict(job.agent, server)
            target = None if prediction is None else prediction[0]
            state = JobState(None) if prediction is None else JobState(*prediction)
        anchor: Anchor | None = None

        def target_state() -> TargetState:
            nonlocal anchor
            assert target is not None
            view = server.view()
            if view.resident(target):  # its learned anchor is cached: nothing to resolve (most jobs)
                return TargetState(view.anchors[target][1], True)
            self._ensure_block_size(server)
            anchor = self._anchor(target, server)
            known = anchor.blocks if anchor is not None and anchor.tokens else None
            return TargetState(blocks_to_warm(anchor, view, target), view.resident(target, known), view.waiting,
                               view.running, view.free_blocks, view.survival)

        late = False

        def take() -> bool:
            # the pause may have ended (or the coordinator closed) while we were deciding: then no
            # token is spent
            nonlocal late
            with self._lock:
                late = self._closed or (job.session is not None and (
                    job.session in self._ended or self._seq.get(job.session, 0) != job.seq))
                return not late and self._bucket.take()

        decision = self.policy.decide(state, target_state, take)
        with self._lock:
            self.fallbacks.update(decision.fallbacks)
        if late:
            self._skip("late")
            return
        if not decision.warm:
            self._skip(decision.reason)
            return
        assert target is not None and anchor is not None
        self._send(target, anchor, job, server)

    # -- prediction --------------------------------------------------------------------

    def _predict(self, agent: str, server: WarmupServer) -> Prediction | None:
        if self._predictor is not None:
            try:
                with self._learner_lock:
                    return predict_with_learner(self._predictor, self._learner, agent)
            except Exception as exc:
                self.errors.record("client-side prediction", exc)
                return None
        view = server.view()
        if view.predictability is not None:  # an agentkv server's view tells its prediction
            return predict_from_view(view, agent)
        stats = server.stats()
        return None if stats is None else predict_from_stats(stats, agent)

    def _ensure_block_size(self, server: WarmupServer) -> None:
        if self._block_size_known:
            return
        size: Any = server.view().block_size
        if size is None:
            stats = server.stats()
            if stats is None:
                return  # unknown for now (the default applies); asked again after stats_interval
            size = stats.get("block_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            self.anchors.block_size = size
        else:
            self.anchors.block_size = self.anchors.block_size or DEFAULT_BLOCK_SIZE
        self._block_size_known = True

    # -- anchors -----------------------------------------------------------------------

    def _anchor(self, agent: str, server: WarmupServer) -> Anchor | None:
        if not self._chat_mode:
            try:
                return self.anchors.resolve(agent, server.tokenize)
            except NoTokenizer as exc:
                note = "the server has no /tokenize: warm-ups replay messages[0] + tools"
                self.errors.record("POST /tokenize", exc, note)
                self._chat_mode = True
            except Exception as exc:
                self.errors.record("POST /tokenize", exc)
                return None
        return self.anchors.resolve(agent, None)

    # -- sending -----------------------------------------------------------------------

    def _send(self, agent: str, anchor: Anchor, job: _Job, server: WarmupServer) -> None:
        path, body, headers = warmup_request(agent, anchor, self.config.model, job.session)
        started = self.clock()
        try:
            prompt_tokens, cached = server.post(path, body, headers)
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
            self.counts["prompt_tokens"] += prompt_tokens or 0
            self.counts["cached_tokens"] += cached or 0
            # vLLM recomputes the last block of a fully cached prompt: it reports length - block_size
            if cached and length and cached >= length - anchor.block_size:
                self.counts["already_warm"] += 1
            server.mark_resident(agent, length // anchor.block_size if anchor.block_size else 0)
            if job.session is not None and not job.manual:
                self._predicted[job.session] = agent
            self._ledger.sent(agent, length, done, {
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

    def stats(self) -> dict[str, Any]:
        """Counters: sent, skipped by reason, failed, dropped, useful/not_useful/unmeasured/unused, anchors, lint;
        ``tokens``: the prompt and cached tokens of the warm-ups sent, as their answers' usage told
        (what they added to the server's prefix-cache counters)."""
        with self._lock:
            self._ledger.expire()
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
                "tokens": {"prompt": counts.get("prompt_tokens", 0), "cached": counts.get("cached_tokens", 0)},
                "predictions": {"right": counts.get("predicted_right", 0), "wrong": counts.get("predicted_wrong", 0)},
                "pending": len(self._ledger.pending),
                "queued": len(self._queue),
                "mode": "chat" if self._chat_mode else "tokens",
                "recent": [dict(r) for r in self._ledger.recent],
            }
        anchors = self.anchors.stats()
        out["anchors"] = anchors["agents"]
        out["unstable_prefixes"] = self.anchors.divergences()
        out["errors"] = {**anchors["errors"], **dict(self.errors.by_kind)}
        return out
