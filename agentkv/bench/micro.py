"""Microbenchmark of the learning core: what the server runs per dispatch and per scheduler step.

observe (the learner and the session timing), the next-use evaluation the runtime's refresh
performs after a change (first-passage table, gap table and ``score_reuse`` over the live
sessions), the per-group score the eviction queue reads, and the size of the learned state.
The design paper reports ~1 µs per observe, <= 6 µs per survival prediction at 24 agents and
< 25 KB of state (docs/design sources in docs/benchmarks.md)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import numpy as np

from agentkv.graph import (
    Anchor,
    GraphFacts,
    History,
    LearnerConfig,
    Predictor,
    ReuseConfig,
    SessionTiming,
    TransitionLearner,
    first_passage_steps,
    score_reuse,
)

__all__ = ["main", "run"]


def _best_us(fn: Callable[[], object], repeat: int = 5, number: int = 200) -> float:
    """Best of ``repeat`` runs of ``number`` calls, in µs of this thread's CPU time per call (noisy
    machines: CPU time is blind to waiting for a core, and the min drops the rest)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.thread_time_ns()
        for _ in range(number):
            fn()
        best = min(best, (time.thread_time_ns() - start) / number / 1000)
    return best


def _trained(n_agents: int, sessions: int, dispatches: int, seed: int) -> tuple[TransitionLearner, SessionTiming,
                                                                             list[tuple[str, str, float]]]:
    rng = np.random.default_rng(seed)
    names = [f"agent-{i:02d}" for i in range(n_agents)]
    # a noisy ring: the structure the learner exists to find
    nxt = {i: (i + 1) % n_agents for i in range(n_agents)}
    learner = TransitionLearner(LearnerConfig(half_life=10_000))
    timing = SessionTiming()
    current = {f"session-{s}": int(rng.integers(n_agents)) for s in range(sessions)}
    ops = []
    now = 0.0
    for _ in range(dispatches):
        session = f"session-{int(rng.integers(sessions))}"
        step = nxt[current[session]] if rng.random() < 0.8 else int(rng.integers(n_agents))
        current[session] = step
        now += float(rng.exponential(0.5))
        ops.append((names[step], session, now))
    for agent, session, at in ops:
        learner.observe(agent, session=session)
        timing.observe(session, agent, at)
        timing.finished(session)  # answered at once
    return learner, timing, ops


def _measure(n: int, sessions: int) -> dict[str, float]:
    learner, timing, ops = _trained(n, sessions, 5_000, seed=n)
    cycle = iter(ops * 1000)
    clock = [ops[-1][2]]

    def observe() -> None:
        agent, session, _ = next(cycle)
        clock[0] += 0.5
        learner.observe(agent, session=session)
        timing.observe(session, agent, clock[0])
        timing.finished(session)

    observe_us = _best_us(observe, number=2_000)
    predictor = Predictor(learner, GraphFacts())
    config = ReuseConfig(r_min=0.0)

    def evaluate() -> object:
        observe()  # a real evaluation follows a change: nothing is cached
        chain = predictor.chain()
        passage = first_passage_steps(chain.matrix, config.max_steps, tolerance=config.step_tolerance)
        return score_reuse(chain, timing.table(), timing.live(), now=clock[0],
                           session_start_rate=timing.session_rate(clock[0]), pace=timing.pace(),
                           continuation={a: timing.continuation(a) for a in chain.agents}, interposed=None,
                           predictability=learner.predictability(), gap_count=timing.gaps, config=config,
                           passage=passage, end_hazard=timing.end_hazards())

    table = evaluate()
    score = table.scorer()  # type: ignore[attr-defined]
    groups = [History(session, frozenset((agent,))) for session, agent, *_ in timing.sessions()]
    groups += [Anchor(frozenset((agent,))) for agent in learner.agents]
    lookups = iter(groups * 100_000)
    return {
        "agents": n,
        "sessions": len(timing.sessions()),
        "observe_us": observe_us,
        "evaluate_us": _best_us(evaluate, number=50) - observe_us,
        "group_score_us": _best_us(lambda: score(next(lookups)), number=20_000),
        "state_bytes": learner.state_bytes() + timing.state_bytes(),
        "snapshot_bytes": len(json.dumps(learner.export_state(), separators=(",", ":"))),
    }


def run(agent_counts: tuple[int, ...] = (6, 12, 24), sessions: int = 100) -> list[dict[str, float]]:
    return [_measure(n, sessions) for n in agent_counts]


def main() -> None:
    rows = run()
    print("agentkv learning-core microbenchmark (best of 5; µs per call)")
    print("| agents | live sessions | observe µs | next-use evaluation µs | group score µs | state bytes "
          "| snapshot bytes |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['agents']} | {r['sessions']} | {r['observe_us']:.2f} | {r['evaluate_us']:.1f} | "
            f"{r['group_score_us']:.2f} | {r['state_bytes']} | {r['snapshot_bytes']} |"
        )


if __name__ == "__main__":
    main()
