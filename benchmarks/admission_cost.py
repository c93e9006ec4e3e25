"""What admitting a request costs the agentkv runtime by what the client tags (µs per request).

``on_add_request`` runs once per request on the scheduler's thread: it parses the tag, teaches the
learner, the session timing and the anchor lengths, and, for a request that names no session
(agent-only tags, or none), runs recognition (the prefix tree, the history's content-defined
chunks, the session they continue). ``benchmarks/eviction_hot_path.py`` times it for fully tagged
requests only; this times it for each kind of client on the same traffic, in one run:

* ``conversations``: ``--agents`` agents with anchors of ``--anchor-blocks`` blocks, ``--conversations``
  live conversations in random order, each turn adding ``--turn-blocks`` blocks to its history, a
  conversation ending after ``--turns`` turns and a new one taking its place;
* ``one-off``: every prompt is an anchor and ``--turns`` x ``--turn-blocks`` blocks seen nowhere
  else (the prefix tree gains a node per block past the anchor: recognition's worst case).

Each run is a fresh runtime and pool (``--blocks`` blocks, real vLLM ``KVCacheManager``), the
heap frozen after they are built as vLLM's engine core freezes its own after start-up (the
collector then skips the imports' hundreds of thousands of objects; recognition, which allocates
a tree node per new block, costs up to twice as much without); the first half of its
``--requests`` teaches the runtime, the second half is timed (thread time).
Runs are interleaved over the tag kinds ``--repeats`` times; each ratio is to the fully tagged run
of the same repeat and shape, given as its median and its range over the repeats (with 5 repeats
the range holds the true median with probability 1 - 2 / 2^5 = 94%).

    .venv/bin/python benchmarks/admission_cost.py [--repeats 5] [--requests 4000]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Iterator

from eviction_hot_path import BS, HASHER, manager  # the sibling script: run as python benchmarks/admission_cost.py
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from agentkv.bench.kv_manager import serve_once
from agentkv.protocol import AgentTag
from server_patch._runtime import AgentKVRuntime, RuntimeConfig

TAGS = ("full", "agent-only", "none")
SHAPES = ("conversations", "one-off")


def traffic(shape: str, count: int, args: argparse.Namespace) -> Iterator[tuple[str, str, list[int]]]:
    """(agent, conversation, prompt tokens) of ``count`` requests, the same every run; every prompt ends mid-block."""
    rng = random.Random(0)
    live = args.conversations
    turn = [rng.randrange(args.turns) for _ in range(live)]  # conversations start at staggered turns
    serial = list(range(live))
    for i in range(count):
        slot = rng.randrange(live)
        turn[slot] += 1
        if turn[slot] > args.turns or shape == "one-off":
            turn[slot] = args.turns if shape == "one-off" else 1
            serial[slot] += live
        agent = serial[slot] % args.agents
        anchor_at = 10_000_000 + agent * args.anchor_blocks * BS
        history_at = 20_000_000 + (i if shape == "one-off" else serial[slot]) * (args.turns * args.turn_blocks + 1) * BS
        yield (f"agent-{agent}", f"c{serial[slot]}",
               [*range(anchor_at, anchor_at + args.anchor_blocks * BS),
                *range(history_at, history_at + turn[slot] * args.turn_blocks * BS + BS // 2)])


def run(shape: str, tags: str, args: argparse.Namespace) -> float:
    """µs per admission over the second half of one fresh runtime's requests."""
    kv = manager(args.blocks)
    runtime = AgentKVRuntime(RuntimeConfig(), background=True)  # as served: recognition on
    runtime.install(kv)
    gc.collect()
    gc.freeze()  # as the engine core freezes its startup heap (vllm's freeze_gc_heap): collections skip it
    spent, timed = 0.0, 0
    try:
        for i, (agent, conversation, tokens) in enumerate(traffic(shape, args.requests, args)):
            tag = None if tags == "none" else AgentTag(agent, conversation if tags == "full" else None)
            request = Request(f"r{i}", tokens, SamplingParams(max_tokens=1, extra_args=tag and tag.to_xargs()), None,
                              block_hasher=HASHER)
            start = time.thread_time()
            runtime.on_add_request(request)
            if i >= args.requests // 2:
                spent += time.thread_time() - start
                timed += 1
            runtime.refresh()
            serve_once(kv, request)
    finally:
        gc.unfreeze()  # the next run's set-up (and a failed run's caller) collects as usual
    return spent / timed * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--agents", type=int, default=24)
    parser.add_argument("--conversations", type=int, default=100)
    parser.add_argument("--anchor-blocks", type=int, default=8)
    parser.add_argument("--turn-blocks", type=int, default=2)
    parser.add_argument("--turns", type=int, default=12)
    args = parser.parse_args()
    samples: dict[tuple[str, str], list[float]] = {(s, t): [] for s in SHAPES for t in TAGS}
    for _ in range(args.repeats):  # interleaved, so that the machine's drift hits every kind alike
        for shape in SHAPES:
            for tags in TAGS:
                samples[shape, tags].append(run(shape, tags, args))
    print(f"admission (on_add_request): {args.requests} requests per run (second half timed) x {args.repeats} "
          f"repeats; {args.agents} agents, anchors of {args.anchor_blocks} blocks, {args.conversations} live "
          f"conversations of up to {args.turns} turns x {args.turn_blocks} blocks; block size {BS}; recognition on")
    print("| traffic | tags | µs / request (median) | ratio to full tags: median [range over repeats] |")
    print("|---|---|---:|---|")
    for shape, tags in samples:
        full = samples[shape, "full"]
        ratios = sorted(x / f for x, f in zip(samples[shape, tags], full, strict=True))
        print(f"| {shape} | {tags} | {statistics.median(samples[shape, tags]):.1f} | "
              f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}, {ratios[-1]:.2f}] |")


if __name__ == "__main__":
    main()
