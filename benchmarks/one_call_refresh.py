"""The refresh as sessions of one call each pile up (thread CPU time, simulated clock).

Every request is a session of its own (ten agents in turn, a 4-block anchor each and a 4-block
query of its own), 10 calls a second, one call per scheduler step, the runtime's default
``AGENTKV_REFRESH_INTERVAL``. No session ever sends a second request, so no gap between requests
is ever learned: the sessions only leave the live table when the model concludes they are over.
``--return-every K``: one session in K sends a second call 2 s after its first. Prints, after N
sessions, how many the timing still holds live (and the most it held at once) and the mean
refresh per step over the last 500 steps.

    .venv/bin/python benchmarks/one_call_refresh.py [--calls 1000,5000,20000] [--return-every K]
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from eviction_hot_path import BS, HASHER, manager  # the sibling script: run as python benchmarks/one_call_refresh.py
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from agentkv.bench.kv_manager import serve_once
from agentkv.protocol import AgentTag
from server_patch._runtime import AgentKVRuntime, RuntimeConfig

AGENTS = 10
LAST = 500


def run(calls: int, return_every: int) -> tuple[int, int, float]:
    """(sessions live in the timing after ``calls`` sessions, the most live at once, mean µs per
    refresh over the last steps)."""
    clock = [0.0]
    kv = manager(4096)
    runtime = AgentKVRuntime(RuntimeConfig(), clock=lambda: clock[0])
    runtime.install(kv)
    spent, peak, returns = 0.0, 0, deque[tuple[float, int]]()
    for i in range(calls):
        due = [i] + ([returns.popleft()[1]] if returns and returns[0][0] <= clock[0] else [])
        for number, session in enumerate(due):
            step = 0 if number == 0 else 1
            tag = AgentTag(f"agent-{session % AGENTS}", f"one-{session}", "" if step == 0 else None, step)
            anchor = list(range(1000 * (session % AGENTS), 1000 * (session % AGENTS) + 4 * BS))
            query = list(range(10**6 + (2 * session + step) * 4 * BS, 10**6 + (2 * session + step + 1) * 4 * BS))
            params = SamplingParams(max_tokens=1, extra_args=tag.to_xargs())
            request = Request(f"r{session}-{step}", anchor + query, params, None, block_hasher=HASHER,
                              session_id=tag.session)
            runtime.on_add_request(request)
            start = time.thread_time()
            runtime.refresh()
            if i >= calls - LAST:
                spent += time.thread_time() - start
            serve_once(kv, request)
        if return_every and i % return_every == 0:
            returns.append((clock[0] + 2.0, i))
        clock[0] += 0.1
        peak = max(peak, len(runtime.timing.live().names))
    return len(runtime.timing.live().names), peak, spent / min(LAST, calls) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", default="1000,5000,20000", help="comma-separated session counts, one run each")
    parser.add_argument("--return-every", type=int, default=0, help="one session in K calls a second time (0: none)")
    args = parser.parse_args()
    print("| sessions so far | live in the timing (most at once) | refresh µs / step (last 500 steps) |")
    print("|---:|---:|---:|")
    for calls in (int(c) for c in args.calls.split(",")):
        live, peak, refresh = run(calls, args.return_every)
        print(f"| {calls} | {live} ({peak}) | {refresh:.0f} |")


if __name__ == "__main__":
    main()
