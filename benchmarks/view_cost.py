"""What one ``GET /agentkv/v1/view`` document costs under the engine's lock (ms of wall time).

Fills a real vLLM ``KVCacheManager`` with ``--agents`` first calls of ``--blocks`` blocks each, one
session per agent (so no anchor length is learned and each agent's whole first call is the prefix
read: the longest the tracker keeps is 1,024 blocks), every block still cached, then times
``AgentKVRuntime.view()``, which reports each listed agent's cached leading blocks (the most the
view lists is 64 agents). Before session 30 they were counted block by block (33 ms at the
defaults); now by bisection.

    .venv/bin/python benchmarks/view_cost.py [--agents 64] [--blocks 1024] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from agentkv.bench.kv_manager import make_manager, serve_once
from agentkv.protocol import AgentTag
from server_patch._runtime import AgentKVRuntime, RuntimeConfig

BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    blocks = args.agents * (args.blocks + 2) + 8
    manager = make_manager(blocks, BLOCK_SIZE, max_model_len=(args.blocks + 1) * BLOCK_SIZE)
    runtime = AgentKVRuntime(RuntimeConfig(refresh_interval=0.0), clock=time.monotonic)
    runtime.install(manager)
    for agent in range(args.agents):
        tokens = [agent * 10_000_000 + t for t in range((args.blocks - 1) * BLOCK_SIZE + 1)]
        tag = AgentTag(f"agent{agent}", f"session{agent}")
        request = Request(f"r{agent}", tokens, SamplingParams(max_tokens=1, extra_args=tag.to_xargs()), None,
                          block_hasher=hasher)
        runtime.on_add_request(request)
        serve_once(manager, request)
    view = runtime.view()
    prefixes = [resident for resident, _ in view["anchors"].values()]
    started = time.perf_counter()
    for _ in range(args.repeats):
        runtime.view()
    elapsed = (time.perf_counter() - started) / args.repeats
    print(f"view of {len(prefixes)} agents, cached leading blocks {min(prefixes)}-{max(prefixes)} each: "
          f"{elapsed * 1e3:.2f} ms per document (mean of {args.repeats})")


if __name__ == "__main__":
    main()
