"""A real vLLM ``KVCacheManager`` without a model: the replay's engine and the tests' fixture."""

from __future__ import annotations

import torch
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

__all__ = ["make_manager", "serve_once"]


def make_manager(num_blocks: int, block_size: int, *, max_model_len: int = 1 << 16,
                 enable_kv_cache_events: bool = False) -> KVCacheManager:
    """A KVCacheManager for one full-attention group of ``num_blocks`` blocks (block 0 is vLLM's null block)."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    return KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=block_size,
                          hash_block_size=block_size, enable_kv_cache_events=enable_kv_cache_events)


def serve_once(kv: KVCacheManager, request: Request) -> int:
    """Admit, prefill and free one request the way the scheduler does; its prefix-cache hit tokens."""
    computed, hit, _ = kv.get_computed_blocks(request)
    kv.record_prefix_cache_stats(request, hit)
    assert kv.allocate_slots(request, request.num_tokens - hit, hit, computed) is not None
    request.num_computed_tokens = request.num_tokens
    request.status = RequestStatus.FINISHED_STOPPED
    kv.free(request)
    return hit
