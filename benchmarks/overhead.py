"""agentkv's own cost per request on a cache-neutral workload: vanilla vs agentkv, paired blocks.

Both servers serve the benchmark model with a pool far larger than the workload (no eviction:
after the first call of each agent, both hit the same prefixes), each engine on a core of its
own. Sequential tagged chat calls (six agents with fixed ~700-token anchors, sessions of 6 calls,
a ``session_end`` event posted after each session) run in alternating blocks on the two servers;
the cores are swapped halfway. While it runs, ``py-spy record`` samples the agentkv server's
processes (``--profile``, py-spy on PATH or beside the interpreter); the share of samples inside
agentkv's code is printed per process.

    .venv/bin/python benchmarks/overhead.py [--blocks 12] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from agentkv.bench import SERVER_ENV
from agentkv.bench.model import build_bench_model
from agentkv.bench.serve_paired import Block, compare, comparison_lines, core_pair, pin_env, swap_cores
from agentkv.launcher import ServerProcess, ServerSpec

AGENTS = ["planner", "coder", "reviewer", "writer", "researcher", "supervisor"]
ANCHOR = "You are the {agent} of a software team. " + "Follow the team's rules, cite files exactly, be brief. " * 50
ROOT = Path(__file__).resolve().parents[1]


def call(client: httpx.Client, agent: str, session: str, turn: int, tagged: bool) -> tuple[float, float]:
    """One streamed chat call: (TTFT ms, latency ms)."""
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0.0, "stream": True,
            "messages": [{"role": "system", "content": ANCHOR.format(agent=agent)},
                         {"role": "user", "content": f"step {turn}"}]}
    headers = {"X-AgentKV-Agent": agent, "X-AgentKV-Session": session} if tagged else {}
    t0 = time.perf_counter()
    first = 0.0
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and not first:
                first = time.perf_counter()
    return (first - t0) * 1000, (time.perf_counter() - t0) * 1000


def block(client: httpx.Client, index: int, sessions: int, events: bool) -> Block:
    ttft, turn = [], []
    t0 = time.perf_counter()
    for s in range(sessions):
        session = f"b{index}-s{s}"
        for k in range(6):
            a, b = call(client, AGENTS[(s + k) % 6], session, k, tagged=True)
            ttft.append(a)
            turn.append(b)
        if events:
            client.post("/agentkv/v1/events", json={"version": 1, "events": [
                {"type": "session_end", "id": f"end-{session}", "session": session}]}).raise_for_status()
    return Block(np.array(ttft), np.array(turn), len(ttft), time.perf_counter() - t0, 0.0, 0.0)


def profile_share(path: Path) -> dict[str, float]:
    """Share of samples per process whose stack holds a frame of agentkv's code, by file."""
    samples: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        files = {part.split("(")[-1].split(":")[0] for part in stack.split(";")
                 if "server_patch/" in part or "/agentkv/" in part}
        for f in files:
            samples[f.rsplit("/", 2)[-2] + "/" + f.rsplit("/", 1)[-1]] += n
        if files:
            samples["any agentkv frame"] += n
    return {name: n / total for name, n in samples.most_common(12)} if total else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=12, help="blocks per server")
    parser.add_argument("--sessions", type=int, default=2, help="sessions of 6 calls per block")
    parser.add_argument("--profile", action="store_true", help="py-spy record the agentkv server meanwhile")
    args = parser.parse_args()
    model = build_bench_model(ROOT / ".build" / "bench-model")
    cores = core_pair()
    specs = {"vanilla": ServerSpec(model_dir=model, num_gpu_blocks=801, env=pin_env(cores[0])),
             "agentkv": ServerSpec(model_dir=model, num_gpu_blocks=801, module="agentkv.serve",
                                   env=pin_env(cores[1]))}
    servers = {name: ServerProcess(spec, log_path=ROOT / ".build" / "overhead" / f"{name}.log", base_env=SERVER_ENV)
               for name, spec in specs.items()}
    spy = None
    try:
        for server in servers.values():
            server.launch()
        for server in servers.values():
            server.wait_healthy()
        clients = {n: httpx.Client(base_url=s.base_url, timeout=120, trust_env=False) for n, s in servers.items()}
        for name, client in clients.items():  # cache every anchor on both servers
            block(client, -1, 1, events=name == "agentkv")
        if args.profile:
            py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
            out = ROOT / ".build" / "overhead" / "agentkv.pyspy.txt"
            spy = subprocess.Popen([py_spy, "record", "--format", "raw", "--subprocesses", "--rate", "200",
                                    "-o", str(out), "--pid", str(servers["agentkv"].pid)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pairs = []
        for b in range(args.blocks):
            if b == args.blocks // 2:
                print(f"cores swapped ({swap_cores([s.pid for s in servers.values()], cores)} threads moved)")
            order = ("vanilla", "agentkv") if b % 2 == 0 else ("agentkv", "vanilla")
            done = {name: block(clients[name], b, args.sessions, events=name == "agentkv") for name in order}
            pairs.append((done["vanilla"], done["agentkv"]))
            print(f"block {b + 1}/{args.blocks}: TTFT mean vanilla {done['vanilla'].ttft.mean():.1f} ms, "
                  f"agentkv {done['agentkv'].ttft.mean():.1f} ms", flush=True)
        base = np.concatenate([p[0].ttft for p in pairs])
        print(f"vanilla TTFT mean {base.mean():.1f} ms, p50 {np.median(base):.1f} ms ({len(base)} calls)")
        print("\n".join(comparison_lines(0, compare(pairs))[:5]))
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
            for name, share in profile_share(out).items():
                print(f"  {share:6.1%}  {name}")
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
