"""Eviction hot path, vanilla vLLM vs the agentkv runtime, same run (µs per allocated block).

Each cycle admits one tagged request with a unique prompt the way the scheduler does
(``get_computed_blocks`` + ``record_prefix_cache_stats`` + ``allocate_slots``) into a pool
whose free blocks are all cached, so every allocated block is an eviction, then frees it.
The agentkv variant runs the real ``server_patch`` runtime (hooks, block tracker, scored
queue). Three figures per mode: the allocation path per allocated block (the KV cache manager's
calls with agentkv's hooks and queue in them), the admission of a request (``on_add_request``:
parsing its tag, the learner, the session timing, anchor lengths, recognition; once per request
whatever its size) per request, and both together per block (admission spread over this run's
blocks per request). The refresh (the next-use model evaluated and the queue's groups
re-scored: exactly what the scheduler calls) runs once per scheduler step, not per block, so it
is timed apart: here every request is its own step and changes the model (the worst case).

    .venv/bin/python benchmarks/eviction_hot_path.py [--blocks 4096] [--cycles 2000] [--agents 24] [--sessions 100]
        [--refresh-interval SECONDS] [--cold-bytes N] [--parts]

``--cold-bytes N`` overwrites an N-byte buffer before every request in every mode, so that each
allocation starts with CPU caches as cold as after other work (an engine step's input
preparation and output processing); by default the loop runs hot, which flatters vanilla's
few microseconds most.

``--parts`` instead times the pieces agentkv adds to the allocation path, one agentkv run with a
timer around each (the timer's own ~0.3 µs per call included), in µs per request.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
from collections import Counter
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from agentkv.bench.kv_manager import make_manager, serve_once
from agentkv.protocol import AgentTag
from server_patch._free_queue import ScoredFreeBlockQueue
from server_patch._runtime import AgentKVRuntime, RuntimeConfig
from server_patch._tracker import BlockTracker

BS = 16
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def manager(num_blocks: int) -> KVCacheManager:
    return make_manager(num_blocks + 1, BS)


def requests(count: int, blocks: int, agents: int, sessions: int) -> list[Request]:
    names = [f"agent-{i}" for i in range(agents)]
    out = []
    for i in range(count):
        agent = names[i % agents]
        tag = AgentTag(agent, f"s{i % sessions}", names[(i - 1) % agents], i)
        tokens = list(range(i * blocks * BS, (i + 1) * blocks * BS))
        out.append(Request(f"r{i}", tokens, SamplingParams(max_tokens=1, extra_args=tag.to_xargs()), None,
                           block_hasher=HASHER, session_id=tag.session))
    return out


def run(mode: str, num_blocks: int, blocks: int, cycles: int, agents: int, sessions: int,
        refresh_interval: float, cold_bytes: int = 0) -> tuple[float, float, float]:
    """(µs per allocated block on the allocation path, µs per admission, µs per refresh)."""
    gc.collect()  # the previous run's manager and runtime (cycles) must not weigh on this run's collections
    kv = manager(num_blocks)
    runtime = None
    if mode != "vanilla":
        runtime = AgentKVRuntime(RuntimeConfig(enabled=mode != "agentkv-disabled", recognize=mode != "agentkv-norecog",
                                               refresh_interval=refresh_interval), background=True)  # as served
        runtime.install(kv)
    reqs = requests(num_blocks // blocks + cycles, blocks, agents, sessions)
    allocation = admission = refresh = 0.0
    scratch, fresh = bytearray(cold_bytes), bytes(cold_bytes)
    for index, req in enumerate(reqs):
        scratch[:] = fresh  # untimed: evicts the caches (a no-op without --cold-bytes)
        start = time.thread_time()
        if runtime is not None:
            runtime.on_add_request(req)
            admitted = time.thread_time()
            runtime.refresh()
            refreshed = time.thread_time()
        allocating = time.thread_time()
        serve_once(kv, req)
        if index >= num_blocks // blocks:  # the pool is full of cached blocks: every block evicts
            allocation += time.thread_time() - allocating
            if runtime is not None:
                admission += admitted - start
                refresh += refreshed - admitted
    return allocation / (cycles * blocks) * 1e6, admission / cycles * 1e6, refresh / cycles * 1e6


# (owner, method, label): what agentkv runs on the allocation path, for --parts
PARTS: tuple[tuple[type, str, str], ...] = (
    (ScoredFreeBlockQueue, "_attach", "queue: attach freed blocks to their groups"),
    (ScoredFreeBlockQueue, "_index", "  of which: index a new group by session"),
    (ScoredFreeBlockQueue, "_push_head", "queue: heap entry of a group head"),
    (ScoredFreeBlockQueue, "_drop", "queue: drop an emptied group"),
    (ScoredFreeBlockQueue, "_pop_min_run", "queue: pop in key order"),
    (ScoredFreeBlockQueue, "_report_evictions", "eviction report"),
    (BlockTracker, "evicted", "  of which: tracker's eviction count"),
    (BlockTracker, "cached", "tracker: newly cached blocks"),
    (AgentKVRuntime, "_finished", "finish: session timing"),
    (AgentKVRuntime, "_count_traffic", "traffic counters"),
    (AgentKVRuntime, "_note_warmup", "warm-up ledger"),
)


def parts(num_blocks: int, blocks: int, cycles: int, agents: int, sessions: int, refresh_interval: float) -> None:
    """Print µs per request of each piece in PARTS, timed inside the allocation path only."""
    spent: Counter[str] = Counter()
    inside = [False]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in PARTS]

    def timed(method: Any, label: str) -> Any:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not inside[0]:
                return method(*args, **kwargs)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start
        return wrapper

    for (owner, name, label), (_, _, method) in zip(PARTS, originals, strict=True):
        setattr(owner, name, timed(method, label))
    try:
        # as in run(): without it, the run pays the collector's first passes over vLLM's whole heap
        # (hundreds of thousands of objects from the imports), several times the path itself
        gc.collect()
        kv = manager(num_blocks)
        runtime = AgentKVRuntime(RuntimeConfig(refresh_interval=refresh_interval), background=True)
        runtime.install(kv)
        total = 0.0
        for index, req in enumerate(requests(num_blocks // blocks + cycles, blocks, agents, sessions)):
            runtime.on_add_request(req)
            runtime.refresh()
            measured = index >= num_blocks // blocks
            inside[0] = measured
            start = time.perf_counter()
            serve_once(kv, req)
            if measured:
                total += time.perf_counter() - start
            inside[0] = False
    finally:
        for owner, name, method in originals:
            setattr(owner, name, method)
    print(f"agentkv's allocation path, {cycles} requests of {blocks} blocks: {total / cycles * 1e6:.1f} µs per request")
    print("| piece | µs / request |")
    print("|---|---:|")
    for _, _, label in PARTS:
        print(f"| {label} | {spent[label] / cycles * 1e6:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--blocks-per-request", type=int, default=16)
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--agents", type=int, default=24)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--refresh-interval", type=float, default=RuntimeConfig().refresh_interval,
                        help="AGENTKV_REFRESH_INTERVAL (s; default: the runtime's)")
    parser.add_argument("--cold-bytes", type=int, default=0,
                        help="overwrite a buffer this large before each request (cold CPU caches; default 0)")
    parser.add_argument("--parts", action="store_true", help="time the pieces agentkv adds instead (one run)")
    args = parser.parse_args()
    if args.parts:
        parts(args.blocks, args.blocks_per_request, args.cycles, args.agents, args.sessions, args.refresh_interval)
        return
    modes = ("vanilla", "agentkv", "agentkv-norecog", "agentkv-disabled")
    samples: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    for _ in range(args.repeats):  # interleaved so machine noise hits every mode alike
        for mode in modes:
            samples[mode].append(run(mode, args.blocks, args.blocks_per_request, args.cycles, args.agents,
                                     args.sessions, args.refresh_interval, args.cold_bytes))
    print(f"eviction hot path: {args.blocks} cached blocks, {args.blocks_per_request} blocks/request, "
          f"{args.cycles} requests x {args.repeats} repeats, {args.sessions} sessions, {args.agents} agents (medians)"
          + (f", caches cold ({args.cold_bytes:,} bytes overwritten before each request)" if args.cold_bytes else ""))
    per_request = args.blocks_per_request
    print("| mode | allocation path µs / block | ratio to vanilla | admission µs / request | with admission: "
          f"µs / block ({per_request} blocks / request) | ratio to vanilla | refresh µs / step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    vanilla = [a for a, _, _ in samples["vanilla"]]
    for mode in modes:
        rows = samples[mode]
        combined = [a + b / per_request for a, b, _ in rows]
        # each repeat's ratio to the vanilla run just before it, then the median: the load of a
        # shared machine drifts between repeats more than within one
        ratio = statistics.median(a / v for (a, _, _), v in zip(rows, vanilla, strict=True))
        combined_ratio = statistics.median(c / v for c, v in zip(combined, vanilla, strict=True))
        admission = "-" if mode == "vanilla" else f"{statistics.median(b for _, b, _ in rows):.1f}"
        step = "-" if mode == "vanilla" else f"{statistics.median(r for _, _, r in rows):.0f}"
        print(f"| {mode} | {statistics.median(a for a, _, _ in rows):.2f} | {ratio:.2f}x | {admission} | "
              f"{statistics.median(combined):.2f} | {combined_ratio:.2f}x | {step} |")


if __name__ == "__main__":
    main()
