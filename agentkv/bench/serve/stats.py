"""Result rows of ``agentkv bench serve``: per-call records summarized, runs pooled, calls matched to recognitions."""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .timing import CallRecord

__all__ = ["RateRun", "confusion_table", "pooled_row", "summarize"]


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarize(
    records: Sequence[CallRecord],
    *,
    server: str,
    rate: float,
    wall: float,
    hits: float,
    queries: float,
    sessions: int,
    failed_sessions: int = 0,
    setup: str = "single",
) -> dict[str, Any]:
    """One result row: TTFT and per-turn latency in ms (mean/p50/p99), turns/s, hit rates."""
    done = [r for r in records if r.error is None and r.end is not None]
    ttft = [r.ttft * 1000 for r in done if r.ttft is not None]
    latency = [r.latency * 1000 for r in done if r.latency is not None]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    agents: dict[str, list[int]] = {}
    for r in done:
        totals = agents.setdefault(r.agent, [0, 0, 0])
        totals[0] += 1
        totals[1] += r.prompt_tokens
        totals[2] += r.cached_tokens
    return {
        "server": server,
        "setup": setup,
        "rate": rate,
        "sessions": sessions,
        "failed_sessions": failed_sessions,
        "turns": len(done),
        "errors": len(records) - len(done),
        "wall_s": round(wall, 3),
        "throughput": len(done) / wall if wall > 0 else math.nan,
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else math.nan,
        "ttft_p50_ms": _percentile(ttft, 50),
        "ttft_p99_ms": _percentile(ttft, 99),
        "turn_mean_ms": statistics.fmean(latency) if latency else math.nan,
        "turn_p50_ms": _percentile(latency, 50),
        "turn_p99_ms": _percentile(latency, 99),
        "hit_rate": hits / queries if queries else math.nan,
        "usage_hit_rate": cached / prompt if prompt else math.nan,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "agents": {
            name: {"turns": n, "prompt_tokens": p, "hit_rate": c / p if p else math.nan}
            for name, (n, p, c) in sorted(agents.items())
        },
    }


@dataclass
class RateRun:
    """The raw outcome of one rate on one target: calls, wall time, counter deltas (summed over
    the engines; ``engine_queries`` per engine), failures."""

    server: str
    rate: float
    sessions: int
    turns_per_session: int
    records: list[CallRecord]
    wall: float
    hits: float
    queries: float
    failures: list[str]
    load: tuple[float, float]  # 1-minute load average before and after
    setup: str = "single"
    engine_queries: tuple[float, ...] = ()
    warmups: dict[str, int] | None = None  # the coordinator's counts; server_*: the engines' warm-up outcomes
    #                                        (added by the caller, see ``warmup_reads``)
    confusion: dict[str, dict[str, int]] | None = None  # untagged: true agent -> recognized agent -> calls
    # the engine's warm-up outcome totals before and after the run (None: a read failed)
    warmup_reads: tuple[collections.Counter[str] | None, collections.Counter[str] | None] | None = None

    def row(self) -> dict[str, Any]:
        return pooled_row([self])


def pooled_row(runs: Sequence[RateRun]) -> dict[str, Any]:
    """One result row from one or more runs of the same (server, rate): calls pooled, walls and
    counter deltas summed; ``blocks`` counts the runs (one per block of sessions, over every repeat)
    and ``runs`` lists each one's own headline numbers and machine load."""
    first = runs[0]
    row = summarize(
        [r for run in runs for r in run.records], server=first.server, rate=first.rate,
        wall=sum(run.wall for run in runs), hits=sum(run.hits for run in runs),
        queries=sum(run.queries for run in runs), sessions=sum(run.sessions for run in runs),
        failed_sessions=sum(len(run.failures) for run in runs), setup=first.setup,
    )
    row["offered_turns_per_s"] = first.rate * first.turns_per_session
    row["blocks"] = len(runs)  # not the repeats: a repeat runs several blocks
    if len(first.engine_queries) > 1:  # how the router spread the prompt tokens over the replicas
        per_engine = [sum(q) for q in zip(*(run.engine_queries for run in runs), strict=True)]
        row["engine_share"] = [q / sum(per_engine) if sum(per_engine) else math.nan for q in per_engine]
    if first.warmups is not None:
        row["warmups"] = dict(sum((collections.Counter(run.warmups) for run in runs), collections.Counter()))
    if first.confusion is not None:
        pooled: dict[str, collections.Counter[str]] = {}
        for run in runs:
            for agent, found in (run.confusion or {}).items():
                pooled.setdefault(agent, collections.Counter()).update(found)
        row["confusion"] = {a: dict(c.most_common()) for a, c in sorted(pooled.items())}
    failures = [f for run in runs for f in run.failures]
    if failures:
        row["failures"] = failures[:5]
    if len(runs) > 1:
        row["runs"] = []
        for run in runs:
            one = summarize(run.records, server=run.server, rate=run.rate, wall=run.wall, hits=run.hits,
                            queries=run.queries, sessions=run.sessions)
            row["runs"].append({k: one[k] for k in ("hit_rate", "ttft_mean_ms", "ttft_p99_ms", "turn_mean_ms",
                                                    "throughput")} | {"load": list(run.load)})
    row["load"] = [min(run.load[0] for run in runs), max(max(run.load) for run in runs)]
    # every call: [agent, start s (from the first call of its run), TTFT ms, latency ms, prompt, cached]
    row["calls"] = [
        [r.agent, round(r.start - t0, 4), round(r.ttft * 1000, 2), round(r.latency * 1000, 2), r.prompt_tokens,
         r.cached_tokens]
        for run in runs if run.records
        for t0 in [min(x.start for x in run.records)]
        for r in run.records if r.error is None and r.ttft is not None and r.latency is not None
    ]
    return row


def confusion_table(records: Sequence[CallRecord], recognized: Sequence[Sequence[Any]]) -> dict[str, dict[str, int]]:
    """True agent -> recognized agent -> calls. A call is matched to the first unmatched recognition
    with its prompt length, in start order ("-": not recognized, "?": no recognition matched)."""
    pending: dict[int, collections.deque[str]] = {}
    for _, agent, _, tokens in recognized:
        pending.setdefault(int(tokens), collections.deque()).append(agent or "-")
    table: dict[str, collections.Counter[str]] = {}
    for record in sorted((r for r in records if r.error is None), key=lambda r: r.start):
        queue = pending.get(record.prompt_tokens)
        table.setdefault(record.agent, collections.Counter())[queue.popleft() if queue else "?"] += 1
    return {a: dict(c.most_common()) for a, c in sorted(table.items())}
