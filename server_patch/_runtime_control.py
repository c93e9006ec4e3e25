"""The runtime's control channel: stats document, graph facts and session events, answers
(tool call or not), peer merges, snapshots (requests from the API server, served under the runtime's lock)."""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from vllm.v1.core.block_pool import BlockPool

from agentkv.graph import (
    PEER_WEIGHT_FLOOR,
    FactsFull,
    GraphFacts,
    PeerExport,
    Prediction,
    Predictor,
    ReuseTable,
    SessionTiming,
    TransitionLearner,
    restore_snapshot,
    snapshot_document,
    top_successors,
    write_snapshot,
)
from agentkv.protocol import (
    PROTOCOL_VERSION,
    STATS_MAX_AGE,
    MalformedCounter,
    ProtocolError,
    validate_events,
    validate_id,
)

from ._config import RuntimeConfig
from ._recognize import Recognizer
from ._rows import agent_rows
from ._trace import RequestTrace
from ._tracker import AnchorLengths, BlockTracker
from ._warmups import WarmupLedger

__all__ = ["PEER_WEIGHT_FLOOR", "STATS_MAX_AGE", "RuntimeControl"]

_MAX_VIEW_AGENTS = 64  # anchors a view reports: warm-up targets are agents active lately


class RuntimeControl:
    """Control requests and the stats document of an ``AgentKVRuntime`` (mixed into it).

    Invariants: every public entry point holds ``lock``; a stats document is at most
    ``STATS_MAX_AGE`` seconds old and never older than the last graph fact, session event or merge.
    """

    config: RuntimeConfig
    epoch: str
    lock: threading.RLock
    learner: TransitionLearner
    facts: GraphFacts
    predictor: Predictor
    timing: SessionTiming
    tracker: BlockTracker
    anchors: AnchorLengths
    warmups: WarmupLedger
    trace: RequestTrace | None
    recognizer: Recognizer | None
    malformed: MalformedCounter
    pool: BlockPool | None
    table: ReuseTable | None
    block_size: int
    tagged_requests: int
    answers: Counter[str]
    queries: Counter[str]
    hits: Counter[str]
    policy: str
    anchor_residency: Callable[[str], tuple[int, int]]
    _saved_version: tuple[int, int, int] | None
    _writing: threading.Lock  # held while a snapshot is written
    _copies: int  # snapshots copied so far
    _written: int  # the number of the latest copy written
    _stats_cache: tuple[float, tuple[int, int], dict[str, Any]] | None
    _answer_sessions: OrderedDict[str, str]
    queue_lengths: Callable[[], tuple[int, int]] | None  # the scheduler's (waiting, running), once installed

    # -- control channel -----------------------------------------------------------

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Serve one control request from the API server (runs in the control thread). A payload
        is validated before the engine's lock is taken: a scheduler step never waits on it."""
        op = request.get("op")
        if op == "events":
            return self.apply_events(request.get("payload"))
        with self.lock:
            if op == "stats":
                return self.stats()
            if op == "state":
                return self.learner.export_counts(self.config.replica, self.epoch).to_json()
            if op == "merge":
                return self.merge(request.get("payload"))
            if op == "recognized":
                recent = [] if self.recognizer is None else list(self.recognizer.recent)
                return {"recognized": [list(r) for r in recent]}
            if op == "save":
                return {"saved": self.save_if_changed()}
            if op == "view":
                return self.view()
            if op == "answered":
                if "request" in request:
                    return self.answered_request(request["request"], request.get("tool_call"))
                return self.answered(request.get("session"), request.get("tool_call"))
            return {"error": f"unknown control op {op!r}"}

    def answered(self, session: object, tool_call: object) -> dict[str, Any]:
        """A tagged request of ``session`` finished; its answer was a tool call or not (read by
        the middleware from the response), so the model knows whether the same agent comes back."""
        if not isinstance(session, str) or type(tool_call) is not bool:
            return {"error": "answered takes a session id and a boolean tool_call", "status": 400}
        try:
            validate_id(session, "session")
        except ProtocolError as exc:
            return {"error": str(exc), "status": 400}
        self.timing.answered(session, tool_call)
        self.answers["tool_call" if tool_call else "no_tool_call"] += 1
        return {"answered": True}

    def view(self) -> dict[str, Any]:
        """What a warm-up decision reads (``GET /agentkv/v1/view``): the scheduler's waiting and
        running requests, the free blocks, ``[resident, learned]`` anchor blocks of the
        ``_MAX_VIEW_AGENTS`` agents seen most recently (O(log of their anchor blocks) each), the
        prediction after each of them and how many warm-ups survived to their agent's call: all a
        decision needs, so it never asks for stats."""
        waiting, running = self.queue_lengths() if self.queue_lengths is not None else (None, None)
        recent = self.anchors.recent(_MAX_VIEW_AGENTS)
        successors = self._observed(top_successors(self.predictor.chain(), recent))
        return {
            "waiting": waiting,
            "running": running,
            "free_blocks": None if self.pool is None else self.pool.get_num_free_blocks(),
            "anchors": {agent: list(self.anchor_residency(agent)) for agent in recent},
            "block_size": self.block_size,
            "predictability": round(self.learner.predictability(), 4),
            "next": {agent: [p.agent, round(p.probability, 4)] for agent, p in successors.items()},
            "warmups": list(self.warmups.outcomes()),
        }

    def _observed(self, successors: dict[str, Prediction]) -> dict[str, Prediction]:
        """The successors whose transition was seen: a declared graph's only successor, never
        followed yet, is no prediction (the gate of the replay and of a client-side learner)."""
        index = {agent: i for i, agent in enumerate(self.learner.agents)}
        counts = self.learner.counts() if successors else None
        return {agent: p for agent, p in successors.items()
                if counts is not None and (a := index.get(agent)) is not None
                and (b := index.get(p.agent)) is not None and counts[a, b] > 0}

    def answered_request(self, key: object, tool_call: object) -> dict[str, Any]:
        """An untagged request finished, named by its response id (``_answers.answer_keys``); told
        as ``answered`` for the session recognition gave it, if any (else nothing to tell)."""
        if not isinstance(key, str) or len(key) > 256 or type(tool_call) is not bool:
            return {"error": "answered takes a request id (at most 256 characters) and a boolean tool_call",
                    "status": 400}
        session = self._answer_sessions.pop(key, None)
        if session is None:
            return {"answered": False}
        return self.answered(session, tool_call)

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
        """Validate a ``POST /agentkv/v1/events`` body (outside the engine's lock: a scheduler step
        never waits on it), then apply its events in order under the lock."""
        try:
            events = validate_events(payload)
        except ProtocolError as exc:
            return {"error": str(exc), "status": 400}
        with self.lock:
            return self._apply_events(events)

    def _apply_events(self, events: list[dict[str, Any]]) -> dict[str, Any]:
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
        """The stats document (docs/protocol.md); at most ``max_age`` seconds old (the engine builds
        at most a few per second however often clients poll, so polling cannot stall scheduling),
        and never older than the last graph fact, session event or peer merge."""
        now = time.monotonic()
        cached = self._stats_cache
        changes = (self.facts.version, self.learner.peers.version)
        if cached is not None and now - cached[0] < max_age and cached[1] == changes:
            return cached[2]
        document = self._build_stats()
        self._stats_cache = (now, changes, document)
        return document

    def _build_stats(self) -> dict[str, Any]:
        table = self.table
        pool = self.pool
        blocks = self.tracker.blocks_by_agent(
            lambda block_id: pool is not None and pool.blocks[block_id].block_hash is not None)
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
            "trace": None if self.trace is None else self.trace.stats(),
            "answers": dict(self.answers),  # tagged answers read by the middleware: tool call or not
            "transitions": transitions,
            "evictions": {kind: self.tracker.evictions[kind] for kind in ("anchor", "history", "untagged", "retired")},
            "learner": {
                "bytes": self.learner.state_bytes(),
                "agents": len(self.learner.agents),
                "replica": self.config.replica,
                "peers": self.learner.peers.replicas(),
            },
            "facts": self.facts.export(),
            # learned gaps and the agents with gaps of their own: a snapshot carries them over a restart
            "timing": {"gaps": self.timing.gaps, "agents": self.timing.gap_agents},
            "malformed_metadata": dict(self.malformed.by_field),
            "config": {
                "horizon_steps": table.steps if table is not None else None,
                "horizon_s": round(table.horizon_s, 3) if table is not None else None,
                "r_min": self.config.reuse.r_min,
                "decay": self.config.decay,
            },
        }

    def _restore(self) -> None:
        """Start from the snapshot's learned state if one is configured and readable, else fresh.
        A restored state is what the file holds: no save rewrites it before something changes."""
        path = self.config.snapshot_path
        restored = restore_snapshot(path, self.config.learner) if path else None
        self.learner, self.facts, self.timing = restored or (TransitionLearner(self.config.learner), GraphFacts(),
                                                             SessionTiming())
        self.learner.peers.max_replicas = self.config.max_peers
        self.learner.peers.peer_weight = self.config.peer_weight
        self._saved_version = None if restored is None else self._learned_version()
        self._writing = threading.Lock()
        self._copies = self._written = 0

    def save(self) -> None:
        """Write the snapshot: the learned state is copied under the engine's lock and encoded and
        written (fsync, rename) outside it, so that no scheduler step waits on the disk; writes run
        one at a time, and a copy older than one already written is not written."""
        path = self.config.snapshot_path
        if not path:
            return
        with self.lock:
            document = snapshot_document(self.learner, self.facts, self.timing)
            version = self._learned_version()
            self._copies += 1
            copy = self._copies
        with self._writing:  # never taken before ``lock`` (a control op may hold ``lock`` to save)
            if copy < self._written:
                return
            write_snapshot(path, document)
            self._written, self._saved_version = copy, version

    # -- bounds (docs/server.md, "Limits") ------------------------------------------

    def save_if_changed(self) -> bool:
        """Save the snapshot unless nothing learned changed since the last save; True if written."""
        with self.lock:
            if not self.config.snapshot_path or self._saved_version == self._learned_version():
                return False
        self.save()
        return True

    def _learned_version(self) -> tuple[int, int, int]:
        """What a snapshot holds changed when this did: the learner's own counts (a peer's merge is not
        saved), the declared graph (session events are not saved), and the timing's gaps, starts and
        ends learned, not every request (an idle server saves nothing)."""
        return self.learner.own_version, self.facts.graph_version, self.timing.learned_version

    def _max_peer_weight(self) -> float:
        """Three times the most a decayed learner can hold per part (transitions, entries, ends), doubled."""
        half_life = self.config.learner.half_life
        if half_life is None:
            return 1e12
        return 6.0 / (1.0 - 2.0 ** (-1.0 / half_life))

    def _bounded_influence(self, export: PeerExport) -> PeerExport:
        """Scale a peer's counts down to at most ``peer_weight`` x this replica's own evidence (at
        least ``peer_weight`` x PEER_WEIGHT_FLOOR), so that one heavy peer cannot take the share of
        the others; all of them together are bounded alike where they are summed (``PeerCounts.aligned``)."""
        own = self.learner.export_counts(self.config.replica, self.epoch).total_weight()
        cap = self.config.peer_weight * max(own, PEER_WEIGHT_FLOOR)
        total = export.total_weight()
        return export.scaled(cap / total) if total > cap else export

    def _session_stats(self) -> dict[str, Any]:
        live = self.learner.session_agents()
        recent = list(live.items())[-self.config.listed_agents :]  # the most recently active ones
        return {"active": len(live), "ended": len(self.facts.ended), "current": dict(recent)}

    def _agent_stats(self, blocks: Mapping[str, Counter[str]], table: ReuseTable | None) -> dict[str, Any]:
        names = set(self.queries) | set(blocks) | set(self.learner.agents)
        survival = (lambda a: 1.0) if table is None else table.survival
        return agent_rows(names, self.queries, self.hits, blocks, survival, self.anchors.length,
                          lambda agent: self.anchor_residency(agent)[0], self.config.listed_agents)
