"""Replay a tape through the real vLLM ``KVCacheManager`` on CPU: ``agentkv bench replay``.

A discrete-event simulation of one engine (docs/benchmarks.md, "Replay"): requests arrive when
their session's previous request and tool gap are done, start in tape order (so every policy
sees the same start order) as soon as ``allocate_slots`` succeeds, and hold their blocks for the
``TimeModel``'s duration. No model runs: vLLM's block pool, prefix hashing, hit lookup and
eviction are real.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_block_hash
from vllm.v1.request import Request, RequestStatus

from agentkv.protocol import AgentTag, ProtocolError

from .kv_manager import make_manager
from .plan import TapePlan
from .policies import make_policy
from .simulator import Policy
from .tape import Tape, TapeError, TimeModel

__all__ = ["CapacityError", "Replay", "ReplayResult", "replay", "time_model_of"]


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
        self.time_model = time_model or time_model_of(plan.tape)
        # a prompt may exceed the default model length: the simulated engine has no model to limit it
        self.kv = make_manager(num_blocks, plan.block_size,
                               max_model_len=max(1 << 16, plan.max_request_blocks * plan.block_size))
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
        for index in self.plan.conversation_starts:
            self._push(self.plan.requests[index].t, _ARRIVE, index)
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
        named = self.policy.tagged and self.policy.sessions
        if self.policy.tagged:
            try:
                tag = (AgentTag(record.agent, record.session, record.parent, record.step) if named
                       else AgentTag(record.agent)).to_xargs()
            except ProtocolError:
                tag = None  # a step beyond the wire format's bound: served untagged (ids are sanitized by TapePlan)
        params = SamplingParams(max_tokens=record.output_tokens, extra_args=tag)
        session = record.session if named else None  # untagged or agent only: no X-Session-ID either
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
        while request_id in self.plan.hashes:  # a tape request's id (the manager keys requests by id)
            request_id += "'"
        tokens = self.plan.tokens_of(segments)
        tag = AgentTag(agent, warmup=True).to_xargs()
        request = Request(request_id, tokens, SamplingParams(max_tokens=1, extra_args=tag), None,
                          arrival_time=self.now, block_hasher=self.plan.extra_hasher(tokens))
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


def time_model_of(tape: Tape) -> TimeModel:
    """The replay's time model: the header's ``workload.time_model`` if given (validated), else the default."""
    raw = tape.header.get("workload", {}).get("time_model")
    if not isinstance(raw, dict):
        return TimeModel()
    known = {name: raw[name] for name in ("prefill_tps", "tpot", "overhead") if name in raw}  # others: ignored
    model = TimeModel(**known)
    values = (model.prefill_tps, model.tpot, model.overhead)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values) \
            or model.prefill_tps <= 0 or model.tpot < 0 or model.overhead < 0:
        raise TapeError("workload.time_model needs prefill_tps > 0, tpot >= 0 and overhead >= 0 (finite numbers)")
    return model


def replay(plan: TapePlan, policy: str | Policy, num_blocks: int, **options: Any) -> ReplayResult:
    """Replay ``plan`` under one policy (a name or an instance) at one capacity."""
    instance = make_policy(policy, **options) if isinstance(policy, str) else policy
    return Replay(plan, instance, num_blocks).run()
