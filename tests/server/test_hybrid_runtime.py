"""Hybrid models on vLLM's own ``KVCacheManager``: several KV-cache groups share one block pool,
and a group's blocks may span several hash blocks (the unit anchors are learned in)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from agentkv.graph import Anchor, History
from agentkv.protocol import AgentTag
from server_patch._runtime import AgentKVRuntime, RuntimeConfig

HASH_BLOCK = 16
init_none_hash(sha256)
HASHER = get_request_block_hasher(HASH_BLOCK, sha256)
ANCHOR_BLOCKS = 8  # hash blocks
_ids = itertools.count()


def hybrid_manager(num_blocks: int, other: KVCacheSpec, *, other_first: bool = False) -> KVCacheManager:
    """Full attention in 16-token blocks beside ``other``, one pool (block 0 is the null block)."""
    full = FullAttentionSpec(block_size=HASH_BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["other"], other)]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups[::-1] if other_first
                           else groups)
    return KVCacheManager(config, max_model_len=8192, scheduler_block_size=other.block_size,
                          hash_block_size=HASH_BLOCK)


def call(kv: KVCacheManager, runtime: AgentKVRuntime, agent: str, session: str,
         history: int) -> tuple[int, tuple[list[int], ...]]:
    """One call: the agent's anchor, then 8 hash blocks of the session's own; (hit tokens, its
    block ids per group)."""
    tag = AgentTag(agent, session)
    base = 1_000 * (1 + "abcdefgh".index(agent))
    tokens = list(range(base, base + ANCHOR_BLOCKS * HASH_BLOCK)) + list(range(history, history + 8 * HASH_BLOCK))
    request = Request(f"r{next(_ids)}", tokens, SamplingParams(max_tokens=1, extra_args=tag.to_xargs()), None,
                      block_hasher=HASHER, session_id=session)
    runtime.on_add_request(request)
    runtime.refresh()
    computed, hit, _ = kv.get_computed_blocks(request)
    kv.record_prefix_cache_stats(request, hit)
    assert kv.allocate_slots(request, request.num_tokens - hit, hit, computed) is not None
    request.num_computed_tokens = request.num_tokens
    block_ids = kv.get_block_ids(request.request_id)
    request.status = RequestStatus.FINISHED_STOPPED
    kv.free(request)
    return hit, tuple(list(ids) for ids in block_ids)


def test_a_group_of_bigger_blocks_holds_the_anchor_in_fewer_of_them():
    """32-token blocks beside 16-token ones: an anchor of 8 hash blocks is the first 4 of the group's
    blocks there (before, the first 8, so half of every call's own history was kept as anchor)."""
    kv = hybrid_manager(200, FullAttentionSpec(block_size=2 * HASH_BLOCK, num_kv_heads=1, head_size=1,
                                               dtype=torch.float32))
    runtime = AgentKVRuntime(RuntimeConfig(refresh_interval=0.0))
    runtime.install(kv)
    calls = [call(kv, runtime, "a", f"s{n}", 100_000 + 1_000 * n) for n in range(3)]
    assert [hit for hit, _ in calls] == [0, ANCHOR_BLOCKS * HASH_BLOCK, ANCHOR_BLOCKS * HASH_BLOCK]
    assert runtime.anchors.length("a") == ANCHOR_BLOCKS
    full, big = calls[-1][1]
    kinds = [[type(runtime.tracker.group_of(kv.block_pool.blocks[i])) for i in ids] for ids in (full, big)]
    assert kinds == [[Anchor] * 8 + [History] * 8, [Anchor] * 4 + [History] * 4]


@pytest.mark.parametrize("window_first", [False, True])
def test_a_sliding_window_group_keeps_every_anchor_under_pressure(window_first):
    """Full attention beside a 32-token sliding window: the anchors of six agents called in turn by
    four sessions stay whole while the sessions' histories cycle through the pool."""
    window = SlidingWindowSpec(block_size=HASH_BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32,
                               sliding_window=2 * HASH_BLOCK)
    kv = hybrid_manager(120, window, other_first=window_first)
    runtime = AgentKVRuntime(RuntimeConfig(refresh_interval=0.0))
    runtime.install(kv)
    hits = []
    for turn in range(30):
        agent = "abcdef"[turn % 6]
        hits.append(call(kv, runtime, agent, f"s{turn % 4}", 100_000 + 1_000 * turn)[0])
    # every call after an agent's first two (its anchor is learned from the second) hits the anchor
    assert hits[12:] == [ANCHOR_BLOCKS * HASH_BLOCK] * 18
    stats = runtime.stats()
    assert stats["evictions"]["anchor"] == 0 < stats["evictions"]["history"]
    # the warm-ups' residency check reads full attention's blocks: the window caches the tail only
    assert [runtime.anchor_residency(agent) for agent in "abcdef"] == [(ANCHOR_BLOCKS, ANCHOR_BLOCKS)] * 6


@pytest.mark.parametrize("seed", range(6))
def test_anchors_stay_whole_when_calls_come_faster_than_the_refresh(seed):
    """The server test's workload (six agents passed along by four sessions) on a clock of uneven
    call times, most shorter than the refresh interval: a session's dispatch re-values its history
    at once. Before, its history kept the value of the agent it had been waiting for ("next")
    until a refresh, and a call in between evicted an anchor for it."""
    window = SlidingWindowSpec(block_size=HASH_BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32,
                               sliding_window=2 * HASH_BLOCK)
    kv = hybrid_manager(120, window)
    now = [0.0]
    runtime = AgentKVRuntime(RuntimeConfig(refresh_interval=0.1), clock=lambda: now[0])
    runtime.install(kv)
    durations = random.Random(seed).choices([0.02, 0.05, 0.2], k=72)
    hits = []
    for turn, duration in enumerate(durations):
        agent = "abcdef"[(turn // 4 + turn % 4) % 6]
        hits.append(call(kv, runtime, agent, f"s{turn % 4}", 100_000 + 1_000 * turn)[0])
        now[0] += duration
    assert min(hits[24:]) == ANCHOR_BLOCKS * HASH_BLOCK
    assert runtime.stats()["evictions"]["anchor"] == 0
