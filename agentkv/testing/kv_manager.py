"""A real vLLM ``KVCacheManager`` for tests: one full-attention group, no model, no device memory."""

from __future__ import annotations

import torch
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

__all__ = ["kv_cache_manager"]


def kv_cache_manager(num_blocks: int, block_size: int, *, max_model_len: int = 8192,
                     kv_cache_events: bool = False) -> KVCacheManager:
    """vLLM's manager over ``num_blocks`` blocks of ``block_size`` tokens (block 0 is vLLM's null block);
    ``kv_cache_events`` makes it record the events ``take_events`` returns."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    return KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=block_size,
                          hash_block_size=block_size, enable_kv_cache_events=kv_cache_events)
