"""Microbenchmark: vanilla free queue vs ScoredFreeBlockQueue under eviction.

Every free block is cached, so each ``get_new_blocks`` evicts. One cycle
allocates one request's worth of blocks and frees them (reversed, as vLLM
does); only ``get_new_blocks`` + ``free_blocks`` are timed, re-caching the
blocks between cycles is not. Prints microseconds per allocated block.

    .venv/bin/python benchmarks/free_queue_bench.py [--blocks 4096] [--cycles 3000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.request import Request

from server_patch._free_queue import ScoredFreeBlockQueue

BS = 16
NUM_GROUPS = 8


def make_requests(count: int, blocks_per_req: int) -> list[Request]:
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    n_tok = blocks_per_req * BS
    return [
        Request(
            f"r{i}",
            list(range(i * n_tok, (i + 1) * n_tok)),
            SamplingParams(max_tokens=1),
            None,
            block_hasher=hasher,
        )
        for i in range(count)
    ]


def build_pool(
    num_blocks: int, blocks_per_req: int, reqs: list[Request], mode: str
) -> tuple[BlockPool, dict[int, int]]:
    """A pool whose free blocks are all cached; block_id -> group index."""
    pool = BlockPool(num_blocks + 1, enable_caching=True, hash_block_size=BS)
    group: dict[int, int] = {}
    if mode != "vanilla":
        queue = ScoredFreeBlockQueue.replace(pool, lambda b: group[b.block_id])
        # Distinct, non-trivial log scores so groups really interleave.
        queue.set_group_scores({g: 0.5 * g for g in range(NUM_GROUPS)})
        queue.enabled = mode == "scored"
    for i in range(num_blocks // blocks_per_req):
        cache(pool, reqs[i], pool.get_new_blocks(blocks_per_req), group, i)
    return pool, group


def cache(
    pool: BlockPool,
    req: Request,
    blocks: list[KVCacheBlock],
    group: dict[int, int],
    i: int,
) -> None:
    pool.cache_full_blocks(req, blocks, 0, len(blocks), BS, 0)
    for b in blocks:
        group[b.block_id] = i % NUM_GROUPS
    pool.free_blocks(reversed(blocks))


def run(
    num_blocks: int, blocks_per_req: int, cycles: int, reqs: list[Request], mode: str
) -> float:
    """Microseconds per allocated block for one configuration."""
    pool, group = build_pool(num_blocks, blocks_per_req, reqs, mode)
    assert pool.get_num_free_blocks() == num_blocks
    first = num_blocks // blocks_per_req
    now = time.perf_counter
    elapsed = 0.0
    for c in range(first, first + cycles):
        req = reqs[c % len(reqs)]
        t0 = now()
        blocks = pool.get_new_blocks(blocks_per_req)  # evicts cached blocks
        t1 = now()
        # Untimed: the request fills and caches its blocks (as the engine does).
        pool.cache_full_blocks(req, blocks, 0, blocks_per_req, BS, 0)
        for b in blocks:
            group[b.block_id] = c % NUM_GROUPS
        t2 = now()
        pool.free_blocks(reversed(blocks))  # cached: appended to the tail
        elapsed += (t1 - t0) + (now() - t2)
    assert pool.get_num_free_blocks() == num_blocks
    assert all(
        b.block_hash is not None for b in pool.free_block_queue.get_all_free_blocks()
    )
    return elapsed / (cycles * blocks_per_req) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--blocks-per-req", type=int, default=16)
    parser.add_argument("--cycles", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    # Enough distinct prompts that a recycled prompt's old blocks are gone.
    n_reqs = 2 * args.blocks // args.blocks_per_req + 1
    reqs = make_requests(n_reqs, args.blocks_per_req)
    modes = ["vanilla", "scored", "disabled"]
    results: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):  # interleaved, so drift hits all modes alike
        for mode in modes:
            results[mode].append(
                run(args.blocks, args.blocks_per_req, args.cycles, reqs, mode)
            )

    med = {m: statistics.median(v) for m, v in results.items()}
    print(
        f"{args.blocks} cached free blocks, {args.blocks_per_req} blocks/cycle, "
        f"{args.cycles} cycles x {args.repeats} repeats, {NUM_GROUPS} groups"
    )
    for mode in modes:
        spread = f"{min(results[mode]):.3f}-{max(results[mode]):.3f}"
        print(f"  {mode:9s} {med[mode]:7.3f} us/block (range {spread})")
    print(f"  scored / vanilla   = {med['scored'] / med['vanilla']:.2f}x")
    print(f"  disabled / vanilla = {med['disabled'] / med['vanilla']:.2f}x")


if __name__ == "__main__":
    main()
