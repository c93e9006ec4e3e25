"""The refresh as sessions of one call each pile up (thread CPU time, simulated clock).

Every request is a session of its own (ten agents in turn, a 4-block anchor each and a 4-block
query of its own), 10 calls a second, one call per scheduler step, the runtime's default
``AGENTKV_REFRESH_INTERVAL``. No session ever sends a second request, so no gap between requests
is ever learned: the sessions only leave the live table when the model concludes they are over.
Prints, after N calls, how many sessions the timing still holds live and the mean refresh per step
over the last 500 steps.

    .venv/bin/python benchmarks/one_call_refresh.py [--calls 1000,5000,20000]
"""

from __future__ import annotations

import argparse
import time

from eviction_hot_path import BS, HASHER, manager  # the sibling script: run as python benchmarks/one_call_refresh.py
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from agentkv.bench.kv_manager import serve_once
from agentkv.protocol import AgentTag
from server_patch._runtime import AgentKVRuntime, RuntimeConfig

AGENTS = 10
LAST = 500


def run(calls: int) -> tuple[int, float]:
    """(sessions live in the timing after ``calls`` calls, mean µs per refresh over the last steps)."""
    clock = [0.0]
    kv = manager(4096)
    runtime = AgentKVRuntime(RuntimeConfig(), clock=lambda: clock[0])
    runtime.install(kv)
    spent = 0.0
    for i in range(calls):
        tag = AgentTag(f"agent-{i % AGENTS}", f"one-{i}", "", 0)
        anchor = list(range(1000 * (i % AGENTS), 1000 * (i % AGENTS) + 4 * BS))
        query = list(range(10**6 + i * 4 * BS, 10**6 + (i + 1) * 4 * BS))
        request = Request(f"r{i}", anchor + query, SamplingParams(max_tokens=1, extra_args=tag.to_xargs()), None,
                          block_hasher=HASHER, session_id=tag.session)
        runtime.on_add_request(request)
        start = time.thread_time()
        runtime.refresh()
        if i >= calls - LAST:
            spent += time.thread_time() - start
        serve_once(kv, request)
        clock[0] += 0.1
    return len(runtime.timing.live().names), spent / min(LAST, calls) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", default="1000,5000,20000", help="comma-separated call counts, one run each")
    args = parser.parse_args()
    print("| one-call sessions so far | live in the timing | refresh µs / step (last 500 steps) |")
    print("|---:|---:|---:|")
    for calls in (int(c) for c in args.calls.split(",")):
        live, refresh = run(calls)
        print(f"| {calls} | {live} | {refresh:.0f} |")


if __name__ == "__main__":
    main()
