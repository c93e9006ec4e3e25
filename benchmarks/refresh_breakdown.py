"""What one full evaluation of the next-use model costs, part by part (µs of thread CPU time).

Drives the runtime as ``eviction_hot_path.py`` does (every request a new dispatch, every prompt
new; a simulated clock, 10 requests a second) with ``AGENTKV_REFRESH_INTERVAL=0``, so that every
step evaluates the model. After the warm-up it times, step by step, the parts the refresh runs
(the chain, the live sessions, the learner's predictability, ``score_reuse``,
``ReuseTable.scorer``, finding the sessions whose scores moved since the last refresh, re-scoring
their groups in the queue), ``score_reuse`` re-evaluating only the sessions touched since the last
refresh (as 3 refreshes in 4 do), then the whole refresh (whose re-scoring then finds the scores
just set); medians over the steps.

Then what a scheduler step pays at the runtime's default ``AGENTKV_REFRESH_INTERVAL``: engine steps
of ``--step-ms`` (simulated), each admitting one new request (so the model changes at every
step), the refresh timed at every step; the mean over the steps amortizes the evaluations. The
chain's first-passage table is rebuilt as the server does (``--rebuild background``: on a thread
from 64 agents, whose CPU time is not the step's), or always in the step that finds it stale
(``--rebuild step``, as replays do).

    .venv/bin/python benchmarks/refresh_breakdown.py [--agents 24] [--sessions 100] [--steps 1500] [--rate 10]
        [--step-ms 20] [--rebuild background|step]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from eviction_hot_path import manager, requests  # the sibling script: run as python benchmarks/refresh_breakdown.py

from agentkv.bench.kv_manager import serve_once
from agentkv.graph import ReuseTable, score_reuse
from server_patch._runtime import AgentKVRuntime, RuntimeConfig

Timer = Callable[[str, Callable[[], Any]], Any]


def time_parts(runtime: AgentKVRuntime, timed: Timer) -> None:
    """One evaluation of the model, as ``AgentKVRuntime.refresh`` runs it, part by part."""
    now = runtime.clock()
    chain = timed("Predictor.chain", runtime.predictor.chain)
    live = timed("SessionTiming.live", runtime.timing.live)
    predictability = timed("learner.predictability", runtime.learner.predictability)

    def evaluate(reuse: tuple[ReuseTable, set[str]] | None = None) -> ReuseTable:
        return score_reuse(
            chain, runtime._gaps, live, now=now, session_start_rate=runtime.timing.session_rate(now),
            pace=runtime.timing.pace(), continuation={a: runtime.timing.continuation(a) for a in chain.agents},
            interposed=runtime.learner.interposed_rate(), predictability=predictability,
            gap_count=runtime.timing.gaps, config=runtime.config.reuse, passage=runtime._passage,
            end_hazard=runtime.timing.end_hazards(), reuse=reuse)

    table = timed("score_reuse", evaluate)
    touched = runtime.timing._touched._changed  # peeked, not taken: the refresh below takes them
    if runtime.table is not None and touched is not None:
        previous = runtime.table
        timed("score_reuse, touched sessions only", lambda: evaluate((previous, touched)))
    scorer = timed("ReuseTable.scorer", lambda: table.scorer(retired=runtime.facts.ended.keys().__contains__))
    before = runtime._scored_table  # as the refresh does: re-score the groups of the sessions that moved
    changed = None if before is None else timed("ReuseTable.changed_sessions", lambda: table.changed_sessions(before))
    timed("queue.set_group_scores", lambda: runtime.queues[0].set_group_scores(scorer, changed_partitions=changed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=24)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=600)
    parser.add_argument("--rate", type=float, default=10.0, help="requests per (simulated) second")
    parser.add_argument("--step-ms", type=float, default=20.0, help="engine step of the amortized run (simulated)")
    parser.add_argument("--rebuild", choices=("background", "step"), default="background",
                        help="where the amortized run rebuilds the first-passage table: as the server does "
                             "(on a thread from 64 agents), or always in the step that finds it stale, "
                             "as replays do")
    args = parser.parse_args()
    full_evaluation(args)
    amortized(args)


def full_evaluation(args: argparse.Namespace) -> None:
    kv = manager(4096)
    arrived = [0]  # requests so far: the simulated clock (a real one makes every run score differently)
    runtime = AgentKVRuntime(RuntimeConfig(refresh_interval=0.0), clock=lambda: arrived[0] / args.rate)
    runtime.install(kv)
    parts: dict[str, list[float]] = {}

    def timed(name: str, call: Callable[[], Any]) -> Any:
        start = time.thread_time()
        result = call()
        parts.setdefault(name, []).append(time.thread_time() - start)
        return result

    for index, req in enumerate(requests(4096 // 16 + args.warmup + args.steps, 16, args.agents, args.sessions)):
        arrived[0] = index
        runtime.on_add_request(req)
        if index >= 4096 // 16 + args.warmup and runtime._gaps is not None:
            time_parts(runtime, timed)
            timed("refresh (all of it)", runtime.refresh)
        else:
            runtime.refresh()
        serve_once(kv, req)
    groups = len(runtime.queues[0]._groups)
    print(f"full evaluation at {args.agents} agents, {args.sessions} sessions, {groups} queue groups "
          f"(median µs over {args.steps} steps; the refresh re-evaluates only the touched sessions 3 times in 4)")
    print("| part | µs |")
    print("|---|---:|")
    for name, samples in parts.items():
        print(f"| {name} | {statistics.median(samples) * 1e6:.0f} |")


def amortized(args: argparse.Namespace) -> None:
    kv = manager(4096)
    steps = [0]
    runtime = AgentKVRuntime(RuntimeConfig(), clock=lambda: steps[0] * args.step_ms / 1000,
                             background=args.rebuild == "background")
    runtime.install(kv)
    times: list[float] = []
    evaluating: list[float] = []
    for index, req in enumerate(requests(4096 // 16 + args.warmup + args.steps, 16, args.agents, args.sessions)):
        steps[0] = index
        runtime.on_add_request(req)
        before = runtime._scored_at
        start = time.thread_time()
        runtime.refresh()
        elapsed = time.thread_time() - start
        if index >= 4096 // 16 + args.warmup:
            times.append(elapsed)
            if runtime._scored_at != before:
                evaluating.append(elapsed)
        serve_once(kv, req)
    interval = runtime.config.refresh_interval
    where = "on a thread" if args.rebuild == "background" else "in the step"
    print(f"\nrefresh per engine step at the default AGENTKV_REFRESH_INTERVAL={interval:g} s, "
          f"{args.step_ms:g} ms steps, a new request every step: mean {statistics.mean(times) * 1e6:.0f} µs "
          f"({len(evaluating)} evaluations in {len(times)} steps, "
          f"mean {statistics.mean(evaluating) * 1e6:.0f} µs each, median {statistics.median(evaluating) * 1e6:.0f}, "
          f"the slowest {max(evaluating) * 1e6:.0f}; first-passage tables rebuilt {where})")


if __name__ == "__main__":
    main()
