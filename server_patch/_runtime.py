"""agentkv's state inside one vLLM EngineCore: learner, facts, block map, scored queue."""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash
from vllm.v1.request import Request

from agentkv.graph import (
    FactsFull,
    GapTable,
    GraphFacts,
    Group,
    History,
    LearnerConfig,
    PeerExport,
    Predictor,
    ReuseConfig,
    ReuseTable,
    SessionTiming,
    TransitionLearner,
    first_passage_steps,
    restore_or_fresh,
    save_snapshot,
    score_reuse,
)
from agentkv.protocol import PROTOCOL_VERSION, AgentTag, MalformedCounter, ProtocolError, parse_xargs, validate_events

from ._free_queue import DEFAULT_DECAY, ScoredFreeBlockQueue
from ._recognize import Recognizer
from ._rows import OTHER, agent_rows, tracked
from ._tracker import AnchorLengths, BlockTracker
from ._warmups import WarmupLedger

__all__ = ["OTHER", "AgentKVRuntime", "RuntimeConfig"]

logger = logging.getLogger("agentkv.server")

_RETIRED = -math.inf
_UNPARSED = object()  # tag_of's cache miss (a cached None means: parsed, untagged)
PEER_WEIGHT_FLOOR = 64.0  # the local evidence a fresh replica is credited with when bounding peers
_MAX_CACHED_TAGS = 65_536
# Scores depend on how long sessions have been idle: re-evaluate at least this often (clock s).
_RESCORE_INTERVAL = 0.25
# The chain's first-passage table and the gap distributions are rebuilt at least this often (s).
_REBUILD_INTERVAL = 2.0
# A stats document is served again for this long (wall seconds): the engine builds at most a few
# per second however often clients poll stats or /metrics, so polling cannot stall scheduling.
STATS_MAX_AGE = 0.25


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number") from exc


@dataclass(frozen=True)
class RuntimeConfig:
    """Server-side settings, read from AGENTKV_* environment variables (docs/server.md)."""

    enabled: bool = True
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    learner: LearnerConfig = field(default_factory=lambda: LearnerConfig(half_life=5000, session_ttl=600))
    decay: float = DEFAULT_DECAY
    recognize: bool = True  # recognize agents and sessions of untagged requests
    refresh_interval: float = 0.0  # least clock time between two evaluations of the next-use model
    snapshot_path: str | None = None
    snapshot_interval: float = 30.0  # seconds between periodic saves (0: only at shutdown)
    listed_agents: int = 64  # stats and /metrics list the top agents by traffic, the rest as OTHER
    tracked_agents: int = 1024  # per-agent counters kept; later agents are counted as OTHER
    max_peers: int = 32
    peer_weight: float = 4.0  # a peer's counts weigh at most this multiple of the local evidence
    replica: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RuntimeConfig:
        defaults = cls()
        horizon = env.get("AGENTKV_HORIZON")
        reuse = ReuseConfig(
            r_min=_env_float(env, "AGENTKV_R_MIN", defaults.reuse.r_min),
            steps=None if not horizon else int(_env_float(env, "AGENTKV_HORIZON", 0)),
        )
        return cls(
            enabled=env.get("AGENTKV_ENABLED", "1") != "0",
            reuse=reuse,
            decay=_env_float(env, "AGENTKV_DECAY", defaults.decay),
            recognize=env.get("AGENTKV_RECOGNIZE", "1") not in ("0", "off"),
            refresh_interval=_env_float(env, "AGENTKV_REFRESH_INTERVAL", defaults.refresh_interval),
            snapshot_path=env.get("AGENTKV_SNAPSHOT") or None,
            snapshot_interval=_env_float(env, "AGENTKV_SNAPSHOT_INTERVAL", defaults.snapshot_interval),
            listed_agents=int(_env_float(env, "AGENTKV_STATS_TOP_AGENTS", defaults.listed_agents)),
            max_peers=int(_env_float(env, "AGENTKV_MAX_PEERS", defaults.max_peers)),
            peer_weight=_env_float(env, "AGENTKV_PEER_WEIGHT", defaults.peer_weight),
            replica=env.get("AGENTKV_REPLICA") or defaults.replica,
        )


class AgentKVRuntime:
    """Agent-aware eviction for one KVCacheManager.

    Invariants: every scheduler entry point and every control request runs under
    ``lock``; the queue's group scores are those of ``table`` (or all equal while the
    policy is ``lru``) whenever the scheduler allocates, because ``refresh`` runs at the
    start of every scheduling step.
    """

    def __init__(self, config: RuntimeConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` (seconds) drives recency and session expiry; replays pass simulated time."""
        self.config = config or RuntimeConfig()
        self.clock = clock
        self.epoch = uuid.uuid4().hex  # a restarted replica's exports replace its old ones
        if self.config.snapshot_path:
            self.learner, self.facts = restore_or_fresh(self.config.snapshot_path, self.config.learner)
        else:
            self.learner, self.facts = TransitionLearner(self.config.learner), GraphFacts()
        self.learner.clock = clock
        self.learner.peers.max_replicas = self.config.max_peers
        self.predictor = Predictor(self.learner, self.facts)
        self.timing = SessionTiming()
        self.tracker = BlockTracker()
        self.anchors = AnchorLengths()
        self.warmups = WarmupLedger(clock)
        self.pool: BlockPool | None = None
        self.malformed = MalformedCounter(logger)
        self.lock = threading.RLock()
        self.queues: list[ScoredFreeBlockQueue[Hashable]] = []
        self.table: ReuseTable | None = None
        self.block_size = 0
        self.queries: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        self.tagged_requests = 0  # tagged or recognized
        self.recognizer = Recognizer() if self.config.recognize else None
        self._tags: OrderedDict[str, AgentTag | None] = OrderedDict()
        self._saved_version: tuple[int, int] | None = None
        self._scored_version: tuple[int, int, int] | None = None
        self._scored_at = -math.inf
        self._scored_policy: tuple[str, int] | None = None
        self._passage: Any = None
        self._gaps: GapTable | None = None
        self._built: dict[str, tuple[object, int, float]] = {}
        self._scorer: Callable[[Group], float] = lambda group: 0.0
        self._stats_cache: tuple[float, int, dict[str, Any]] | None = None  # (built at, facts version, document)

    # -- wiring into vLLM ----------------------------------------------------------

    def install(self, manager: KVCacheManager) -> None:
        """Swap in the scored free queue and observe caching and hits (no vLLM code changes)."""
        pool = self.pool = manager.block_pool
        self.block_size = pool.hash_block_size
        if self.config.enabled:  # disabled: vLLM's own queue stays, so eviction is exactly LRU
            queue: ScoredFreeBlockQueue[Hashable] = ScoredFreeBlockQueue.replace(
                pool, self.tracker.group_of, clock=self.clock, decay=self.config.decay
            )
            queue.on_evict = self._on_evict
            self.queues.append(queue)
        else:
            self._count_lru_evictions(pool.free_block_queue)

        cache_full_blocks = pool.cache_full_blocks

        @functools.wraps(cache_full_blocks)
        def cache_full_blocks_observed(request: Request, blocks: list[KVCacheBlock], num_cached_blocks: int,
                                       num_full_blocks: int, *args: Any, **kwargs: Any) -> None:
            cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
            tag = self.tag_of(request)
            self.tracker.cached(blocks, num_cached_blocks, num_full_blocks, tag,
                                0 if tag is None else self.anchors.length(tag.agent))

        get_computed_blocks = manager.get_computed_blocks

        @functools.wraps(get_computed_blocks)
        def get_computed_blocks_observed(request: Request, *args: Any, **kwargs: Any) -> Any:
            result = get_computed_blocks(request, *args, **kwargs)
            tag = self.tag_of(request)
            if tag is not None and result[1] > 0:
                anchor_blocks = self.anchors.length(tag.agent)
                for group in result[0].blocks:
                    self.tracker.hit(group, tag, anchor_blocks)
            return result

        record_prefix_cache_stats = manager.record_prefix_cache_stats

        @functools.wraps(record_prefix_cache_stats)
        def record_prefix_cache_stats_observed(request: Request, num_hits: int) -> None:
            record_prefix_cache_stats(request, num_hits)
            tag = self.tag_of(request)
            # warm-ups are agentkv's own traffic: the agent's hit rate is its real calls'
            if tag is not None and not tag.warmup and manager.prefix_cache_lookup_enabled(request):
                self._count_traffic(tag.agent, request.num_tokens, num_hits)
            if tag is not None:
                self._note_warmup(request, tag, num_hits)

        pool.cache_full_blocks = cache_full_blocks_observed  # type: ignore[method-assign]
        manager.get_computed_blocks = get_computed_blocks_observed  # type: ignore[method-assign]
        manager.record_prefix_cache_stats = record_prefix_cache_stats_observed  # type: ignore[method-assign]

    def tag_of(self, request: Request) -> AgentTag | None:
        """The request's agentkv tag (parsed once per request; malformed ones counted)."""
        request_id = request.request_id
        known = self._tags.get(request_id, _UNPARSED)
        if known is not _UNPARSED:
            return known  # type: ignore[return-value]
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        result = parse_xargs(extra)
        self.malformed.record(result.errors)
        tag = self._recognized(request, result.tag)
        # X-Session-ID stands in for a missing agentkv session, except on warm-ups, which
        # carry it only as a routing key and must not join (or revive) any session
        if tag is not None and tag.session is None and request.session_id and not tag.warmup:
            try:
                tag = AgentTag(tag.agent, request.session_id, tag.parent, tag.step, tag.warmup)
            except ProtocolError as exc:
                self.malformed.record((exc,))  # type: ignore[arg-type]
        self._tags[request_id] = tag
        if len(self._tags) > _MAX_CACHED_TAGS:
            self._tags.popitem(last=False)
        return tag

    def _recognized(self, request: Request, tag: AgentTag | None) -> AgentTag | None:
        """A tag wins; an untagged request gets the agent, session and parent recognition finds."""
        if self.recognizer is None or not self.block_size:
            return tag
        tokens = request.prompt_token_ids or []
        if tag is not None:
            if not tag.warmup:
                self.recognizer.observe_tagged(tag.agent, request.block_hashes, tokens, self.block_size)
            return tag
        found = self.recognizer.recognize(request.request_id, request.block_hashes, tokens, self.block_size,
                                          request.session_id)
        if found.agent is None:
            return None
        try:
            return AgentTag(found.agent, found.session, found.parent, found.step)
        except ProtocolError as exc:  # an X-Session-ID outside the wire alphabet
            self.malformed.record((exc,))  # type: ignore[arg-type]
            return None

    # -- scheduler events ----------------------------------------------------------

    def on_add_request(self, request: Request) -> None:
        tag = self.tag_of(request)
        if tag is None:
            return
        self.tagged_requests += 1
        self.anchors.observe(tag.agent, tag.session, request.block_hashes)
        if tag.session is not None and not tag.warmup:
            self.timing.observe(tag.session, tag.agent, self.clock(), tag.step)
        if tag.session is not None and self.facts.is_ended(tag.session):
            self.facts.start_session(tag.session)  # a tagged request revives an ended session id
        self.learner.observe(tag.agent, tag.session, tag.parent, step=tag.step, warmup=tag.warmup)

    def refresh(self) -> None:
        """Re-evaluate the next-use model and re-score the queue's groups when it may have moved.

        Runs at the start of every scheduler step; does work only when the learner, the facts or
        the session timing changed, or ``_RESCORE_INTERVAL`` passed (values depend on how long
        sessions have been idle), and at most once per ``refresh_interval`` unless a fact
        changed. The chain's first-passage table and the gap distributions are
        recomputed only when enough new evidence arrived (``_stale``). Sessions the timing model
        finds abandoned leave the timing (their history drops to the floor).
        """
        if not self.config.enabled:
            return
        now = self.clock()
        version = (self.learner.version, self.facts.version, self.timing.version)
        waited = now - self._scored_at
        if version == self._scored_version and waited < _RESCORE_INTERVAL:
            return
        facts_changed = self._scored_version is None or version[1] != self._scored_version[1]
        if waited < self.config.refresh_interval and not facts_changed:
            return  # a fact (an ended session) applies at once; learned values can wait a step or two
        self.table = table = self._evaluate(now)
        for session in table.dead:
            # only the timing forgets it (its history drops to the floor, its length is learned);
            # the learner keeps its lineage: a session that was merely slow must not count an end
            self.timing.end(session)
        self._scored_version = (self.learner.version, self.facts.version, self.timing.version)
        self._scored_at = now
        policy = self.policy
        if policy == "lru" and self._scored_policy == ("lru", self.facts.version):
            return  # every group still scores 0.0 (or -inf if retired): nothing to redo
        self._scored_policy = (policy, self.facts.version)
        if policy == "lru":
            self._scorer = lambda group: _RETIRED if type(group) is History and self.facts.is_ended(
                group.session) else 0.0
        else:
            self._scorer = table.scorer(retired=self.facts.is_ended, retired_score=_RETIRED)
        for queue in self.queues:
            queue.set_group_scores(self._scorer)

    def _evaluate(self, now: float) -> ReuseTable:
        chain = self.predictor.chain()
        config = self.config.reuse
        dispatches = self.learner.dispatches
        if self._passage is None or self._stale("passage", (len(chain.agents), self.facts.version), dispatches, now):
            self._passage = first_passage_steps(chain.matrix, config.steps or config.max_steps,
                                                tolerance=0.0 if config.steps else config.step_tolerance)
        if self._gaps is None or self._stale("gaps", self.timing.gap_agents, self.timing.gaps, now):
            self._gaps = self.timing.table()
        facts = self.facts
        sessions = [entry for entry in self.timing.sessions() if not facts.is_ended(entry[0])]
        interposed = getattr(self.learner, "interposed_rate", None)
        return score_reuse(
            chain,
            self._gaps,
            sessions,
            now=now,
            session_start_rate=self.timing.session_rate(now),
            continuation={a: self.timing.continuation(a) for a in chain.agents},
            interposed=interposed() if interposed is not None else None,
            predictability=self.learner.predictability(),
            gap_count=self.timing.gaps,
            config=config,
            passage=self._passage,
        )

    def _stale(self, name: str, shape: object, evidence: int, now: float) -> bool:
        """True when a cached input was built on another shape, on 5% less evidence, or 2 s ago.

        The counts move little per dispatch: recomputing on every one would cost most of a
        scheduler step at tens of agents, for no change in the eviction order.
        """
        built = self._built.get(name)
        if built is not None and built[0] == shape and evidence - built[1] < max(1, built[1] // 20) \
                and now - built[2] < _REBUILD_INTERVAL:
            return False
        self._built[name] = (shape, evidence, now)
        return True

    @property
    def policy(self) -> str:
        if not self.config.enabled or self.tagged_requests == 0 or self.table is None or not self.table.predictable:
            return "lru"
        return "survival"

    def _score_of(self, group: Group) -> float:
        """log(reuses per second) of a group; equal for all while the policy is LRU, -inf once retired."""
        return self._scorer(group)

    def _on_evict(self, popped: Sequence[KVCacheBlock]) -> None:
        """Blocks the free queue handed out: those still holding a hash are being evicted."""
        self.tracker.evicted(popped, self.facts.is_ended)
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
        """
        hashes = self.anchors.anchor_hashes(agent)
        pool = self.pool
        if pool is None:
            return 0, len(hashes)
        resident = 0
        for block_hash in hashes:
            if pool.get_cached_block(block_hash, [0]) is None:  # type: ignore[arg-type]
                break
            resident += 1
        return resident, len(hashes)

    def _count_lru_evictions(self, queue: Any) -> None:
        """Disabled mode: vLLM's own free queue keeps its exact LRU order; the cached blocks it
        hands out for reuse (which the pool evicts right away) are counted as the scored queue
        counts them."""
        popleft, popleft_n = queue.popleft, queue.popleft_n

        def report(blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
            self._on_evict(blocks)
            return blocks

        queue.popleft = lambda: report([popleft()])[0]
        queue.popleft_n = lambda n: report(popleft_n(n))

    # -- control channel -----------------------------------------------------------

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Serve one control request from the API server (runs in the control thread)."""
        with self.lock:
            op = request.get("op")
            if op == "stats":
                return self.stats()
            if op == "events":
                return self.apply_events(request.get("payload"))
            if op == "state":
                return self.learner.export_counts(self.config.replica, self.epoch).to_json()
            if op == "merge":
                return self.merge(request.get("payload"))
            if op == "recognized":
                recent = [] if self.recognizer is None else list(self.recognizer.recent)
                return {"recognized": [list(r) for r in recent]}
            if op == "save":
                return {"saved": self.save_if_changed()}
            return {"error": f"unknown control op {op!r}"}

    def merge(self, payload: object) -> dict[str, Any]:
        """Merge another replica's exported counts (docs/protocol.md §2.3)."""
        try:
            export = PeerExport.from_json(payload, max_agents=self.config.learner.max_agents)
        except ValueError as exc:
            return {"error": f"merge refused: {exc}", "status": 400}
        if export.total_weight() > self._max_peer_weight():
            return {"error": f"merge refused: counts total {export.total_weight():.3g}, more than a replica "
                             f"can learn ({self._max_peer_weight():.3g})", "status": 400}
        if export.replica == self.config.replica and export.epoch == self.epoch:
            return {"merged": False, "reason": "own export"}
        return {"merged": self.learner.merge_peer(self._bounded_influence(export))}

    def apply_events(self, payload: object) -> dict[str, Any]:
        try:
            events = validate_events(payload)
        except ProtocolError as exc:
            return {"error": str(exc), "status": 400}
        accepted = duplicates = 0
        for event in events:
            try:
                applied = self.facts.apply(event)
            except FactsFull as exc:
                return {"error": f"{exc} (cap, docs/server.md); {accepted} earlier events applied",
                        "status": 400, "accepted": accepted, "duplicates": duplicates}
            if applied:
                accepted += 1
                if event["type"] in ("session_end", "cancel"):
                    self.learner.end_session(event["session"])
                    self.timing.end(event["session"])
            else:
                duplicates += 1
        return {"accepted": accepted, "duplicates": duplicates}

    def stats(self, max_age: float = STATS_MAX_AGE) -> dict[str, Any]:
        """The stats document (docs/protocol.md); at most ``max_age`` seconds old, and never older
        than the last graph fact or session event."""
        now = time.monotonic()
        cached = self._stats_cache
        if cached is not None and now - cached[0] < max_age and cached[1] == self.facts.version:
            return cached[2]
        document = self._build_stats()
        self._stats_cache = (now, self.facts.version, document)
        return document

    def _build_stats(self) -> dict[str, Any]:
        table = self.table
        blocks = self.tracker.blocks_by_agent()
        chain = self.predictor.chain()
        transitions = {
            a: {b: round(float(p), 4) for b, p in zip(chain.agents, chain.matrix[i], strict=True) if p >= 0.05}
            for i, a in enumerate(chain.agents)
        }
        return {
            "version": PROTOCOL_VERSION,
            "enabled": self.config.enabled,
            "policy": self.policy,
            "block_size": self.block_size,
            "predictability": self.learner.predictability(),
            "top1_accuracy": self.learner.accuracy,
            "dispatches": self.learner.dispatches,
            "tagged_requests": self.tagged_requests,
            "recognition": None if self.recognizer is None else self.recognizer.stats(),
            "sessions": self._session_stats(),
            "agents": self._agent_stats(blocks, table),
            "kv_free_blocks": None if self.pool is None else self.pool.get_num_free_blocks(),
            "warmups": self.warmups.stats(),
            "transitions": transitions,
            "evictions": {kind: self.tracker.evictions[kind] for kind in ("anchor", "history", "untagged", "retired")},
            "learner": {
                "bytes": self.learner.state_bytes(),
                "agents": len(self.learner.agents),
                "replica": self.config.replica,
                "peers": self.learner.peers.replicas(),
            },
            "facts": self.facts.export(),
            "malformed_metadata": dict(self.malformed.by_field),
            "config": {
                "horizon_steps": table.steps if table is not None else None,
                "horizon_s": round(table.horizon_s, 3) if table is not None else None,
                "r_min": self.config.reuse.r_min,
                "decay": self.config.decay,
            },
        }

    def save(self) -> None:
        if self.config.snapshot_path:
            with self.lock:
                save_snapshot(self.config.snapshot_path, self.learner, self.facts)
                self._saved_version = (self.learner.version, self.facts.version)

    # -- bounds (docs/server.md, "Limits") ------------------------------------------

    def save_if_changed(self) -> bool:
        """Save the snapshot unless nothing learned changed since the last save; True if written."""
        with self.lock:
            if not self.config.snapshot_path or self._saved_version == (self.learner.version, self.facts.version):
                return False
            self.save()
            return True

    def _max_peer_weight(self) -> float:
        """Three times the most a decayed learner can hold per part (transitions, entries, ends), doubled."""
        half_life = self.config.learner.half_life
        if half_life is None:
            return 1e12
        return 6.0 / (1.0 - 2.0 ** (-1.0 / half_life))

    def _bounded_influence(self, export: PeerExport) -> PeerExport:
        """Scale a peer's counts down to at most ``peer_weight`` x this replica's own evidence
        (at least ``peer_weight`` x PEER_WEIGHT_FLOOR): a peer can inform, never drown, the local model."""
        own = self.learner.export_counts(self.config.replica, self.epoch).total_weight()
        cap = self.config.peer_weight * max(own, PEER_WEIGHT_FLOOR)
        total = export.total_weight()
        return export.scaled(cap / total) if total > cap else export

    def _tracked(self, counter: Counter[str], agent: str) -> str:
        return tracked(counter, agent, self.config.tracked_agents)

    def _count_traffic(self, agent: str, tokens: int, hits: int) -> None:
        key = self._tracked(self.queries, agent)
        self.queries[key] += tokens
        self.hits[key] += hits

    def _session_stats(self) -> dict[str, Any]:
        live = self.learner.session_agents()
        recent = list(live.items())[-self.config.listed_agents :]  # the most recently active ones
        return {"active": len(live), "ended": len(self.facts.ended), "current": dict(recent)}

    def _agent_stats(self, blocks: Mapping[str, Counter[str]], table: ReuseTable | None) -> dict[str, Any]:
        names = set(self.queries) | set(blocks) | set(self.learner.agents)
        survival = (lambda a: 1.0) if table is None else table.survival
        return agent_rows(names, self.queries, self.hits, blocks, survival, self.anchors.length,
                          lambda agent: self.anchor_residency(agent)[0], self.config.listed_agents)
