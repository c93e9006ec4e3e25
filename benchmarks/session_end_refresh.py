"""What the refresh after one ``session_end`` event costs with many history groups cached (ms of
thread CPU time, medians over the events).

Sessions of four agents, each call two unique blocks (all history: no anchor is learned), every
call finished, so that ``--sessions`` x 4 history groups wait in the free queue; then sessions end
one at a time (a simulated millisecond apart), each followed by the refresh the next scheduler step
runs: the whole of it, and the part that re-scores the queue's groups (``set_group_scores``).

    .venv/bin/python benchmarks/session_end_refresh.py [--sessions 500] [--events 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from eviction_hot_path import BS, HASHER  # the sibling script: run as python benchmarks/session_end_refresh.py
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from agentkv.bench.kv_manager import make_manager, serve_once
from agentkv.protocol import AgentTag
from server_patch._free_queue import ScoredFreeBlockQueue
from server_patch._runtime import AgentKVRuntime, RuntimeConfig

AGENTS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--events", type=int, default=200)
    args = parser.parse_args()
    clock = [0.0]
    kv = make_manager(args.sessions * AGENTS * 2 + 64, BS)
    runtime = AgentKVRuntime(RuntimeConfig(), clock=lambda: clock[0])
    runtime.install(kv)
    for call in range(args.sessions * AGENTS):
        session, agent = divmod(call, AGENTS)
        tag = AgentTag(f"agent-{agent}", f"s{session}", f"agent-{agent - 1}" if agent else "", agent)
        request = Request(f"r{call}", list(range(call * 2 * BS, (call + 1) * 2 * BS)),
                          SamplingParams(max_tokens=1, extra_args=tag.to_xargs()), None, block_hasher=HASHER,
                          session_id=tag.session)
        runtime.on_add_request(request)
        runtime.refresh()
        serve_once(kv, request)
        clock[0] += 0.01
    rescoring = [0.0]
    set_group_scores = ScoredFreeBlockQueue.set_group_scores

    def timed(queue: ScoredFreeBlockQueue[Any], *args: Any, **kwargs: Any) -> None:
        start = time.thread_time()
        set_group_scores(queue, *args, **kwargs)
        rescoring[0] += time.thread_time() - start

    ScoredFreeBlockQueue.set_group_scores = timed  # type: ignore[method-assign]
    totals, parts = [], []
    for session in range(min(args.events, args.sessions)):
        clock[0] += 0.001
        rescoring[0] = 0.0
        start = time.thread_time()
        runtime.apply_events({"version": 1, "events": [{"type": "session_end", "session": f"s{session}"}]})
        runtime.refresh()
        totals.append(time.thread_time() - start)
        parts.append(rescoring[0])
    print(f"{len(runtime.queues[0]._groups):,} groups cached, policy {runtime.policy}: per session_end, "
          f"the event and the refresh {statistics.median(totals) * 1e3:.3f} ms, of which re-scoring the queue "
          f"{statistics.median(parts) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
