"""Regression for a runtime finding of the replay benchmark (docs/benchmarks.md, "Findings").

An agent's tool loop sends several requests of one dispatch (same session, agent and step);
each re-sends the previous prompt plus the tool result. The runtime scored the history of
a session's current dispatch by P(the agent is dispatched again within the horizon), which
ignores that the dispatch itself may go on, so a tool loop's prefix was evicted before
blocks nobody would reuse. The runtime now learns, per agent, how often a request is
followed by another request of the same dispatch (``SessionTiming.continuation``) and counts
that in.
"""

from __future__ import annotations

import itertools

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from agentkv.bench.kv_manager import make_manager, serve_once
from agentkv.graph import ReuseConfig
from agentkv.protocol import AgentTag
from server_patch._runtime import AgentKVRuntime, RuntimeConfig

BS = 16
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)
ANCHOR = list(range(50_000, 50_000 + 4 * BS))  # the coder's anchor: 4 blocks
_ids = itertools.count()
_fresh = itertools.count(1_000_000)


def unique(blocks: int) -> list[int]:
    return [next(_fresh) for _ in range(blocks * BS)]


def manager(num_blocks: int) -> KVCacheManager:
    return make_manager(num_blocks, BS, max_model_len=8192)


def run(kv: KVCacheManager, runtime: AgentKVRuntime | None, tokens: list[int], tag: AgentTag | None = None) -> int:
    params = SamplingParams(max_tokens=1, extra_args=None if tag is None else tag.to_xargs())
    req = Request(f"r{next(_ids)}", tokens, params, None, block_hasher=HASHER,
                  session_id=None if tag is None else tag.session)
    if runtime is not None:
        runtime.on_add_request(req)
        runtime.refresh()
    return serve_once(kv, req)


def tool_loop_hit(runtime: AgentKVRuntime | None) -> int:
    """Hit of a tool loop's second call after untagged traffic pressed the cache."""
    kv = manager(64)
    if runtime is not None:
        runtime.install(kv)
        for s in range(6):  # history: supervisor, then coder in a 3-call tool loop, then reviewer
            session = f"t{s}"
            run(kv, runtime, [*unique(1), 7], AgentTag("supervisor", session, "", 0))
            for _ in range(3):
                run(kv, runtime, [*ANCHOR, *unique(1), 7], AgentTag("coder", session, "supervisor", 1))
            run(kv, runtime, [*unique(1), 7], AgentTag("reviewer", session, "coder", 2))
            runtime.apply_events({"version": 1, "events": [{"type": "session_end", "session": session}]})
    live = AgentTag("coder", "live", "supervisor", 1)
    run(kv, runtime, [*unique(1), 7], None if runtime is None else AgentTag("supervisor", "live", "", 0))
    prompt = [*ANCHOR, *unique(8), 7]  # the live dispatch's first call: anchor + 8 history blocks
    run(kv, runtime, prompt, live if runtime is not None else None)
    run(kv, runtime, [*unique(20), 7])  # untagged traffic, freed after the live call
    free = kv.block_pool.get_num_free_blocks()
    run(kv, runtime, [*unique(free - 12 - 20 + 8 - 1), 7])  # needs every other block + 8 of those 32
    return run(kv, runtime, prompt + unique(2), live if runtime is not None else None)  # the tool returned


def test_a_tool_loop_keeps_its_prefix():
    runtime = AgentKVRuntime(RuntimeConfig(reuse=ReuseConfig(steps=2), refresh_interval=0.0), clock=lambda: 0.0)
    assert tool_loop_hit(runtime) == (4 + 8) * BS  # anchor and history survive the pressure
    # 6 x 2 repeats + the live one, 6 hand-offs (decayed counts: the older weigh a little less)
    assert runtime.timing.continuation("coder") == pytest.approx(13 / 19, rel=1e-2)
    assert runtime.timing.continuation("supervisor") == 0.0


def test_before_the_fix_the_prefix_was_evicted_first(monkeypatch):
    runtime = AgentKVRuntime(RuntimeConfig(reuse=ReuseConfig(steps=2), refresh_interval=0.0), clock=lambda: 0.0)
    monkeypatch.setattr(runtime.timing, "continuation", lambda agent: 0.0)  # the runtime as it was
    assert tool_loop_hit(runtime) == 4 * BS  # only the anchor: the 8 history blocks went first
    assert tool_loop_hit(None) < (4 + 8) * BS  # vanilla LRU loses it too (older than the untagged blocks)
