"""The load driver: sessions arriving as a Poisson process at one rate on one target."""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import httpx

from .app import load_example
from .scrape import engine_counters, engine_recognitions, engine_warmups
from .stats import RateRun, confusion_table
from .targets import Target
from .timing import CallTimer

if TYPE_CHECKING:
    from agentkv.warmup import AnchorBook

__all__ = ["arrival_times", "run_rate"]

_SETTLE = 5.0  # seconds to wait at most for the engines' counters to take in a run


def arrival_times(rate: float, sessions: int, seed: int) -> list[float]:
    """Poisson arrivals: cumulative exponential gaps (the first session arrives at 0)."""
    rng = random.Random(f"arrivals:{seed}:{rate}")
    times, t = [], 0.0
    for _ in range(sessions):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _load() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - not on Linux/macOS
        return math.nan


async def _settled_counters(client: httpx.AsyncClient, engines: Sequence[str], before: list[tuple[float, float]],
                            *, calls: int) -> list[tuple[float, float]]:
    """The engines' (hits, queries) once two reads 0.2 s apart agree and, after ``calls`` answered
    calls, the queries moved: an engine counts a step's prefix-cache queries after it answers, and
    on a loaded machine that lags (a read 0.2 s after the run once saw no query on any replica).
    Gives up after ``_SETTLE`` seconds with the last read."""
    deadline = time.perf_counter() + _SETTLE
    previous = None
    while True:
        await asyncio.sleep(0.2)
        counters = await engine_counters(client, engines)
        moved = not calls or sum(a[1] - b[1] for a, b in zip(counters, before, strict=True)) > 0
        if (counters == previous and moved) or time.perf_counter() > deadline:
            return counters
        previous = counters


async def run_rate(
    app: Any,
    team: Any,
    target: Target,
    *,
    rate: float,
    sessions: int,
    seed: int,
    prefix: str,
    concurrency: int = 16,
    example: ModuleType | None = None,
    untagged: bool = False,
    anchors: AnchorBook | None = None,
    watch_warmups: bool = False,
) -> RateRun:
    """Run ``sessions`` sessions arriving at ``rate`` per second on one target.

    ``app`` is the instrumented LangGraph app, ``team`` its ``TeamConfig`` (pointing at
    ``target.url``). Workloads are ``{prefix}-{i}``: the same workloads (and seed) give the same
    tasks and routes on every target; session ids add ``target.session_suffix``. ``X-Session-ID``
    carries ``target.routing_key`` during the run; ``agentkv+warmup`` runs a ``WarmupCoordinator``
    (with ``anchors``, the book it keeps from run to run, as an application's coordinator would).
    ``untagged`` (an uninstrumented ``app``): on an agentkv target, the run's calls are matched
    to the server's recognitions (``GET /agentkv/v1/recognized``) for a confusion table.
    ``watch_warmups`` (``agentkv+warmup``, or a target sharing its engine): the engine's warm-up
    outcomes are read before and after the run (``RateRun.warmup_reads``; the caller attributes them).
    The hit rate of a run with warm-ups is its real calls': the warm-ups' own tokens are taken out
    of the engine's counters.
    """
    from agentkv.frameworks import set_routing_key
    from agentkv.warmup import WarmupCoordinator

    example = example or load_example()
    timer = CallTimer()
    limit = asyncio.Semaphore(concurrency)
    failures: list[str] = []

    async def session(i: int, at: float, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        async with limit:
            try:
                workload = f"{prefix}-{i}"
                await example.run_session(app, workload + target.session_suffix, team, callbacks=[timer],
                                          workload=workload)
            except Exception as exc:  # a failed session is counted, the run goes on
                failures.append(f"{type(exc).__name__}: {exc}"[:300])

    load0 = _load()
    recognize = untagged and target.server != "vanilla"
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        seen = {r[0] for r in await engine_recognitions(client, target.engines)} if recognize else set()
        before = await engine_counters(client, target.engines)
        watched = target.warmup or watch_warmups
        warmed_before = await engine_warmups(client, target.engines) if watched else None
        previous_key = set_routing_key(target.routing_key)
        # behind a router the coordinator reads the replicas' views itself (a router hands a read to one)
        replicas = () if target.setup == "single" else target.engines
        warmup = WarmupCoordinator(target.url, anchors=anchors, replicas=replicas).start() if target.warmup else None
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(session(i, at, t0) for i, at in enumerate(arrival_times(rate, sessions, seed))))
        finally:
            set_routing_key(previous_key)
            if warmup is not None:
                warmup.close()
        wall = time.perf_counter() - t0
        after = await _settled_counters(client, target.engines, before, calls=len(timer.records))
        confusion = None
        if recognize:
            fresh = [r for r in await engine_recognitions(client, target.engines) if r[0] not in seen]
            confusion = confusion_table(timer.records, fresh)
        warmed_after = await engine_warmups(client, target.engines) if watched else None
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = tuple(a[1] - b[1] for a, b in zip(after, before, strict=True))
    queried = sum(queries)
    warmups = None
    if warmup is not None:
        stats = warmup.stats()
        hits -= stats["tokens"]["cached"]
        queried -= stats["tokens"]["prompt"]
        warmups = {k: stats[k] for k in ("sent", "failed", "dropped")} | {
            f"skipped_{reason}": n for reason, n in stats["skipped"].items()} | {
            f"fallback_{name}": n for name, n in stats["fallbacks"].items()}
    return RateRun(target.server, rate, sessions, team.turns, timer.records, wall, hits, queried,
                   failures, (load0, _load()), target.setup, queries, warmups, confusion,
                   (warmed_before, warmed_after) if watched else None)
