"""Replay a tape through the real vLLM ``KVCacheManager`` on CPU: ``agentkv bench replay``.

A discrete-event simulation of one engine (docs/benchmarks.md, "Replay"):

* request i *arrives* at max(tape t_i, finish of its session's previous request + that
  request's tool_gap); the scheduler's ``add_request`` hook runs then;
* requests *start* in tape order (FCFS, head-of-line), each as soon as it has arrived and
  ``allocate_slots`` succeeds for its prompt and its output (``get_computed_blocks`` ->
  ``allocate_slots`` -> ``record_prefix_cache_stats``, as the scheduler admits a request);
  the start order is therefore the same under every policy and the tape is paired;
* a running request holds its blocks for overhead + computed prompt tokens / prefill_tps +
  output_tokens * tpot seconds (TimeModel; no contention between running requests), then
  its output tokens are appended and cached and the request is freed (``free``).

No model runs: vLLM's block pool, prefix hashing, hit lookup and eviction are real.
"""

from __future__ import annotations

import heapq
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHash, get_block_hash, hash_block_tokens
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

from agentkv.protocol import AgentTag, ProtocolError, validate_id

from ._defaults import DEFAULT_MARGIN, DEFAULT_MULTIPLIERS, DEFAULT_POLICIES
from .policies import Policy, make_policy
from .tape import Tape, TapeRequest, TimeModel, segment_kind
from .topologies import AGENTS, TOPOLOGIES, topology

__all__ = ["Replay", "ReplayResult", "TapePlan", "make_manager", "replay"]

# The parent of a tape's first block (vLLM's NONE_HASH is random per process unless
# PYTHONHASHSEED is set; a constant root keeps block hashes identical across processes).
_ROOT = BlockHash(sha256(("agentkv-tape", 1)))
_MAX_MODEL_LEN = 1 << 16
_NOT_WIRE = re.compile(r"[^A-Za-z0-9._:@/-]")  # outside agentkv.protocol's id alphabet


def make_manager(num_blocks: int, block_size: int) -> KVCacheManager:
    """A KVCacheManager for one full-attention group of ``num_blocks`` blocks (block 0 is vLLM's null block)."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    return KVCacheManager(config, max_model_len=_MAX_MODEL_LEN, scheduler_block_size=block_size,
                          hash_block_size=block_size)


class TapePlan:
    """Everything a replay needs from a tape, computed once: token ids, block hashes
    (vLLM's ``hash_block_tokens`` with sha256), segment kinds and the future-use index."""

    def __init__(self, tape: Tape) -> None:
        self.tape = tape
        self.requests: list[TapeRequest] = tape.requests
        self.block_size = bs = tape.block_size
        self._segment_cache: dict[str, list[int]] = {}
        self._hash_memo: dict[tuple[bytes, tuple[int, ...]], BlockHash] = {}
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self.hashes: dict[str, list[BlockHash]] = {}
        self.anchor_spans: list[list[tuple[int, int]]] = []
        self.kind_of_hash: dict[bytes, str] = {}
        self.uses: dict[bytes, list[int]] = {}
        for index, request in enumerate(self.requests):
            prompt = self.tokens_of(request.segments)
            output = self._segment(request.output_key, request.output_tokens)
            hashes = self._hash_chain(prompt + output)
            self.prompts.append(prompt)
            self.outputs.append(output)
            self.hashes[request.id] = hashes
            spans, position = [], 0
            for key, n in request.segments:
                if segment_kind(key) == "anchor":
                    spans.append((position, position + n))
                position += n
            self.anchor_spans.append(spans)
            for b, block_hash in enumerate(hashes):
                if block_hash not in self.kind_of_hash:
                    inside = any(lo <= b * bs and (b + 1) * bs <= hi for lo, hi in spans)
                    self.kind_of_hash[block_hash] = "anchor" if inside else "history"
            for block_hash in hashes[: len(prompt) // bs]:
                self.uses.setdefault(block_hash, []).append(index)
        self.next_in_session: list[int | None] = [None] * len(self.requests)
        last: dict[str, int] = {}
        for index, request in enumerate(self.requests):
            if request.session in last:
                self.next_in_session[last[request.session]] = index
            last[request.session] = index
        self.max_request_blocks = max(-(-(len(p) + len(o)) // bs) for p, o in zip(self.prompts, self.outputs,
                                                                                     strict=True))
        self.anchor_blocks = sum(1 for kind in self.kind_of_hash.values() if kind == "anchor")

    # -- tokens and hashes -------------------------------------------------------------

    def _segment(self, key: str, n_tokens: int) -> list[int]:
        tokens = self._segment_cache.get(key)
        if tokens is None or len(tokens) < n_tokens:
            tokens = self._segment_cache[key] = self.tape.tokens(key, n_tokens)
        return tokens[:n_tokens]

    def tokens_of(self, segments: Sequence[tuple[str, int]]) -> list[int]:
        out: list[int] = []
        for key, n in segments:
            out.extend(self._segment(key, n))
        return out

    def _hash_chain(self, tokens: list[int]) -> list[BlockHash]:
        bs, memo = self.block_size, self._hash_memo
        parent, out = _ROOT, []
        for start in range(0, len(tokens) - bs + 1, bs):
            key = (parent, tuple(tokens[start : start + bs]))
            block_hash = memo.get(key)
            if block_hash is None:
                block_hash = memo[key] = hash_block_tokens(sha256, parent, key[1])
            out.append(block_hash)
            parent = block_hash
        return out

    def register(self, request_id: str, tokens: list[int]) -> None:
        """Precompute the block hashes of an extra request (a warm-up)."""
        self.hashes[request_id] = self._hash_chain(tokens)

    def hasher(self, request: Request) -> list[BlockHash]:
        """vLLM block_hasher: the request's new full-block hashes, precomputed."""
        have = len(request.block_hashes)
        return self.hashes[request.request_id][have : request.num_tokens // self.block_size]

    # -- workload facts --------------------------------------------------------------------

    def anchor_hit_tokens(self, index: int, hit: int) -> int:
        return sum(max(0, min(hi, hit) - lo) for lo, hi in self.anchor_spans[index])

    def anchor_segments(self, request: TapeRequest) -> tuple[tuple[str, int], ...]:
        """The request's leading anchor segments (what a warm-up coordinator records per agent)."""
        out = []
        for key, n in request.segments:
            if segment_kind(key) != "anchor":
                break
            out.append((key, n))
        return tuple(out)

    def is_handoff(self, request: TapeRequest) -> bool:
        """True if the session continues with another dispatch (a new step) after this request."""
        index = self._index_of(request)
        following = self.next_in_session[index]
        return following is not None and (request.step is None or self.requests[following].step != request.step)

    def is_tool_call(self, request: TapeRequest) -> bool | None:
        """Whether the request's answer was a tool call (the session's next request continues its
        dispatch), as the response's finish_reason tells the server; None for a tape without steps."""
        if request.step is None:
            return None
        following = self.next_in_session[self._index_of(request)]
        return following is not None and self.requests[following].step == request.step \
            and self.requests[following].agent == request.agent

    def _index_of(self, request: TapeRequest) -> int:
        if not hasattr(self, "_indices"):
            self._indices = {r.id: i for i, r in enumerate(self.requests)}
        return self._indices[request.id]

    @property
    def topology_name(self) -> str | None:
        name = self.tape.header.get("workload", {}).get("topology")
        return name if name in TOPOLOGIES else None

    def agents(self) -> list[str]:
        return list(dict.fromkeys(r.agent for r in self.requests))

    @property
    def header_graph(self) -> dict[str, Any] | None:
        """The tape header's declared graph (``graph``, validated by ``read_tape``), if any."""
        graph = self.tape.header.get("graph")
        return graph if isinstance(graph, dict) else None

    def declared_graph(self) -> dict[str, set[str]]:
        """The graph the app declares: the header's ``graph`` (every possible transition), else
        the named topology's (its support); for a tape with neither, the complete graph over its agents."""
        graph = self.header_graph
        if graph is not None:
            out: dict[str, set[str]] = {a: set() for a in graph["nodes"]}
            for a, b in graph.get("edges", []):
                out[a].add(b)
            return out
        name = self.topology_name
        if name is None:
            agents = self.agents()
            return {a: set(agents) for a in agents}
        matrix = topology(name).matrix
        return {a: {b for j, b in enumerate(AGENTS) if matrix[i, j] > 1e-12} for i, a in enumerate(AGENTS)}

    def entry_agents(self) -> list[str]:
        graph = self.header_graph
        if graph is not None and graph.get("entry"):
            return list(graph["entry"])
        return list(dict.fromkeys(r.agent for r in self.requests if r.parent == ""))

    def graph_event(self) -> dict[str, Any] | None:
        """The ``graph`` event the app would send (ids outside the wire alphabet left out); None without a graph."""
        if self.header_graph is None and self.topology_name is None:
            return None
        graph = {a: {b for b in succ if _fits_wire(b)} for a, succ in self.declared_graph().items() if _fits_wire(a)}
        edges = sorted([a, b] for a, succ in graph.items() if len(succ) == 1 for b in succ)
        conditional = sorted([a, b] for a, succ in graph.items() if len(succ) > 1 for b in succ)
        name = f"tape-{self.tape.name}" if self.topology_name is None else f"topology-{self.topology_name}"
        return {"type": "graph", "id": _NOT_WIRE.sub("-", name)[:128], "nodes": list(graph),
                "edges": edges, "conditional_edges": conditional,
                "entry": [a for a in self.entry_agents() if a in graph]}


def _fits_wire(value: str) -> bool:
    try:
        validate_id(value, "agent")
    except ProtocolError:
        return False
    return True


@dataclass
class ReplayResult:
    tape: str
    policy: str
    capacity: int
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    anchor_tokens: int = 0
    anchor_hit_tokens: int = 0
    prefill_tokens: int = 0  # foreground prompt tokens computed
    warmup_tokens: int = 0  # prompt tokens computed by warm-ups
    warmups: int = 0
    evictions: int = 0
    evictions_by_kind: dict[str, int] = field(default_factory=lambda: {"anchor": 0, "history": 0})
    mean_wait_s: float = 0.0
    max_wait_s: float = 0.0
    makespan_s: float = 0.0
    wall_s: float = 0.0
    policy_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def anchor_hit_rate(self) -> float:
        return self.anchor_hit_tokens / self.anchor_tokens if self.anchor_tokens else 0.0

    @property
    def history_hit_rate(self) -> float:
        history = self.prompt_tokens - self.anchor_tokens
        return (self.hit_tokens - self.anchor_hit_tokens) / history if history else 0.0

    @property
    def computed_tokens(self) -> int:
        return self.prefill_tokens + self.warmup_tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "tape": self.tape,
            "policy": self.policy,
            "capacity": self.capacity,
            "hit_rate": round(self.hit_rate, 6),
            "anchor_hit_rate": round(self.anchor_hit_rate, 6),
            "history_hit_rate": round(self.history_hit_rate, 6),
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "anchor_tokens": self.anchor_tokens,
            "anchor_hit_tokens": self.anchor_hit_tokens,
            "prefill_tokens": self.prefill_tokens,
            "warmup_tokens": self.warmup_tokens,
            "computed_tokens": self.computed_tokens,
            "warmups": self.warmups,
            "evictions": self.evictions,
            "evictions_by_kind": dict(self.evictions_by_kind),
            "mean_wait_s": round(self.mean_wait_s, 4),
            "max_wait_s": round(self.max_wait_s, 4),
            "makespan_s": round(self.makespan_s, 3),
            "wall_s": round(self.wall_s, 3),
            "policy_stats": self.policy_stats,
        }


_ARRIVE, _FINISH, _RELEASE = 0, 1, 2  # _RELEASE: free a warm-up or an expired pin


class CapacityError(RuntimeError):
    """The KV cache cannot hold a request even when empty."""


class Replay:
    """One policy on one tape at one capacity (num_blocks)."""

    def __init__(self, plan: TapePlan, policy: Policy, num_blocks: int, time_model: TimeModel | None = None) -> None:
        if num_blocks - 1 < plan.max_request_blocks:
            raise CapacityError(f"{num_blocks} blocks cannot hold the tape's largest request "
                                f"({plan.max_request_blocks} blocks + the null block)")
        self.plan = plan
        self.policy = policy
        self.time_model = time_model or _time_model_of(plan.tape)
        self.kv = make_manager(num_blocks, plan.block_size)
        self.pool = self.kv.block_pool
        self.now = 0.0
        self.next_index = 0  # the next request to start (requests start in tape order)
        n = len(plan.requests)
        self.arrived: list[float | None] = [None] * n
        self.live: dict[int, Request] = {}
        self.result = ReplayResult(plan.tape.name, policy.name, num_blocks)
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._warmup_ids = 0
        self._waits: list[float] = []
        self.running = 0  # requests and warm-ups holding blocks
        evict = self.pool._maybe_evict_cached_block
        kinds = plan.kind_of_hash

        def counting_evict(block: Any) -> bool:
            block_hash = block.block_hash
            evicted = evict(block)
            if evicted:
                self.result.evictions += 1
                kind = kinds.get(get_block_hash(block_hash), "history")
                self.result.evictions_by_kind[kind] += 1
            return evicted

        self.pool._maybe_evict_cached_block = counting_evict  # type: ignore[method-assign]

    def clock(self) -> float:
        return self.now

    def _push(self, at: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, kind, payload))

    # -- the simulation ---------------------------------------------------------------------

    def run(self) -> ReplayResult:
        started = time.perf_counter()
        self.policy.install(self)
        seen: set[str] = set()
        for index, request in enumerate(self.plan.requests):
            if request.session not in seen:
                seen.add(request.session)
                self._push(request.t, _ARRIVE, index)
        while self._events:
            at, _, kind, payload = heapq.heappop(self._events)
            self.now = at
            if kind == _ARRIVE:
                self._arrive(payload)
            elif kind == _FINISH:
                self.running -= 1
                self._finish(payload)
            else:
                self.running -= 1
                self.kv.free(payload)
            self._schedule()
        if self.next_index != len(self.plan.requests):
            raise RuntimeError(f"replay stalled at request {self.next_index}")
        result = self.result
        result.mean_wait_s = float(np.mean(self._waits)) if self._waits else 0.0
        result.max_wait_s = max(self._waits, default=0.0)
        result.makespan_s = self.now
        result.policy_stats = self.policy.stats()
        result.wall_s = time.perf_counter() - started
        return result

    def _arrive(self, index: int) -> None:
        record = self.plan.requests[index]
        tag = None
        if self.policy.tagged:
            try:
                tag = AgentTag(record.agent, record.session, record.parent, record.step).to_xargs()
            except ProtocolError:
                tag = None  # ids outside the wire format's alphabet: served untagged
        params = SamplingParams(max_tokens=record.output_tokens, extra_args=tag)
        session = record.session if self.policy.tagged else None  # untagged: no X-Session-ID either
        request = Request(record.id, self.plan.prompts[index], params, None, arrival_time=self.now,
                          block_hasher=self.plan.hasher, session_id=session)
        self.live[index] = request
        self.arrived[index] = self.now
        self.policy.on_arrival(self, request, record)

    def _schedule(self) -> None:
        requests, arrived = self.plan.requests, self.arrived
        refreshed = False
        while self.next_index < len(requests) and arrived[self.next_index] is not None:
            if not refreshed:
                self.policy.before_schedule(self)
                refreshed = True
            if not self._start(self.next_index):
                if not self.running:
                    need = len(self.plan.prompts[self.next_index]) + self.plan.requests[self.next_index].output_tokens
                    raise CapacityError(f"request {self.next_index} ({need} tokens) does not fit in an idle cache")
                return
            self.next_index += 1

    def _start(self, index: int) -> bool:
        request, record = self.live[index], self.plan.requests[index]
        prompt = request.num_tokens
        computed, hit, _ = self.kv.get_computed_blocks(request)
        blocks = self.kv.allocate_slots(request, prompt - hit, hit, computed,
                                        num_lookahead_tokens=record.output_tokens - 1)
        if blocks is None:
            return False
        self.kv.record_prefix_cache_stats(request, hit)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = prompt
        result = self.result
        result.requests += 1
        result.prompt_tokens += prompt
        result.hit_tokens += hit
        result.anchor_tokens += self.plan.anchor_hit_tokens(index, prompt)
        result.anchor_hit_tokens += self.plan.anchor_hit_tokens(index, hit)
        result.prefill_tokens += prompt - hit
        self._waits.append(self.now - (self.arrived[index] or 0.0))
        self.policy.on_start(self, request, record)
        self.running += 1
        self._push(self.now + self.time_model.duration(prompt - hit, record.output_tokens), _FINISH, index)
        return True

    def _finish(self, index: int) -> None:
        request, record = self.live.pop(index), self.plan.requests[index]
        prompt = request.num_tokens
        request.append_output_token_ids(self.plan.outputs[index])
        if record.output_tokens > 1:  # the KV of all output tokens but the last one sampled
            assert self.kv.allocate_slots(request, record.output_tokens - 1) is not None
        request.num_computed_tokens = prompt + record.output_tokens - 1
        self.policy.before_free(self, request, record)
        request.status = RequestStatus.FINISHED_STOPPED
        pin = self.policy.pin_for(self, request, record)
        if pin > 0:
            self.running += 1  # the pin holds blocks like a running request
            self._push(self.now + pin, _RELEASE, request)
        else:
            self.kv.free(request)
        self.policy.on_finish(self, request, record)
        following = self.plan.next_in_session[index]
        if following is None:
            if not record.abandoned:  # an abandoned session's app never says it ended
                self.policy.on_session_end(self, record.session)
        else:
            self._push(max(self.plan.requests[following].t, self.now + record.tool_gap), _ARRIVE, following)

    def waiting(self) -> bool:
        """A request has arrived and waits to start (the coordinator's ``busy`` gate)."""
        return self.next_index < len(self.arrived) and self.arrived[self.next_index] is not None

    def warmup(self, agent: str, segments: Sequence[tuple[str, int]], add_request: Callable[[Request], None]) -> bool:
        """Issue a warm-up request for ``segments`` now (prefill only, max_tokens=1).

        ``add_request`` is the policy's scheduler hook. False (nothing issued) when the
        blocks do not fit without waiting.
        """
        self._warmup_ids += 1
        request_id = f"warmup-{self._warmup_ids}"
        tokens = self.plan.tokens_of(segments)
        self.plan.register(request_id, tokens)
        tag = AgentTag(agent, warmup=True).to_xargs()
        request = Request(request_id, tokens, SamplingParams(max_tokens=1, extra_args=tag), None,
                          arrival_time=self.now, block_hasher=self.plan.hasher)
        add_request(request)
        self.policy.before_schedule(self)
        computed, hit, _ = self.kv.get_computed_blocks(request)
        if self.kv.allocate_slots(request, len(tokens) - hit, hit, computed) is None:
            return False
        self.kv.record_prefix_cache_stats(request, hit)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = len(tokens)
        self.result.warmups += 1
        self.result.warmup_tokens += len(tokens) - hit
        self.running += 1
        self._push(self.now + self.time_model.duration(len(tokens) - hit, 1), _RELEASE, request)
        return True


def _time_model_of(tape: Tape) -> TimeModel:
    raw = tape.header.get("workload", {}).get("time_model")
    if isinstance(raw, dict):
        try:
            return TimeModel(**raw)
        except TypeError:
            pass
    return TimeModel()


def replay(plan: TapePlan, policy: str | Policy, num_blocks: int, **options: Any) -> ReplayResult:
    """Replay ``plan`` under one policy (a name or an instance) at one capacity."""
    instance = make_policy(policy, **options) if isinstance(policy, str) else policy
    return Replay(plan, instance, num_blocks).run()


# -- the sweep: tapes x capacities x policies, with the pressure preflight ------------------


_PLANS: dict[str, TapePlan] = {}


def _plan(path: str) -> TapePlan:
    plan = _PLANS.get(path)
    if plan is None:
        from .tape import read_tape

        plan = _PLANS[path] = TapePlan(read_tape(path))
    return plan


def _cell(path: str, policy: str, capacity: int, ttl: float | None) -> dict[str, Any]:
    result = replay(_plan(path), policy, capacity, ttl=ttl)
    out = result.to_json()
    out["tape"] = _plan(path).tape.name
    return out


def candidate_capacities(plan: TapePlan, multipliers: Sequence[float] = DEFAULT_MULTIPLIERS) -> list[int]:
    """Capacities in blocks: multiples of the tape's largest request (+1 for vLLM's null block), rounded to 10."""
    return sorted({round(m * plan.max_request_blocks / 10.0) * 10 + 1 for m in multipliers
                   if m * plan.max_request_blocks >= plan.max_request_blocks})


def sweep(paths: Sequence[str], *, policies: Sequence[str] = DEFAULT_POLICIES, capacities: Sequence[int] | None = None,
          multipliers: Sequence[float] = DEFAULT_MULTIPLIERS, margin: float = DEFAULT_MARGIN, preflight: bool = True,
          skip_dropped: bool = False, ttl: float | None = None, jobs: int = 2, progress: bool = True) -> dict[str, Any]:
    """Run every (tape, capacity, policy) cell; returns the report dict (see report.markdown)."""
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm

    tapes = []
    for path in paths:
        plan = _plan(path)
        caps = sorted(set(capacities)) if capacities else candidate_capacities(plan, multipliers)
        caps = [c for c in caps if c - 1 >= plan.max_request_blocks]
        tapes.append({"path": path, "name": plan.tape.name, "topology": plan.topology_name,
                      "target_r": plan.tape.header.get("target_predictability"), "summary": plan.tape.summary(),
                      "max_request_blocks": plan.max_request_blocks, "anchor_blocks": plan.anchor_blocks,
                      "candidates": caps, "kept": list(caps)})
    names = [t["name"] for t in tapes]
    if len(set(names)) != len(names):
        raise ValueError(f"tape names must differ (header 'name'): {names}")
    first = [p for p in ("lru", "belady") if p in policies or preflight]
    rest = [p for p in policies if p not in first]
    results: list[dict[str, Any]] = []
    total = sum(len(t["candidates"]) for t in tapes) * (len(first) + len(rest))
    bar = tqdm(total=total, desc="replay", unit="cell", disable=not progress, file=sys.stderr)
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=_mp_context()) if jobs > 1 else None

    def run(cells: list[tuple[str, str, int]]) -> None:
        if pool is None:
            for path, policy, cap in cells:
                results.append(_cell(path, policy, cap, ttl))
                bar.update(1)
            return
        futures = [pool.submit(_cell, path, policy, cap, ttl) for path, policy, cap in cells]
        for future in futures:
            results.append(future.result())
            bar.update(1)

    try:
        run([(t["path"], p, c) for t in tapes for c in t["candidates"] for p in first])
        if preflight:
            done = _index(results)
            for t in tapes:
                t["kept"] = [c for c in t["candidates"]
                             if 100 * (done[t["name"], c, "belady"] - done[t["name"], c, "lru"]) >= margin]
        cells = [(t["path"], p, c) for t in tapes
                 for c in (t["kept"] if skip_dropped else t["candidates"]) for p in rest]
        bar.total = len(results) + len(cells)
        bar.refresh()
        run(cells)
    finally:
        if pool is not None:
            pool.shutdown()
    bar.close()
    order = {p: i for i, p in enumerate(policies)}
    results.sort(key=lambda r: (names.index(r["tape"]), r["capacity"], order.get(r["policy"], len(order))))
    results = [r for r in results if r["policy"] in order]
    report = {"policies": list(policies), "margin": margin, "preflight": preflight, "tapes": tapes, "results": results}
    from .report import targets

    report["targets"] = targets(report)
    return report


def _index(results: Sequence[dict[str, Any]]) -> dict[tuple[str, int, str], float]:
    return {(r["tape"], r["capacity"], r["policy"]): r["hit_rate"] for r in results}


def _mp_context() -> Any:
    import multiprocessing

    # fork shares the imported vLLM with the workers (spawn would re-import it per worker)
    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
