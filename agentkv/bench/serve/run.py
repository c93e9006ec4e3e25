"""The benchmark: every rate on every target, in alternating blocks, paired comparisons (against vanilla;
``agentkv+warmup`` against ``agentkv`` too)."""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import openai

from agentkv.bench.bound import TraceError, bound, read_trace
from agentkv.bench.serve_args import ServeConfig
from agentkv.bench.serve_paired import Block, Swap, compare, core_pair, swap_cores

from .app import load_example
from .load import run_rate
from .replicas import start_targets
from .report import JSON_NAME, write_json
from .servers import TRACE_NAME, start_servers
from .stats import RateRun, pooled_row
from .targets import Target, single_targets

__all__ = ["add_anchor_hits", "block_sizes", "run_benchmark"]

_WARMUP = "warmup"  # session ids of the warm-up sessions (not measured) start with it


def block_sizes(sessions: int, block_sessions: int) -> list[int]:
    """Sessions per block: ``sessions`` split into blocks of ``block_sessions`` (the last may be smaller)."""
    full, rest = divmod(sessions, max(1, block_sessions))
    return [block_sessions] * full + ([rest] if rest else [])


# what each server is compared with, paired by block: vanilla, and the warm-up variant with agentkv
# alone (what the warm-ups add on top of the eviction policy)
_BASELINES = {"agentkv": ("vanilla",), "agentkv+warmup": ("vanilla", "agentkv")}


def _comparisons(blocks: dict[tuple[float, str, str], list[Block]], seed: int) -> list[dict[str, Any]]:
    """Every non-vanilla target against its baselines in the same rate and setup, paired by block."""
    out = []
    for (rate, setup, server), ours in blocks.items():
        for baseline in _BASELINES.get(server, ()):
            base = blocks.get((rate, setup, baseline))
            if base is not None:
                out.append({"rate": rate, "setup": setup, "server": server, "baseline": baseline,
                            **compare(list(zip(base, ours, strict=True)), seed=seed)})
    return out


async def _run_async(config: ServeConfig, targets: Sequence[Target], log: Any, swap: Swap | None = None
                     ) -> dict[str, Any]:
    """The benchmark on ``targets``; ``config.out``/serve.json is rewritten after every block
    (``"complete": false``, the rows so far, no comparisons: their blocks are not all paired yet),
    so a run killed or interrupted keeps what it measured."""
    # the run's own HTTP client, closed with its event loop, so that a process can run twice
    from langsmith import tracing_context  # LangChain's tracing client (a LangGraph dependency)

    # trust_env=False: the calls go to loopback, never through the caller's HTTP(S)_PROXY; and no
    # LangSmith tracing exported by the caller uploads the sessions (or costs time inside the calls)
    async with openai.DefaultAsyncHttpxClient(timeout=300.0, trust_env=False) as http:
        with tracing_context(enabled=False):
            return await _run_on(config, targets, log, swap, http)


async def _run_on(config: ServeConfig, targets: Sequence[Target], log: Any, swap: Swap | None,
                  http: httpx.AsyncClient) -> dict[str, Any]:
    import agentkv
    from agentkv.warmup import AnchorBook

    example = load_example()
    apps: list[tuple[Target, Any, Any]] = []
    for target in targets:
        team = example.TeamConfig(base_url=target.url + "/v1", max_tokens=config.max_tokens, turns=config.turns,
                                  tool_gap=config.tool_gap, seed=config.seed, tool_choice="none", routing="markov",
                                  http_async_client=http)
        app = example.build_team(team)
        if not config.untagged:
            app = agentkv.instrument(app, events_url=list(target.events) or None)
        apps.append((target, app, team))
    # one coordinator's anchors across the blocks, as in an application (a coordinator runs only
    # in its own arm's blocks: the arms share an engine)
    books = {target: AnchorBook(base_url=target.url) for target in targets if target.warmup}
    for target, app, team in apps:
        if config.warmup_sessions:
            log(f"warm-up: {config.warmup_sessions} sessions on {_label(target)}")
            await run_rate(app, team, target, rate=max(config.rates), sessions=config.warmup_sessions,
                           seed=config.seed, prefix=_WARMUP, concurrency=2, example=example,
                           untagged=config.untagged, anchors=books.get(target))
    runs: dict[tuple[float, str, str], list[RateRun]] = {}
    blocks: dict[tuple[float, str, str], list[Block]] = {}
    warm_engines = {e for target in targets if target.warmup for e in target.engines}
    credit = _WarmupCredit()
    for repeat in range(config.repeats):
        for index, rate in enumerate(config.rates):
            # short alternating blocks (the order flips every block), cores swapped halfway
            sizes = block_sizes(config.sessions, config.block_sessions)
            for b, size in enumerate(sizes):
                if swap is not None and b == len(sizes) // 2 and b > 0:
                    log(f"cores swapped ({swap()} engine threads moved)")
                order = apps if (index + repeat + b) % 2 == 0 else list(reversed(apps))
                for target, app, team in order:
                    run = await run_rate(app, team, target, rate=rate, sessions=size,
                                         seed=config.seed + 1000 * repeat + b, prefix=f"x{repeat}-r{index}-b{b}",
                                         concurrency=config.concurrency, example=example,
                                         untagged=config.untagged, anchors=books.get(target),
                                         watch_warmups=bool(warm_engines & set(target.engines)))
                    credit.add(target, run)
                    runs.setdefault((rate, target.setup, target.server), []).append(run)
                    blocks.setdefault((rate, target.setup, target.server), []).append(Block.of(run))
                    row = run.row()
                    log(f"{'' if config.repeats == 1 else f'[{repeat + 1}/{config.repeats}] '}rate {rate:g}/s "
                        f"block {b + 1}/{len(sizes)} {_label(target):24s} hit {row['hit_rate']:.1%}  "
                        f"TTFT mean {row['ttft_mean_ms']:.0f} ms p99 {row['ttft_p99_ms']:.0f} ms  "
                        f"turn {row['turn_mean_ms']:.0f} ms  {row['throughput']:.2f} turns/s  ({row['turns']} turns, "
                        f"{row['errors']} errors, load {run.load[0]:.1f}->{run.load[1]:.1f})")
                    write_json({"config": _jsonable(asdict(config)), "complete": False,
                                "rows": [pooled_row(group) for group in runs.values()], "comparisons": []},
                               config.out / JSON_NAME)
                    sink = getattr(app, "sink", None)
                    if sink is not None:  # the session ends reach the server before the next block
                        await asyncio.to_thread(sink.flush, 5.0)
    rows = [pooled_row(group) for group in runs.values()]
    result: dict[str, Any] = {"config": _jsonable(asdict(config)), "complete": True, "rows": rows,
                              "comparisons": _comparisons(blocks, config.seed)}
    engines = list(dict.fromkeys(e for t in targets if t.server != "vanilla" for e in t.engines))
    if engines:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            try:
                stats = []
                for engine in engines:
                    response = await client.get(engine + "/agentkv/v1/stats")
                    response.raise_for_status()
                    stats.append(response.json())
            except (httpx.HTTPError, ValueError) as exc:  # the figures measured stand without them
                log(f"agentkv's stats could not be read ({type(exc).__name__}: {exc}): no anchor-kept column")
            else:
                result["agentkv_stats"] = stats[0]
                if len(stats) > 1:
                    result["agentkv_engine_stats"] = dict(zip(engines, stats, strict=True))
                add_anchor_hits(rows, stats[0])
    return result


class _WarmupCredit:
    """The server's warm-up outcomes, to the warm-up arm. A warm-up stays pending until its agent's
    next call, often in another arm's block on the same engine, or expires between blocks: every
    change of an engine's counts since its previous read is credited to the warm-up arm's latest
    run on that engine (before the first one: the unmeasured warm-up sessions', dropped)."""

    def __init__(self) -> None:
        self._latest: dict[tuple[str, ...], RateRun] = {}
        self._read: dict[tuple[str, ...], collections.Counter[str] | None] = {}

    def add(self, target: Target, run: RateRun) -> None:
        if run.warmup_reads is None:
            return
        before, after = run.warmup_reads
        start = self._read.get(target.engines, before)
        self._read[target.engines] = after
        if target.warmup:
            self._latest[target.engines] = run
        owner = self._latest.get(target.engines)
        if owner is None or owner.warmups is None:
            return
        if start is None or after is None:  # a read failed: the row says so rather than count nothing
            owner.warmups["server_unread"] = owner.warmups.get("server_unread", 0) + 1
            return
        for outcome, n in (after - start).items():
            owner.warmups[f"server_{outcome}"] = owner.warmups.get(f"server_{outcome}", 0) + n


def _label(target: Target) -> str:
    return target.server if target.setup == "single" else f"{target.server} {target.setup}"


def add_anchor_hits(rows: Sequence[dict[str, Any]], stats: dict[str, Any]) -> None:
    """Add ``anchor_hit_rate`` to each row: the fraction of calls whose cached prefix covered the
    whole anchor of their agent, as the agentkv server learned it (``anchor_length_blocks``). An
    untagged run's agents are the server's recognitions (``fp:...``): each of the app's agents is
    read as the one it was recognized as most often (the row's ``confusion``)."""
    block = int(stats.get("block_size") or 32)
    anchors = {a: int(v.get("anchor_length_blocks") or 0) * block for a, v in stats.get("agents", {}).items()}
    for row in rows:
        named = {agent: max(seen, key=seen.__getitem__) for agent, seen in (row.get("confusion") or {}).items() if seen}
        lengths = [anchors.get(named.get(c[0], c[0]), 0) for c in row.get("calls", [])]
        kept = [c[5] >= length for c, length in zip(row.get("calls", []), lengths, strict=True) if length > 0]
        row["anchor_hit_rate"] = sum(kept) / len(kept) if kept else math.nan


def run_benchmark(
    config: ServeConfig, *, servers: dict[str, Any] | None = None, targets: Sequence[Target] | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Run every rate on every target. ``servers`` ({"vanilla": ..., "agentkv": ...} objects with a
    ``base_url``) or ``targets`` skip starting our own; otherwise both single servers start, plus,
    with ``config.replicas > 1``, both kinds of replicas behind ``config.routers`` (see
    :mod:`agentkv.bench.serve.replicas`). Returns ``{"config", "complete", "rows", "comparisons",
    "agentkv_stats"}``, also written to ``config.out``/serve.json (and after every block: see
    :func:`_run_async`)."""
    result = _run_benchmark(config, servers, targets, log)
    write_json(result, config.out / JSON_NAME)
    return result


def _run_benchmark(config: ServeConfig, servers: dict[str, Any] | None, targets: Sequence[Target] | None, log: Any
                   ) -> dict[str, Any]:
    if targets is not None:
        return asyncio.run(_run_async(config, targets, log))
    if servers is not None:
        return asyncio.run(_run_async(config, single_targets(config, {n: s.base_url for n, s in servers.items()}), log))
    if config.replicas > 1:
        with start_targets(config, log=log) as started:
            return asyncio.run(_run_async(config, started, log))
    with start_servers(config) as started:
        log("servers up: " + ", ".join(f"{n} {s.base_url} ({s.startup_seconds:.0f} s, engine on core "
                                       f"{s.spec.env.get('VLLM_CPU_OMP_THREADS_BIND', 'any')})"
                                       for n, s in started.items()))
        cores = core_pair()
        groups = [s.pid for s in started.values()]
        swap = (lambda: swap_cores(groups, cores)) if config.swap_cores and cores[0] != cores[1] else None
        targets = single_targets(config, {n: s.base_url for n, s in started.items()})
        result = asyncio.run(_run_async(config, targets, log, swap))
    if not config.warmup:  # the trace holds one arm's traffic only without the warm-up arm
        result["bound"] = _bound(config.out / TRACE_NAME, log)
    return result


def _bound(path: Path, log: Any) -> dict[str, Any] | None:
    """The agentkv server's traffic replayed under LRU and Belady (``agentkv bench bound``)."""
    try:
        return {"trace": str(path), **bound(read_trace(path), skip_sessions=f"{_WARMUP}-").to_json()}
    except (OSError, TraceError) as exc:
        log(f"no bound from the request trace: {exc}")
        return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
