"""agentkv's state inside one vLLM EngineCore: learner, facts, block map, scored queue."""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import numpy as np
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request

from agentkv.graph import (
    UNCACHED,
    GapTable,
    Group,
    History,
    PassageBuilder,
    Predictor,
    ReuseTable,
    first_passage_steps,
    padded_passage,
    passage_size,
    recency_scorer,
    score_reuse,
)
from agentkv.protocol import AgentTag, MalformedCounter

from ._config import RuntimeConfig
from ._free_queue import ScoredFreeBlockQueue
from ._recognize import Recognizer
from ._rows import OTHER, tracked
from ._runtime_control import PEER_WEIGHT_FLOOR, STATS_MAX_AGE, RuntimeControl
from ._tagging import RequestTagging
from ._trace import RequestTrace
from ._tracker import CONVERSATION_PREFIX, AnchorLengths, BlockTracker
from ._warmups import WarmupLedger

__all__ = ["OTHER", "PEER_WEIGHT_FLOOR", "STATS_MAX_AGE", "AgentKVRuntime", "RuntimeConfig"]

logger = logging.getLogger("agentkv.server")

_RETIRED = -math.inf
# Scores depend on how long sessions have been idle: re-evaluate at least this often (clock s).
_RESCORE_INTERVAL = 0.25
# The chain's first-passage table and the gap distributions are rebuilt at least this often (s);
# the table of a chain of n > 64 agents n / 64 times as long: its cost grows with it, its worth does not.
_REBUILD_INTERVAL = 2.0
# An evaluation re-evaluates every live session at least this often (clock s, and every 4th
# evaluation); the others only the sessions that had a request, an answer or an end since (the
# rest keep their rows: idle a little longer).
_FULL_INTERVAL = 0.35
_FULL_EVERY = 4
# Within ``refresh_interval`` the model is still re-evaluated once it is older than this share of the
# learned median gap between a session's requests: when sessions call faster than the interval (a
# fast engine, short answers, tool loops), a model a few requests old scores agents that moved on.
_STALENESS = 0.25


def _session_of(group: Hashable) -> str | None:
    """The queue's partition of a group: a history group's session (its scores move together; the
    conversations of calls outside any session share one: their agents' calls move them all)."""
    session: str | None = group.session if type(group) is History else None  # type: ignore[attr-defined]
    return CONVERSATION_PREFIX if session and session.startswith(CONVERSATION_PREFIX) else session


class AgentKVRuntime(RequestTagging, RuntimeControl):
    """Agent-aware eviction for one KVCacheManager.

    Invariants: every scheduler entry point and every control request runs under
    ``lock``; the queue's group scores are those of ``table`` (or all equal while the
    policy is ``lru``) whenever the scheduler allocates, because ``refresh`` runs at the
    start of every scheduling step.
    """

    def __init__(self, config: RuntimeConfig | None = None, *, clock: Callable[[], float] = time.monotonic,
                 background: bool = False) -> None:
        """``clock`` (seconds) drives recency and session expiry; replays pass simulated time.
        ``background``: rebuild the chain's first-passage table on a thread (the server: no step
        waits for it); off, in the step that finds it stale (replays and tests: deterministic)."""
        self.config = config or RuntimeConfig()
        self.clock = clock
        self.epoch = uuid.uuid4().hex  # a restarted replica's exports replace its old ones
        self._restore()  # the learner, the facts and the session timing
        self.learner.clock = clock
        self.predictor = Predictor(self.learner, self.facts)
        self.tracker = BlockTracker(untag_sessionless=not self.config.recognize)
        self.anchors = AnchorLengths()
        self.warmups = WarmupLedger(clock)
        self.trace = RequestTrace(self.config.trace_path) if self.config.trace_path else None
        self.pool: BlockPool | None = None
        self.malformed = MalformedCounter(logger)
        self.lock = threading.RLock()
        self.queues: list[ScoredFreeBlockQueue[Hashable]] = []
        self.table: ReuseTable | None = None
        self.block_size = 0
        self._residency_group = 0  # the KV-cache group anchor residency is read in
        self.queries: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        self.tagged_requests = 0  # tagged or recognized
        self.answers: Counter[str] = Counter()  # answers told by the middleware: tool_call / no_tool_call
        self.recognizer = Recognizer() if self.config.recognize else None
        self._tags: OrderedDict[str, AgentTag | None] = OrderedDict()
        self._finished_tags: OrderedDict[str, AgentTag | None] = OrderedDict()
        self._answer_sessions: OrderedDict[str, str] = OrderedDict()
        self._quoting: OrderedDict[str, str] = OrderedDict()
        self.queue_lengths: Callable[[], tuple[int, int]] | None = None  # set by the scheduler
        self._scored_version: tuple[int, int, int] | None = None
        self._scored_at = -math.inf
        self._scored_policy: tuple[str, int] | None = None
        self._scored_table: ReuseTable | None = None  # the table whose scores the queues hold
        self._passage: Any = None
        self._passages = PassageBuilder(background=background)
        self._gaps: GapTable | None = None
        self._built: dict[str, tuple[object, int, float]] = {}
        self._partial = 0  # evaluations since the last full one
        self._full_at = -math.inf  # when the last full one ran
        self._hazard: np.ndarray | None = None  # the end hazard of the last evaluation
        # log(reuses/s) of a group x the time resolution (s); all equal under LRU, -inf once retired
        self._scorer: Callable[[Group], float] = recency_scorer()
        self._stats_cache: tuple[float, tuple[int, int], dict[str, Any]] | None = None  # (built at, changes, document)

    # -- wiring into vLLM ----------------------------------------------------------

    def install(self, manager: KVCacheManager) -> None:
        """Swap in the scored free queue and observe caching and hits (no vLLM code changes)."""
        pool = self.pool = manager.block_pool
        self.block_size = pool.hash_block_size
        if self.config.enabled:  # disabled: vLLM's own queue stays, so eviction is exactly LRU
            queue: ScoredFreeBlockQueue[Hashable] = ScoredFreeBlockQueue.replace(
                pool, self.tracker.group_of, clock=self.clock, decay=self.config.decay, partition_of=_session_of
            )
            queue.on_evict = self._on_evict
            self.queues.append(queue)
        else:
            self._count_lru_evictions(pool.free_block_queue)

        # A hybrid model's KV-cache group may have blocks a multiple of the hash block (which
        # anchors are measured in): an anchor of n hash blocks fills n // k of that group's blocks.
        specs = [group.kv_cache_spec for group in manager.kv_cache_config.kv_cache_groups]
        group_block_sizes = [spec.block_size for spec in specs]
        # An anchor is resident when its leading blocks are cached in a full-attention group (a
        # sliding window's group caches only the tail of a prefix, a Mamba group one state).
        self._residency_group = next((i for i, spec in enumerate(specs) if isinstance(spec, FullAttentionSpec)
                                      and spec.block_size == self.block_size), 0)
        cache_full_blocks = pool.cache_full_blocks

        @functools.wraps(cache_full_blocks)
        def cache_full_blocks_observed(request: Request, blocks: list[KVCacheBlock], num_cached_blocks: int,
                                       num_full_blocks: int, *args: Any, **kwargs: Any) -> None:
            cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
            tag = self.tag_of(request)
            block_size = kwargs.get("block_size", args[0] if args else self.block_size)
            self.tracker.cached(blocks, num_cached_blocks, num_full_blocks, tag,
                                0 if tag is None else self._anchor_blocks(tag.agent, block_size),
                                self._conversation(request, tag))

        get_computed_blocks = manager.get_computed_blocks

        @functools.wraps(get_computed_blocks)
        def get_computed_blocks_observed(request: Request, *args: Any, **kwargs: Any) -> Any:
            result = get_computed_blocks(request, *args, **kwargs)
            tag = self.tag_of(request)
            if tag is not None and result[1] > 0:
                for blocks, block_size in zip(result[0].blocks, group_block_sizes, strict=False):
                    self.tracker.hit(blocks, tag, self._anchor_blocks(tag.agent, block_size),
                                     self._conversation(request, tag))
            return result

        record_prefix_cache_stats = manager.record_prefix_cache_stats

        @functools.wraps(record_prefix_cache_stats)
        def record_prefix_cache_stats_observed(request: Request, num_hits: int) -> None:
            record_prefix_cache_stats(request, num_hits)
            tag = self.tag_of(request)
            # A preempted request admitted again is no new call (vLLM counts it apart too): it would
            # count its tokens twice, hit its own freed blocks, and send or use a warm-up twice.
            readmitted = request.num_preemptions > 0
            # warm-ups are agentkv's own traffic: the agent's hit rate is its real calls'
            if tag is not None and not tag.warmup and not readmitted and manager.prefix_cache_lookup_enabled(request):
                self._count_traffic(tag.agent, request.num_tokens, num_hits)
            if tag is not None and not readmitted:
                self._note_warmup(request, tag, num_hits)
            if self.trace is not None:
                self.trace.admitted(request.request_id, tag, request.num_tokens, num_hits, request.block_hashes,
                                    self.block_size, pool.num_gpu_blocks - 1)  # block 0 is vLLM's null block

        def finish_observed(release: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(release)
            def observed(request: Request, *args: Any, **kwargs: Any) -> Any:
                if request.is_finished():  # a preempted request is freed too, and finishes later
                    self._finished(request)
                return release(request, *args, **kwargs)

            return observed

        # A prefix-cache reset (``/reset_prefix_cache``) or a KV connector's invalidation drops the
        # hashes of blocks that may be waiting in the free queue: they are worthless from then on.
        reset_prefix_cache = pool.reset_prefix_cache

        @functools.wraps(reset_prefix_cache)
        def reset_prefix_cache_observed(*args: Any, **kwargs: Any) -> bool:
            with self.lock:  # the engine calls it outside the scheduler's locked entry points
                done = reset_prefix_cache(*args, **kwargs)
                if done:
                    self._uncached(pool.blocks)
                return done  # type: ignore[no-any-return]

        pool.reset_prefix_cache = reset_prefix_cache_observed  # type: ignore[method-assign]
        if hasattr(pool, "evict_blocks"):  # a KV connector's failed loads
            evict_blocks = pool.evict_blocks

            @functools.wraps(evict_blocks)
            def evict_blocks_observed(block_ids: set[int], *args: Any, **kwargs: Any) -> None:
                with self.lock:
                    evict_blocks(block_ids, *args, **kwargs)
                    self._uncached([pool.blocks[block_id] for block_id in block_ids])

            pool.evict_blocks = evict_blocks_observed  # type: ignore[method-assign]
        manager.free = finish_observed(manager.free)  # type: ignore[method-assign]
        # With a KV connector that may still write a finished request's blocks, the scheduler
        # takes them with ``pop_blocks_for_free`` and returns them to the pool later, never
        # through ``free``: the request has finished all the same.
        if hasattr(manager, "pop_blocks_for_free"):
            manager.pop_blocks_for_free = finish_observed(manager.pop_blocks_for_free)  # type: ignore[method-assign]
        pool.cache_full_blocks = cache_full_blocks_observed  # type: ignore[method-assign]
        manager.get_computed_blocks = get_computed_blocks_observed  # type: ignore[method-assign]
        manager.record_prefix_cache_stats = record_prefix_cache_stats_observed  # type: ignore[method-assign]

    def _anchor_blocks(self, agent: str, block_size: int) -> int:
        """How many of a KV-cache group's blocks (of ``block_size`` tokens) ``agent``'s anchor fills."""
        return self.anchors.length(agent) // max(1, block_size // self.block_size)

    def _conversation(self, request: Request, tag: AgentTag | None) -> str | None:
        """Without recognition, a call outside any session caches beyond its anchor a conversation of its own."""
        if self.config.recognize or tag is None or tag.session is not None or tag.warmup:
            return None
        return CONVERSATION_PREFIX + request.request_id

    def _uncached(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Blocks that lost their hash while not in use: the free ones are recycled first."""
        dropped = [block for block in blocks if block.block_hash is None and not block.is_null]
        for queue in self.queues:
            queue.regroup(dropped, UNCACHED)

    def _finished(self, request: Request) -> None:
        """A request finished: it no longer keeps its session busy; a recognized one's answer is indexed.
        Its tag leaves the live requests' cache (a running request's tag pushed out of it by 65,536
        later ones would leave its session busy for good)."""
        tag = self._finish_tag(request.request_id)
        if tag is not None and tag.session is not None and not tag.warmup:
            self.timing.finished(tag.session)
        session = self._quoting.pop(request.request_id, None)
        if session is not None and self.recognizer is not None and request.num_output_tokens:
            self.recognizer.observe_answer(session, request.output_token_ids)

    # -- scheduler events ----------------------------------------------------------

    def on_add_request(self, request: Request) -> None:
        if request.request_id in self._tags:
            # vLLM adds a streaming-input request again with each input chunk: one call, counted once
            return
        tag = self.tag_of(request)
        if tag is None:
            return
        self.tagged_requests += 1
        self.anchors.observe(tag.agent, tag.session, request.block_hashes, self._conversation(request, tag))
        step = tag.step
        if tag.session is not None and not tag.warmup:  # a warm-up starts and continues no session
            if step is None:  # a client that sends no step: one agent's consecutive calls are one dispatch
                step = self.timing.implied_step(tag.session, tag.agent)
            self.timing.observe(tag.session, tag.agent, self.clock(), step)
            # the session's history is valued by its new agent now, not at the next refresh, which
            # may come after this call's allocation has evicted by the old values
            for queue in self.queues:
                queue.rescore_partition(tag.session)
        elif not tag.warmup:  # no session sent, none recognized: a session of one call
            self.timing.call_outside_session(self.clock())
        if tag.session is not None and not tag.warmup and self.facts.is_ended(tag.session):
            self.facts.start_session(tag.session)  # a tagged call (not a warm-up) revives an ended session id
        self.learner.observe(tag.agent, tag.session, tag.parent, step=step, warmup=tag.warmup)

    def refresh(self) -> None:
        """Re-evaluate the next-use model and re-score the queue's groups when it may have moved.

        Runs at the start of every scheduler step; does work only when the learner, the facts or
        the session timing changed, or ``_RESCORE_INTERVAL`` passed (values depend on how long
        sessions have been idle), and at most once per ``refresh_interval`` (or ``_STALENESS`` of
        the learned median gap, when sessions call faster than that) unless a fact changed. The
        chain's first-passage table and the gap distributions are recomputed only when enough new
        evidence arrived (``_stale``). Sessions the timing model
        finds abandoned leave the timing (their history drops to the floor). Between full
        evaluations (``_FULL_INTERVAL``, ``_FULL_EVERY``) only the sessions touched since the last
        one are re-evaluated, and the queues re-score only the history groups of the sessions
        whose scores moved or that ended or came back (the anchors and untagged blocks always).
        """
        if not self.config.enabled:
            return
        now = self.clock()
        version = (self.learner.version, self.facts.version, self.timing.version)
        waited = now - self._scored_at
        if version == self._scored_version and waited < _RESCORE_INTERVAL:
            return
        facts_changed = self._scored_version is None or version[1] != self._scored_version[1]
        if waited < self._refresh_interval() and not facts_changed:
            return  # a fact (an ended session) applies at once; learned values can wait a step or two
        self.table = table = self._evaluate(now)
        for session in table.dead:
            # only the timing forgets it (its history drops to the floor, its length is learned, and
            # taken back if it returns); the learner keeps its lineage: a session that was merely
            # slow must not count an end
            self.timing.expire(session)
        self._scored_version = (self.learner.version, self.facts.version, self.timing.version)
        self._scored_at = now
        policy = self.policy
        # a session event changes only whether its session is retired: the same policy on the same
        # declared graph re-scores the sessions whose rates moved and those that ended (or came back)
        scored = (policy, self.facts.graph_version)
        ended = self.facts.take_ended_changes()
        same = self._scored_policy == scored and ended is not None
        if policy == "lru" and same and not ended:
            return  # every group still scores 0.0 (or -inf if retired): nothing to redo
        changed: set[str] | None = ended if same else None
        if policy == "lru":
            self._scorer = recency_scorer(self.facts.ended.keys().__contains__, _RETIRED)
        else:
            if changed is not None:
                moved = table.changed_sessions(self._scored_table) if self._scored_table is not None else None
                aging = set() if self.config.recognize else {CONVERSATION_PREFIX}  # conversations age with each call
                changed = None if moved is None else moved | changed | aging
            # a live view's membership test, in C: it runs for every history group re-scored
            self._scorer = table.scorer(retired=self.facts.ended.keys().__contains__, retired_score=_RETIRED,
                                        current=self.timing.agent_of, untagged_under_anchors=not self.config.recognize,
                                        in_resolutions=True,  # AGENTKV_DECAY is per resolution
                                        continuation=None if self.config.recognize else self.anchors.continuation)
        self._scored_policy = scored
        self._scored_table = table if policy != "lru" else None
        for queue in self.queues:
            queue.set_group_scores(self._scorer, changed_partitions=changed)

    def _refresh_interval(self) -> float:
        """``refresh_interval``, or ``_STALENESS`` of the learned median gap when that is shorter."""
        interval = self.config.refresh_interval
        if self._gaps is not None and self.timing.gaps:
            interval = min(interval, _STALENESS * self._gaps.median_gap)
        return interval

    def _evaluate(self, now: float) -> ReuseTable:
        chain = self.predictor.chain()
        config = self.config.reuse
        dispatches = self.learner.dispatches
        touched = self.timing.take_touched()
        hazard = self.timing.end_hazards()
        # sessions untouched since the last evaluation keep their rows, except at every
        # _FULL_EVERY-th evaluation and whenever an input shared by all sessions was rebuilt
        partial = self.table is not None and touched is not None and self._partial + 1 < _FULL_EVERY \
            and now - self._full_at < _FULL_INTERVAL and self._hazard is not None \
            and np.array_equal(hazard, self._hazard)
        steps, tolerance = config.steps or config.max_steps, 0.0 if config.steps else config.step_tolerance
        agents = len(chain.agents)
        # keyed on declarations alone: session events leave the chain as it was; checked (and so
        # recorded) on the first build too, or the evaluation after it would build again
        size = passage_size(self._built["passage"][0][0] if "passage" in self._built else None, agents)
        every = _REBUILD_INTERVAL * max(1.0, size / PassageBuilder.MIN_AGENTS)
        stale = self._stale("passage", (size, self.facts.graph_version), dispatches, now, every=every)
        if self._passage is None or stale:
            if self._passage is None or self._passage.shape[1] > agents:
                self._passage = first_passage_steps(chain.matrix, steps, tolerance=tolerance)  # none to read
                partial = False
            else:  # the current table serves until the new one is built
                self._passages.submit(chain.matrix, steps, tolerance=tolerance)
        built = self._passages.take()
        if built is not None and built.shape[1] <= agents:
            self._passage = built
            partial = False
        if self._passage.shape[1] < agents:  # agents join the chain at its end: pad for them meanwhile
            self._passage = padded_passage(self._passage, agents)
            partial = False
        if self._gaps is None or self._stale("gaps", self.timing.gap_agents, self.timing.gaps, now):
            self._gaps = self.timing.table()
            partial = False
        self._partial = self._partial + 1 if partial else 0
        if not partial:
            self._full_at = now
        self._hazard = hazard
        sessions = self.timing.live().without(self.facts.ended.keys())
        return score_reuse(
            chain,
            self._gaps,
            sessions,
            now=now,
            session_start_rate=self.timing.session_rate(now), pace=self.timing.pace(),
            continuation={a: self.timing.continuation(a) for a in chain.agents},
            interposed=self.learner.interposed_rate(),
            predictability=self.learner.predictability(),
            gap_count=self.timing.gaps,
            config=config,
            session_count=self.timing.starts,
            passage=self._passage,
            end_hazard=hazard,
            reuse=(self.table, touched) if partial and self.table is not None and touched is not None else None,
        )

    def _stale(self, name: str, shape: object, evidence: int, now: float, *, every: float = _REBUILD_INTERVAL) -> bool:
        """True when a cached input was built on another shape, on 5% less evidence, or ``every`` s ago.

        The counts move little per dispatch: recomputing on every one would cost most of a
        scheduler step at tens of agents, for no change in the eviction order.
        """
        built = self._built.get(name)
        if built is not None and built[0] == shape and evidence - built[1] < max(1, built[1] // 20) \
                and now - built[2] < every:
            return False
        self._built[name] = (shape, evidence, now)
        return True

    @property
    def policy(self) -> str:
        if not self.config.enabled or self.tagged_requests == 0 or self.table is None or not self.table.predictable:
            return "lru"
        return "survival"

    def _on_evict(self, popped: Sequence[KVCacheBlock], runs: Iterable[tuple[object, int]]) -> None:
        """Blocks the free queue handed out, in runs of (group, count): those still holding a hash are
        being evicted."""
        self.tracker.evicted(popped, runs, self.facts.is_ended)
        if self.warmups.holding:
            for block in popped:
                if block.block_hash is not None:
                    self.warmups.evicted(get_block_hash(block.block_hash))

    # -- warm-ups and anchor residency -------------------------------------------------

    def _note_warmup(self, request: Request, tag: AgentTag, num_hits: int) -> None:
        """Feed the warm-up ledger with an admitted request (a warm-up, or an agent's real call)."""
        size = self.block_size or 1
        if tag.warmup:
            full = request.num_tokens // size
            self.warmups.warmed(tag.agent, request.block_hashes[:full], num_hits // size,
                                min(full, (request.num_tokens - 1) // size))
        else:
            self.warmups.used(tag.agent, request.block_hashes, num_hits // size)

    def anchor_residency(self, agent: str) -> tuple[int, int]:
        """(leading blocks of ``agent``'s learned anchor cached now, learned anchor length in blocks).

        A prefix hit stops at the first missing block, so only the cached *leading* blocks count.
        While no anchor length is learned (0), the leading blocks counted are those of the agent's
        latest session's first call, which begins with the anchor: a caller that knows the
        anchor's length (a warm-up coordinator) can still tell whether it is cached.

        Found by bisection, O(log n) lookups under the engine's lock for an n-block prefix (up to
        1,024 per agent, 64 agents per view): a block is cached only while its parent is (vLLM
        frees a chain children first and a hit touches the parents too; the scored queue evicts a
        chain children first), so the cached blocks of the prefix are its leading ones.
        """
        hashes = self.anchors.anchor_hashes(agent)
        learned = len(hashes) if self.anchors.length(agent) else 0
        pool = self.pool
        if pool is None:
            return 0, learned
        group = [self._residency_group]
        resident, missing = 0, len(hashes)  # blocks [0, resident) are cached; block `missing` (if any) is not
        while resident < missing:
            middle = (resident + missing) // 2
            if pool.get_cached_block(hashes[middle], group) is None:  # type: ignore[arg-type]
                missing = middle
            else:
                resident = middle + 1
        return resident, learned

    def _count_lru_evictions(self, queue: Any) -> None:
        """Disabled mode: vLLM's own free queue keeps its exact LRU order; the cached blocks it
        hands out for reuse (which the pool evicts right away) are counted as the scored queue
        counts them."""
        popleft, popleft_n = queue.popleft, queue.popleft_n

        def report(blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
            self._on_evict(blocks, ((None, len(blocks)),))
            return blocks

        queue.popleft = lambda: report([popleft()])[0]
        queue.popleft_n = lambda n: report(popleft_n(n))

    def _tracked(self, counter: Counter[str], agent: str) -> str:
        return tracked(counter, agent, self.config.tracked_agents)

    def _count_traffic(self, agent: str, tokens: int, hits: int) -> None:
        key = self._tracked(self.queries, agent)
        self.queries[key] += tokens
        self.hits[key] += hits
