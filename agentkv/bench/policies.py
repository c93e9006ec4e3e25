"""Eviction policies compared by ``agentkv bench replay`` (docs/benchmarks.md).

Every policy drives the same real vLLM ``KVCacheManager``. Baselines plug into the seam
agentkv itself uses: a ``ScoredFreeBlockQueue`` swapped into the ``BlockPool`` with the
policy's own ``group_of`` (which group a freed cached block joins) and ``score`` (log-space
value of a group; lowest evicted first, ties by recency). In the spirit of SGLang's
``evict_policy.py``: one small interface, a dozen lines per policy.

| name | what the policy knows |
|---|---|
| ``lru`` | L0: vanilla vLLM, no extension at all |
| ``ttl`` | L0 + Continuum-style pinning: a finished request's blocks are kept for a TTL |
| ``agentkv`` | L1: the server_patch runtime (learned transitions), eviction only |
| ``agentkv+facts`` | L1 + L2: plus the declared topology graph and session_end events |
| ``agentkv+warmup`` | as ``agentkv+facts`` plus anchor warm-up requests between turns |
| ``agentkv-untagged`` | L0 sent to the runtime: no tags, no session ids; agents and sessions recognized |
| ``agentkv-agent-only`` | L1 without sessions: each request names its agent alone; sessions recognized |
| ``agentkv-agent-only-no-recognition`` | as ``agentkv-agent-only`` on a server with recognition off |
| ``kvflow`` | L2: steps-to-execution on the declared graph (KVFlow) |
| ``belady`` | L3: the future trace; evicts the block whose next use is furthest |
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash
from vllm.v1.request import Request

from agentkv.graph import Prediction, TransitionLearner
from agentkv.warmup import JobState, TargetState, TokenBucket, WarmupPolicy, view_of
from server_patch._runtime import AgentKVRuntime, RuntimeConfig

from .simulator import Policy, ScoredPolicy, Simulator

if TYPE_CHECKING:
    from .tape import TapeRequest

__all__ = ["POLICIES", "Policy", "ScoredPolicy", "make_policy"]

_log = logging.getLogger(__name__)


# -- L0: Continuum-style TTL pinning ----------------------------------------------------


class TTL(Policy):
    """Continuum-style (Li et al., 2025): a finished request keeps its blocks referenced
    for ``ttl`` seconds (a hard pin: nothing can evict them, a request that does not fit
    waits), then frees them into plain LRU. Default 0.3 s: Continuum's setting
    (AutoGen's observed inter-turn latency); ``agentkv bench replay --ttl`` sets another.

    A *soft* pin through the free queue (pinned groups evicted last) would be exactly LRU:
    pins expire in the order blocks were freed, which is LRU order already.
    """

    name = "ttl"

    def __init__(self, ttl: float = 0.3) -> None:
        self.ttl = ttl

    def pin_for(self, sim: Simulator, request: Request, record: TapeRequest) -> float:
        return self.ttl

    def stats(self) -> dict[str, Any]:
        return {"ttl_s": self.ttl}


# -- L2: KVFlow ---------------------------------------------------------------------------

_FAR = 64  # steps-to-execution of an agent no live session can reach


class KVFlow(ScoredPolicy):
    """Steps-to-execution on the declared graph (Pan et al., 2025), per live session.

    A session's current agent is 0 steps away (running or in its tool loop); another agent
    is its BFS distance on the declared graph; a new session reaches the entry agents in 1.
    A block used by one session only (its history) takes that session's value; a block
    shared by sessions (an anchor) takes the best value over all live sessions, and a
    prefix shared by several agents the best among them. Knows session ends (facts).
    """

    name = "kvflow"

    def install(self, sim: Simulator) -> None:
        self.graph = sim.plan.declared_graph()
        self.distance = _all_pairs_hops(self.graph)
        entry = set(sim.plan.entry_agents())
        # a new session's steps to each agent: the same at every step (a tape's entries can be
        # hundreds of agents, this a pass over all pairs)
        self.entry_steps = {a: 1 + min((self.distance[e].get(a, _FAR) for e in entry), default=_FAR)
                            for a in self.distance}
        self.current: dict[str, str] = {}
        self.users: dict[int, tuple[bytes, set[str], set[str]]] = {}  # block_id -> (hash, agents, sessions)
        self.steps: dict[str, int] = {}
        super().install(sim)

    def _note(self, request: Request, record: TapeRequest) -> None:
        for block in self.sim.kv.get_blocks(request.request_id).blocks[0]:
            if block.block_hash is None:
                continue
            entry = self.users.get(block.block_id)
            if entry is None or entry[0] != block.block_hash:
                entry = self.users[block.block_id] = (block.block_hash, set(), set())
            entry[1].add(record.agent)
            if len(entry[2]) < 2:
                entry[2].add(record.session)

    def on_arrival(self, sim: Simulator, request: Request, record: TapeRequest) -> None:
        self.current[record.session] = record.agent

    def on_start(self, sim: Simulator, request: Request, record: TapeRequest) -> None:
        self._note(request, record)

    def before_free(self, sim: Simulator, request: Request, record: TapeRequest) -> None:
        self._note(request, record)

    def on_session_end(self, sim: Simulator, session: str) -> None:
        self.current.pop(session, None)

    def before_schedule(self, sim: Simulator) -> None:
        best = dict(self.entry_steps)
        for agent in self.current.values():
            for target, hops in self.distance[agent].items():
                if hops < best.get(target, _FAR):
                    best[target] = hops
        self.steps = best
        super().before_schedule(sim)

    def group_of(self, block: KVCacheBlock) -> Hashable:
        entry = self.users.get(block.block_id)
        if entry is None or entry[0] != block.block_hash:
            return ("unknown",)
        agents = frozenset(entry[1])
        return ("history", next(iter(entry[2])), agents) if len(entry[2]) == 1 else ("shared", agents)

    def score(self, group: Hashable) -> float:
        kind, *rest = group  # type: ignore[misc]
        if kind == "unknown":
            return -_FAR
        if kind == "shared":
            return -min(self.steps.get(a, _FAR) for a in rest[0])
        session, agents = rest
        current = self.current.get(session)
        if current is None:
            return -_FAR  # the session ended: its history is never used again
        return -min(self.distance[current].get(a, _FAR) for a in agents)


def _all_pairs_hops(graph: dict[str, set[str]]) -> dict[str, dict[str, int]]:
    """BFS hop counts; distance[a][a] = 0."""
    out: dict[str, dict[str, int]] = {}
    for source in graph:
        seen = {source: 0}
        frontier = deque([source])
        while frontier:
            node = frontier.popleft()
            for succ in graph.get(node, ()):
                if succ not in seen:
                    seen[succ] = seen[node] + 1
                    frontier.append(succ)
        out[source] = seen
    return out


# -- L3: Belady ---------------------------------------------------------------------------

_NEVER = math.inf
_DEPTH_SHARE = 1e-7  # x a block's depth (< 1e5 blocks): orders one request's blocks, never two requests'


class Belady(ScoredPolicy):
    """Future-trace oracle: evict the free cached block whose next use is furthest away.

    "Use" = a later foreground request of the tape whose prompt contains the block's hash
    (requests start in tape order, so the order of future uses is policy-independent).
    Score = -index of the next use (-inf: never used again), less a tiny share of the block's
    depth in its prompt: a parent's next use is never after its child's, and of blocks next
    used by the same request the deeper go first, so chains are evicted child first (also
    after a re-queue, which appends blocks in no chain order). A free block whose predicted
    use has passed (its parent was missing, so the lookup never reached it) is re-queued with
    its next use recomputed. Only a block's latest filing is re-queued: a block used and freed
    again was filed anew, and re-queueing it for each earlier filing too cost a pass over every
    block per request on tapes whose requests do not overlap.
    """

    name = "belady"
    dynamic = False

    def install(self, sim: Simulator) -> None:
        self.uses = sim.plan.uses  # hash -> sorted indices of the requests whose prompt holds it
        self.depth = sim.plan.depth_of_hash
        self.pending: dict[int, list[tuple[KVCacheBlock, bytes]]] = {}
        self.filed: dict[int, float] = {}  # block_id -> the next use it was last filed under
        super().install(sim)

    def _next_use(self, block_hash: bytes) -> float:
        uses = self.uses.get(block_hash)
        if not uses:
            return _NEVER
        k = bisect.bisect_left(uses, self.sim.next_index)
        return uses[k] if k < len(uses) else _NEVER

    def group_of(self, block: KVCacheBlock) -> Hashable:
        assert block.block_hash is not None
        block_hash = get_block_hash(block.block_hash)
        use = self.filed[block.block_id] = self._next_use(block_hash)
        if use == _NEVER:
            return use
        self.pending.setdefault(int(use), []).append((block, block.block_hash))
        return use + self.depth.get(block_hash, 0) * _DEPTH_SHARE

    def score(self, use: Hashable) -> float:
        return -use  # type: ignore[operator]

    def before_schedule(self, sim: Simulator) -> None:
        stale = [use for use in self.pending if use < sim.next_index]
        for use in sorted(stale):
            for block, block_hash in self.pending.pop(use):
                if block.ref_cnt == 0 and block.block_hash == block_hash and self.filed[block.block_id] == use:
                    self.queue.remove(block)
                    self.queue.append(block)  # regrouped by its next use from now on


# -- L1/L2: agentkv -------------------------------------------------------------------------


class AgentKV(Policy):
    """The exact server_patch runtime, installed on the manager as the scheduler does.

    ``facts``: the app also declares the topology graph (one ``graph`` event) and sends
    ``session_end`` when a session's last request finishes. ``warmup``: in the pause after
    each turn, a warm-up request holding only the predicted next agent's anchor
    (max_tokens=1, tagged warmup, no session), decided by the coordinator's own
    ``agentkv.warmup.WarmupPolicy`` (``warmup_policy``, default as the coordinator's) on the
    runtime's prediction, the anchor residency of the runtime's view (what ``GET
    /agentkv/v1/view`` tells the coordinator), the engine's waiting requests and
    free blocks, and a token bucket of ``max_per_second`` (2/s, burst 2); ``no_room`` also
    when the blocks do not fit without waiting.
    """

    name = "agentkv"

    def __init__(self, config: RuntimeConfig | None = None, *, facts: bool = False, warmup: bool = False,
                 tagged: bool = True, sessions: bool = True, warmup_policy: WarmupPolicy | None = None,
                 max_per_second: float = 2.0, burst: float = 2.0) -> None:
        self.config = config or RuntimeConfig()
        self.tagged = tagged  # False: requests carry neither tags nor session ids (recognition's input)
        self.sessions = sessions  # False: tags name the agent alone (no session, parent, step, X-Session-ID)
        self.facts = facts
        self.warmup = warmup
        self.warmup_policy = warmup_policy or WarmupPolicy()
        self.max_per_second = max_per_second
        self.burst = burst
        self.fallbacks: Counter[str] = Counter()
        self.anchors: dict[str, tuple[tuple[str, int], ...]] = {}
        self.warmups: Counter[str] = Counter()
        self.confusion: dict[str, Counter[str]] = {}  # untagged: true agent -> recognized agent ("-": none)

    def install(self, sim: Simulator) -> None:
        self.bucket = TokenBucket(self.max_per_second, self.burst, sim.clock)
        self.runtime = AgentKVRuntime(self.config, clock=sim.clock)
        self.runtime.install(sim.kv)
        self.graph_refused: str | None = None
        if self.facts:
            event = sim.plan.graph_event()
            if event is not None:
                result = self.runtime.apply_events({"version": 1, "events": [event]})
                if result.get("accepted") != 1:  # e.g. more edges than the protocol takes: run without it
                    self.graph_refused = str(result.get("error") or result)[:200]
                    self.fallbacks["graph_refused"] += 1
                    _log.warning("%s: the runtime refused the tape's graph event, replaying without it: %s",
                                 self.name, self.graph_refused)

    def on_arrival(self, sim: Simulator, request: Request, record: TapeRequest) -> None:
        self.runtime.on_add_request(request)
        if not self.tagged:
            tag = self.runtime.tag_of(request)
            self.confusion.setdefault(record.agent, Counter())["-" if tag is None else tag.agent] += 1
        self.anchors[record.agent] = sim.plan.anchor_segments(record)

    def before_schedule(self, sim: Simulator) -> None:
        self.runtime.refresh()

    def on_finish(self, sim: Simulator, request: Request, record: TapeRequest) -> None:
        tool_call = sim.plan.is_tool_call(record)  # what the middleware reads off the response
        if self.tagged and self.sessions:
            self.runtime.answered(record.session, tool_call)
        else:  # named by its response id: the recognized session's answer
            self.runtime.answered_request(request.request_id, tool_call)
        if self.warmup and sim.plan.is_handoff(record):
            self.warmups[self._warm(sim, record.agent)] += 1

    def _warm(self, sim: Simulator, agent: str) -> str:
        """Decide with the coordinator's policy right after ``agent``'s turn (never late: the
        session's next request has not arrived yet) and issue the warm-up; the reason."""
        return self._warm_to(sim, agent, self.runtime.predictor.predict(agent))

    def _warm_to(self, sim: Simulator, agent: str, prediction: Prediction | None) -> str:
        """The decision and warm-up for ``prediction`` of the agent after ``agent``; the reason."""
        learner = self.runtime.learner
        if prediction is None:
            job = JobState(None)
        else:
            job = JobState(prediction.agent, prediction.probability, _observed(learner, agent, prediction.agent),
                           learner.predictability())

        def target() -> TargetState:
            assert prediction is not None
            blocks = sum(n for _, n in self.anchors.get(prediction.agent, ())) // sim.plan.block_size
            view = view_of(self.runtime.view())  # the document GET /agentkv/v1/view serves the coordinator
            # running: unknown, so no price (``costly``): a warm-up's prefill delays no request here
            return TargetState(blocks, view.resident(prediction.agent, blocks), float(sim.waiting()), None,
                               sim.pool.get_num_free_blocks())

        decision = self.warmup_policy.decide(job, target, self.bucket.take)
        self.fallbacks.update(decision.fallbacks)
        if not decision.warm:
            return decision.reason
        assert prediction is not None
        if not sim.warmup(prediction.agent, self.anchors[prediction.agent], self.runtime.on_add_request):
            return "no_room"
        return "issued"

    def on_session_end(self, sim: Simulator, session: str) -> None:
        if self.facts:
            self.runtime.apply_events({"version": 1, "events": [{"type": "session_end", "session": session}]})

    def stats(self) -> dict[str, Any]:
        stats = self.runtime.stats()
        out: dict[str, Any] = {
            "runtime_policy": stats["policy"],
            "learned_r": round(stats["predictability"], 4),
            "top1_accuracy": None if stats["top1_accuracy"] is None else round(stats["top1_accuracy"], 4),
            "runtime_evictions": stats["evictions"],
            "anchor_length_blocks": {a: v["anchor_length_blocks"] for a, v in sorted(stats["agents"].items())},
        }
        if self.graph_refused is not None:
            out["graph_refused"] = self.graph_refused
        if self.warmup:
            out["warmups"] = dict(sorted(self.warmups.items()))
            out["warmup_fallbacks"] = dict(sorted(self.fallbacks.items()))
            out["warmup_outcomes"] = stats["warmups"]
        if not self.tagged:
            out["recognition"] = stats["recognition"]
            out["confusion"] = {a: dict(c.most_common()) for a, c in sorted(self.confusion.items())}
        return out


def _observed(learner: TransitionLearner, agent: str, target: str) -> bool:
    """The learner has seen ``agent -> target`` at least once (not just smoothing)."""
    agents = learner.agents
    if agent not in agents or target not in agents:
        return False
    return bool(learner.counts()[agents.index(agent), agents.index(target)] > 0)


POLICIES: dict[str, Callable[[], Policy]] = {
    "lru": Policy,
    "agentkv": AgentKV,
    "agentkv+facts": lambda: AgentKV(facts=True),
    "agentkv+warmup": lambda: AgentKV(facts=True, warmup=True),
    "agentkv-untagged": lambda: AgentKV(tagged=False),
    "agentkv-agent-only": lambda: AgentKV(sessions=False),
    "agentkv-agent-only-no-recognition": lambda: AgentKV(RuntimeConfig(recognize=False), sessions=False),
    "ttl": TTL,
    "kvflow": KVFlow,
    "belady": Belady,
}


def make_policy(name: str, **options: Any) -> Policy:
    """A fresh policy by name; ``options``: ``ttl`` (seconds) for ttl."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    if name == "ttl" and options.get("ttl") is not None:
        return TTL(options["ttl"])
    policy = POLICIES[name]()
    policy.name = name
    return policy
