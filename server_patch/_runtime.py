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
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from agentkv.graph import (
    FactsFull,
    GraphFacts,
    LearnerConfig,
    PeerExport,
    Predictor,
    SurvivalConfig,
    SurvivalScorer,
    SurvivalTable,
    TransitionLearner,
    restore_or_fresh,
    save_snapshot,
)
from agentkv.protocol import PROTOCOL_VERSION, AgentTag, MalformedCounter, ProtocolError, parse_xargs, validate_events

from ._free_queue import DEFAULT_DECAY, ScoredFreeBlockQueue
from ._rows import OTHER, agent_rows, tracked
from ._tracker import UNTAGGED, AnchorLengths, BlockTracker

__all__ = ["OTHER", "AgentKVRuntime", "RuntimeConfig"]

logger = logging.getLogger("agentkv.server")

_RETIRED = -math.inf
PEER_WEIGHT_FLOOR = 64.0  # the local evidence a fresh replica is credited with when bounding peers
_MAX_CACHED_TAGS = 65_536


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
    survival: SurvivalConfig = field(default_factory=SurvivalConfig)
    learner: LearnerConfig = field(default_factory=lambda: LearnerConfig(half_life=5000, session_ttl=600))
    decay: float = DEFAULT_DECAY
    untagged_survival: float = 0.5
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
        method = env.get("AGENTKV_SURVIVAL_METHOD", defaults.survival.method)
        if method not in ("exact", "hops"):
            raise ValueError(f"AGENTKV_SURVIVAL_METHOD={method!r}: choose exact or hops")
        survival = SurvivalConfig(
            horizon=int(_env_float(env, "AGENTKV_HORIZON", defaults.survival.horizon)),
            r_min=_env_float(env, "AGENTKV_R_MIN", defaults.survival.r_min),
            method=method,  # type: ignore[arg-type]
        )
        return cls(
            enabled=env.get("AGENTKV_ENABLED", "1") != "0",
            survival=survival,
            decay=_env_float(env, "AGENTKV_DECAY", defaults.decay),
            untagged_survival=_env_float(env, "AGENTKV_UNTAGGED_SURVIVAL", defaults.untagged_survival),
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
        self.scorer = SurvivalScorer(self.predictor, self.config.survival)
        self.tracker = BlockTracker()
        self.anchors = AnchorLengths()
        self.malformed = MalformedCounter(logger)
        self.lock = threading.RLock()
        self.queues: list[ScoredFreeBlockQueue[Hashable]] = []
        self.table: SurvivalTable | None = None
        self.block_size = 0
        self.queries: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        self.tagged_requests = 0
        self._tags: OrderedDict[str, AgentTag | None] = OrderedDict()
        self._saved_version: tuple[int, int] | None = None
        self._scored_version: tuple[int, int] | None = None
        # Per agent: how often a request was followed, in its session, by another request of
        # the same dispatch (same agent and step: a tool loop) or by another dispatch.
        self.continued: Counter[str] = Counter()
        self.handed_off: Counter[str] = Counter()
        self._last_dispatch: OrderedDict[str, tuple[str, int | None]] = OrderedDict()
        self._scored_policy: tuple[str, int] | None = None
        # log-space scores prepared by refresh() for _score_of (valid for one table)
        self._lru = True
        self._log_untagged = self._log_floor = 0.0
        self._log_anchor: dict[str, float] = {}
        self._log_passage: list[list[float]] = []

    # -- wiring into vLLM ----------------------------------------------------------

    def install(self, manager: KVCacheManager) -> None:
        """Swap in the scored free queue and observe caching and hits (no vLLM code changes)."""
        pool = manager.block_pool
        self.block_size = pool.hash_block_size
        if self.config.enabled:  # disabled: vLLM's own queue stays, so eviction is exactly LRU
            queue: ScoredFreeBlockQueue[Hashable] = ScoredFreeBlockQueue.replace(
                pool, self._group_of, clock=self.clock, decay=self.config.decay
            )
            queue.on_evict = self._on_evict
            self.queues.append(queue)

        cache_full_blocks = pool.cache_full_blocks

        @functools.wraps(cache_full_blocks)
        def cache_full_blocks_observed(request: Request, blocks: list[KVCacheBlock], num_cached_blocks: int,
                                       num_full_blocks: int, *args: Any, **kwargs: Any) -> None:
            cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
            tag = self.tag_of(request)
            new = ((i, blocks[i].block_id) for i in range(num_cached_blocks, num_full_blocks) if not blocks[i].is_null)
            self.tracker.cached(new, tag, 0 if tag is None else self.anchors.length(tag.agent))

        get_computed_blocks = manager.get_computed_blocks

        @functools.wraps(get_computed_blocks)
        def get_computed_blocks_observed(request: Request, *args: Any, **kwargs: Any) -> Any:
            result = get_computed_blocks(request, *args, **kwargs)
            tag = self.tag_of(request)
            if tag is not None and result[1] > 0:
                anchor_blocks = self.anchors.length(tag.agent)
                for group in result[0].blocks:
                    hits = ((i, b.block_id) for i, b in enumerate(group) if not b.is_null)
                    self.tracker.hit(hits, tag, anchor_blocks)
            return result

        record_prefix_cache_stats = manager.record_prefix_cache_stats

        @functools.wraps(record_prefix_cache_stats)
        def record_prefix_cache_stats_observed(request: Request, num_hits: int) -> None:
            record_prefix_cache_stats(request, num_hits)
            tag = self.tag_of(request)
            # warm-ups are agentkv's own traffic: the agent's hit rate is its real calls'
            if tag is not None and not tag.warmup and manager.prefix_cache_lookup_enabled(request):
                self._count_traffic(tag.agent, request.num_tokens, num_hits)

        pool.cache_full_blocks = cache_full_blocks_observed  # type: ignore[method-assign]
        manager.get_computed_blocks = get_computed_blocks_observed  # type: ignore[method-assign]
        manager.record_prefix_cache_stats = record_prefix_cache_stats_observed  # type: ignore[method-assign]

    def tag_of(self, request: Request) -> AgentTag | None:
        """The request's agentkv tag (parsed once per request; malformed ones counted)."""
        request_id = request.request_id
        if request_id in self._tags:
            return self._tags[request_id]
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        result = parse_xargs(extra)
        self.malformed.record(result.errors)
        tag = result.tag
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

    # -- scheduler events ----------------------------------------------------------

    def on_add_request(self, request: Request) -> None:
        tag = self.tag_of(request)
        if tag is None:
            return
        self.tagged_requests += 1
        self.anchors.observe(tag.agent, tag.session, request.block_hashes)
        if tag.session is not None and not tag.warmup:
            self._count_dispatch(tag.session, tag.agent, tag.step)
        if tag.session is not None and self.facts.is_ended(tag.session):
            self.facts.start_session(tag.session)  # a tagged request revives an ended session id
        self.learner.observe(tag.agent, tag.session, tag.parent, step=tag.step, warmup=tag.warmup)

    def _count_dispatch(self, session: str, agent: str, step: int | None) -> None:
        last = self._last_dispatch.pop(session, None)
        if last is not None:
            if step is not None and last == (agent, step):
                self.continued[self._tracked(self.continued, agent)] += 1
            else:
                self.handed_off[self._tracked(self.handed_off, last[0])] += 1
        self._last_dispatch[session] = (agent, step)
        if len(self._last_dispatch) > self.config.learner.max_sessions:
            self._last_dispatch.popitem(last=False)

    def continuation(self, agent: str) -> float:
        """P(a request of ``agent`` is followed by another request of the same dispatch)."""
        total = self.continued[agent] + self.handed_off[agent]
        return self.continued[agent] / total if total else 0.0

    def refresh(self) -> None:
        """Recompute survival and re-score the queue's groups, only when something changed.

        Runs once per scheduler step: O(agents^2 x horizon) for the table plus O(groups)
        dictionary lookups; in LRU mode the groups are re-scored only when facts change.
        """
        version = (self.learner.version, self.facts.version)
        if not self.config.enabled or version == self._scored_version:
            return
        self._scored_version = version
        self.table = self.scorer.refresh()
        policy = self.policy
        if policy == "lru" and self._scored_policy == ("lru", self.facts.version):
            return  # every group still scores 0.0 (or -inf if retired): nothing to redo
        self._scored_policy = (policy, self.facts.version)
        self._prepare_scores()
        for queue in self.queues:
            queue.set_group_scores(self._score_of)

    @property
    def policy(self) -> str:
        if not self.config.enabled or self.tagged_requests == 0 or self.table is None or not self.table.predictable:
            return "lru"
        return "survival"

    def _group_of(self, block: KVCacheBlock) -> Hashable:
        return self.tracker.group_of(block.block_id, block.block_hash is not None)

    def _prepare_scores(self) -> None:
        """Log-space survival per agent and per (current agent, agent), as plain Python lookups."""
        table, delta = self.table, self.config.survival.delta
        self._lru = self.policy == "lru"
        if self._lru or table is None:
            return
        self._log_untagged = math.log(self.config.untagged_survival + delta)
        self._log_anchor = {a: math.log(p + delta) for a, p in zip(table.agents, table.aggregate.tolist(), strict=True)}
        self._log_passage = [[math.log(p + delta) for p in row] for row in table.passage.tolist()]
        self._log_floor = math.log(delta)

    def _score_of(self, group: Hashable) -> float:
        """log(p + δ) of a group; equal for all while the policy is LRU, -inf once retired."""
        if group == UNTAGGED:
            return 0.0 if self._lru else self._log_untagged
        kind, *rest = group  # type: ignore[misc]
        if kind == "history" and self.facts.is_ended(rest[0]):
            return _RETIRED  # a fact: an ended session's history is never reused
        if self._lru:
            return 0.0
        if kind == "anchor":
            return max((self._log_anchor.get(a, self._log_floor) for a in rest[0]), default=self._log_floor)
        current = self.learner.current_agent(rest[0])
        index = None if current is None else self.table.index.get(current)  # type: ignore[union-attr]
        if index is None:
            return self._log_floor
        row, columns = self._log_passage[index], self.table.index  # type: ignore[union-attr]
        score = max((row[columns[a]] for a in rest[1] if a in columns), default=self._log_floor)
        going_on = self.continuation(current) if current in rest[1] else 0.0
        if going_on > 0.0:
            # The session's live dispatch: the agent's tool loop re-sends this prefix with
            # probability `going_on`, before any next dispatch. Never above the anchor (the
            # prefix's parent), so that a chain still loses its child first.
            delta = self.config.survival.delta
            survival = going_on + (1.0 - going_on) * (math.exp(score) - delta)
            anchor = max((self._log_anchor.get(a, self._log_floor) for a in rest[1]), default=self._log_floor)
            score = min(math.log(survival + delta), anchor)
        return score

    def _on_evict(self, block: KVCacheBlock) -> None:
        group = self.tracker.group_of(block.block_id, True)
        retired = group != UNTAGGED and group[0] == "history" and self.facts.is_ended(group[1])  # type: ignore[index]
        self.tracker.evicted(block.block_id, retired=retired)

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
            else:
                duplicates += 1
        return {"accepted": accepted, "duplicates": duplicates}

    def stats(self) -> dict[str, Any]:
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
            "sessions": self._session_stats(),
            "agents": self._agent_stats(blocks, table),
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
                "horizon": self.config.survival.horizon,
                "r_min": self.config.survival.r_min,
                "method": self.config.survival.method,
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

    def _agent_stats(self, blocks: Mapping[str, Counter[str]], table: SurvivalTable | None) -> dict[str, Any]:
        names = set(self.queries) | set(blocks) | set(self.learner.agents)
        survival = (lambda a: 1.0) if table is None else table.agent
        return agent_rows(names, self.queries, self.hits, blocks, survival, self.anchors.length,
                          self.config.listed_agents)
