"""``AGENTKV_ENABLED=0`` on a real KVCacheManager: exact LRU, and evictions are still counted.

vLLM's own KV events (``BlockRemoved``) are the independent record of what the pool evicted.
"""

from __future__ import annotations

import torch
from vllm.distributed.kv_events import BlockRemoved
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from server_patch._runtime import AgentKVRuntime, RuntimeConfig

from .test_runtime import BS, NUM_BLOCKS, free_order, pipeline_sessions, replay, request, run


def evented_manager(num_blocks: int) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    return KVCacheManager(config, max_model_len=8192, scheduler_block_size=BS, hash_block_size=BS,
                          enable_kv_cache_events=True)


def removed_blocks(kv: KVCacheManager) -> int:
    return sum(len(event.block_hashes) for event in kv.take_events() if isinstance(event, BlockRemoved))


def test_disabled_runtime_counts_every_block_lru_evicts_and_keeps_lru_order():
    vanilla_kv = evented_manager(NUM_BLOCKS)
    vanilla_hits = replay(vanilla_kv, None, 5)
    vanilla_removed = removed_blocks(vanilla_kv)

    kv = evented_manager(NUM_BLOCKS)
    runtime = AgentKVRuntime(RuntimeConfig(enabled=False))
    runtime.install(kv)
    assert replay(kv, runtime, 5) == vanilla_hits  # exact LRU: same hits, same free order
    assert free_order(kv) == free_order(vanilla_kv)
    assert runtime.queues == [] and runtime.policy == "lru"

    evictions = runtime.stats()["evictions"]
    assert vanilla_removed > 0
    assert sum(evictions.values()) == removed_blocks(kv) == vanilla_removed
    # session_end arrived for every session (replay sends it): their history counts as retired
    assert evictions["retired"] > 0 and evictions["untagged"] == 0


def test_disabled_runtime_counts_an_evicted_prompt_that_then_misses():
    kv = evented_manager(NUM_BLOCKS)
    runtime = AgentKVRuntime(RuntimeConfig(enabled=False))
    runtime.install(kv)
    sessions = list(pipeline_sessions(3))
    _, _, first_tokens, first_tag = sessions[0]
    run(kv, runtime, request(first_tokens, first_tag))
    assert run(kv, runtime, request(first_tokens, first_tag)) > 0  # cached
    for _, _, tokens, tag in sessions[1:]:
        run(kv, runtime, request(tokens, tag))
    assert run(kv, runtime, request(first_tokens, None)) == 0  # pushed out by LRU
    assert sum(runtime.stats()["evictions"].values()) == removed_blocks(kv) > 0
