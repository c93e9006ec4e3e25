"""Chat latency on a real ``agentkv serve`` with and without a client polling stats and /metrics.

One agentkv server (tiny model, engine on one core) first sees ``--sessions`` tagged sessions so
that its stats have content, then serves ``--calls`` sequential tagged chat calls twice, in
alternating blocks of 10: alone, and while one client polls ``GET /agentkv/v1/stats`` and
``GET /metrics`` back to back as fast as the server answers. A stats or /metrics request must
never stall the engine loop, so both columns should match. ``--vanilla`` runs the same against a
vanilla vLLM polled on ``/metrics`` only: the part of the slowdown that is vLLM's own.

    .venv/bin/python benchmarks/stats_poll.py [--calls 100] [--sessions 400] [--vanilla]

(It imports nothing newer than the tiny model builder, so it also runs on older checkouts.)
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import httpx

from agentkv.bench import SERVER_ENV
from agentkv.launcher import ServerProcess, ServerSpec
from agentkv.testing.tiny_model import build_tiny_model

AGENTS = ["planner", "coder", "reviewer", "writer", "researcher", "supervisor"]
SYSTEM = "You are the {agent}. " + "Follow the team's rules and answer briefly. " * 40


def chat(client: httpx.Client, agent: str, session: str, text: str) -> float:
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0.0,
            "messages": [{"role": "system", "content": SYSTEM.format(agent=agent)}, {"role": "user", "content": text}]}
    headers = {"X-AgentKV-Agent": agent, "X-AgentKV-Session": session}
    t0 = time.perf_counter()
    client.post("/v1/chat/completions", json=body, headers=headers).raise_for_status()
    return (time.perf_counter() - t0) * 1000


def poll(base_url: str, stop: threading.Event, counts: list[int], vanilla: bool) -> None:
    with httpx.Client(base_url=base_url, timeout=30, trust_env=False) as client:
        while not stop.is_set():
            if not vanilla:
                client.get("/agentkv/v1/stats").raise_for_status()
            client.get("/metrics").raise_for_status()
            counts[0] += 1


def describe(name: str, ms: list[float]) -> str:
    ordered = sorted(ms)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return (f"{name:22s} mean {statistics.fmean(ms):6.1f} ms  p50 {statistics.median(ms):6.1f} ms  "
            f"p99 {p99:6.1f} ms  max {max(ms):6.1f} ms  ({len(ms)} calls)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=100, help="measured calls per condition")
    parser.add_argument("--sessions", type=int, default=400, help="tagged sessions sent first")
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--vanilla", action="store_true", help="a vanilla vLLM, polled on /metrics only")
    args = parser.parse_args()
    model = build_tiny_model(Path(__file__).resolve().parents[1] / ".build" / "tiny-model")
    spec = ServerSpec(model_dir=model, num_gpu_blocks=201, env={"VLLM_CPU_OMP_THREADS_BIND": str(args.core)},
                      module="vllm.entrypoints.openai.api_server" if args.vanilla else "agentkv.serve")
    with (ServerProcess(spec, base_env=SERVER_ENV) as server,
          httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client):
        for i in range(args.sessions):
            chat(client, AGENTS[i % len(AGENTS)], f"s{i}", f"task {i}")
        if not args.vanilla:
            print(f"stats document: {len(client.get('/agentkv/v1/stats').content)} bytes")
        print(f"/metrics: {len(client.get('/metrics').content)} bytes")
        alone: list[float] = []
        polled: list[float] = []
        polls = [0]
        for block in range(0, args.calls, 10):
            for polling in ((False, True) if block % 20 == 0 else (True, False)):
                stop = threading.Event()
                poller = threading.Thread(target=poll, args=(server.base_url, stop, polls, args.vanilla),
                                          daemon=True)
                if polling:
                    poller.start()
                    time.sleep(0.2)
                for i in range(block, min(block + 10, args.calls)):
                    (polled if polling else alone).append(chat(client, AGENTS[i % 6], f"m{i}-{polling}", f"go {i}"))
                stop.set()
                if polling:
                    poller.join()
        print(describe("alone", alone))
        print(describe("with a stats poller", polled))
        print(f"{'' if args.vanilla else 'stats + '}/metrics polls answered: {polls[0]}")


if __name__ == "__main__":
    main()
