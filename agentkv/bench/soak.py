"""``agentkv bench soak``: mixed valid and hostile traffic against a real ``agentkv serve``.

    agentkv bench soak --minutes 10                       # starts a tiny-model server itself
    agentkv bench soak --url http://127.0.0.1:8000 --pid PID --api-key KEY

Runs until ``--minutes`` or ``--max-requests``, whichever comes first, with ``--concurrency``
workers, and stops by itself (a server it started is stopped too). Loopback only: any other host is
refused. Reports requests, HTTP statuses (overall and per case), 5xx, lost requests (no response:
connection reset, timeout, protocol error) and the resident memory of the server's processes (the
API server and its children, e.g. the EngineCore, read from ``/proc``) over time. With
``--api-key``, valid requests carry the key and the ``unauthenticated`` case sends control calls
without it (or with a wrong one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import httpx

from agentkv._arguments import at_least, names_from

from ._defaults import SERVER_ENV
from .soak_cases import CASES, SoakContext, choose_case

__all__ = ["SoakConfig", "add_arguments", "main", "process_rss", "run_soak"]

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
LOOPBACK: Final = frozenset({"127.0.0.1", "localhost", "::1"})
REQUEST_TIMEOUT: Final = 60.0


@dataclass
class SoakConfig:
    url: str | None = None  # None: start a tiny-model `agentkv serve`
    pid: int | None = None  # the API server's pid when --url is given (RSS is not sampled without it)
    minutes: float = 10.0
    max_requests: int = 1_000_000
    concurrency: int = 4
    api_key: str | None = None
    cases: list[str] = field(default_factory=lambda: list(CASES))
    rss_interval: float = 15.0
    seed: int = 0
    model: str = "tiny"
    blocks: int = 81
    out: Path = Path(".build/soak")


# -- server processes ------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Direct and indirect children of ``pid``, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in parents.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def process_rss(pid: int) -> dict[str, float]:
    """Resident memory in MB of ``pid`` (named ``api_server``) and each of its descendants (by
    process name and pid); processes that are gone are left out."""
    out: dict[str, float] = {}
    for index, proc in enumerate([pid, *_children(pid)]):
        try:
            with open(f"/proc/{proc}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:
            continue
        name = "api_server" if index == 0 else f"{fields.get('Name', '?').strip()}[{proc}]"
        out[name] = round(int(fields.get("VmRSS", "0 kB").split()[0]) / 1024, 1)
    return out


class _RssSampler:
    """Samples ``process_rss(pid)`` every ``interval`` seconds in a daemon thread until stopped."""

    def __init__(self, pid: int | None, interval: float) -> None:
        self.pid, self.interval = pid, interval
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)

    def sample(self) -> None:
        if self.pid is not None:
            processes = process_rss(self.pid)
            self.samples.append({"t": round(time.monotonic() - self._started, 1), "processes": processes,
                                 "total_mb": round(sum(processes.values()), 1)})

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> _RssSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


# -- traffic -----------------------------------------------------------------------------


class _Tally:
    """Thread-safe counters of one soak run."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: Counter[int] = Counter()
        self.by_case: dict[str, Counter[str]] = {}
        self.lost: Counter[str] = Counter()
        self.requests = 0

    def record(self, case: str, outcome: int | str) -> None:
        with self.lock:
            self.requests += 1
            self.by_case.setdefault(case, Counter())[str(outcome)] += 1
            if isinstance(outcome, int):
                self.statuses[outcome] += 1
            else:
                self.lost[outcome] += 1


def _check_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if host not in LOOPBACK:
        raise SystemExit(f"agentkv bench soak only sends to loopback, not {host!r}")


def _worker(config: SoakConfig, url: str, seed: int, deadline: float, budget: Iterator[int], tally: _Tally) -> None:
    rng = random.Random(seed)
    ctx = SoakContext(config.model, config.api_key)
    names = _sendable_cases(config)
    weights = [CASES[n][1] for n in names]
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT, trust_env=False) as client:
        while time.monotonic() < deadline and next(budget, None) is not None:
            case = choose_case(rng, names, weights)
            request = CASES[case][0](ctx, rng)
            headers = request.headers
            if request.body is not None and not any(name.lower() == "content-type" for name, _ in headers):
                headers = [("Content-Type", "application/json"), *headers]
            try:
                response = client.request(request.method, request.path, headers=headers, content=request.body)
                outcome: int | str = response.status_code
            except httpx.TransportError as exc:  # no response: the request was lost
                outcome = type(exc).__name__
            tally.record(case, outcome)


def _sendable_cases(config: SoakConfig) -> list[str]:
    """The cases of ``config`` that can be sent: those that need an API key only with ``api_key``."""
    return [name for name in config.cases if config.api_key or not CASES[name][2]]


def _check_cases(config: SoakConfig) -> None:
    """ValueError unless the cases are known and at least one can be sent (some need ``api_key``)."""
    unknown = set(config.cases) - set(CASES)
    if unknown:
        raise ValueError(f"unknown soak cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    if not _sendable_cases(config):
        raise ValueError(f"every case of {', '.join(config.cases)} needs --api-key")


def run_soak(config: SoakConfig, url: str, pid: int | None) -> dict[str, Any]:
    """Send the traffic to ``url`` (loopback) and return the report (see ``format_report``)."""
    _check_loopback(url)
    _check_cases(config)
    tally = _Tally()
    lock = threading.Lock()
    counter = iter(range(config.max_requests))

    def budget() -> Iterator[int]:
        while True:
            with lock:
                item = next(counter, None)
            if item is None:
                return
            yield item

    started = time.monotonic()
    deadline = started + config.minutes * 60
    with _RssSampler(pid, config.rss_interval) as rss:
        workers = [threading.Thread(target=_worker, args=(config, url, config.seed * 1000 + i, deadline, budget(),
                                                          tally), name=f"soak-{i}") for i in range(config.concurrency)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    elapsed = time.monotonic() - started
    return {
        "url": url,
        "seconds": round(elapsed, 1),
        "requests": tally.requests,
        "statuses": {str(code): n for code, n in sorted(tally.statuses.items())},
        "server_errors": sum(n for code, n in tally.statuses.items() if code >= 500),
        "lost": sum(tally.lost.values()),
        "lost_by_error": dict(tally.lost),
        "by_case": {case: dict(sorted(c.items())) for case, c in sorted(tally.by_case.items())},
        "rss": rss.samples,
        "config": {"minutes": config.minutes, "max_requests": config.max_requests, "concurrency": config.concurrency,
                   "api_key": config.api_key is not None, "cases": config.cases, "seed": config.seed},
    }


def format_report(report: dict[str, Any]) -> str:
    seconds = max(report["seconds"], 1e-9)
    lines = [f"soak: {report['requests']} requests in {report['seconds']:.0f} s "
             f"({report['requests'] / seconds:.1f}/s) against {report['url']}",
             "statuses: " + ", ".join(f"{code} x {n}" for code, n in report["statuses"].items()),
             f"5xx: {report['server_errors']}   lost (no response): {report['lost']} {report['lost_by_error'] or ''}",
             "by case:"]
    for case, outcomes in report["by_case"].items():
        counts = ", ".join(f"{k} x {v}" for k, v in outcomes.items())
        lines.append(f"  {case:<18} {sum(outcomes.values()):>6}  {counts}")
    if report["rss"]:
        names = list(dict.fromkeys(name for sample in report["rss"] for name in sample["processes"]))
        lines.append(f"RSS (MB): {'t (s)':>7}  " + "  ".join(f"{n:>22}" for n in names) + f"  {'total':>8}")
        for sample in report["rss"]:
            cells = "  ".join(f"{sample['processes'].get(n, float('nan')):>22.1f}" for n in names)
            lines.append(f"          {sample['t']:>7.1f}  {cells}  {sample['total_mb']:>8.1f}")
    return "\n".join(lines)


# -- command line -------------------------------------------------------------------------


@contextlib.contextmanager
def _own_server(config: SoakConfig) -> Iterator[tuple[str, int | None]]:
    from agentkv.launcher import ServerProcess, ServerSpec
    from agentkv.testing.tiny_model import build_tiny_model

    model_dir = build_tiny_model(REPO_ROOT / ".build" / "tiny-model")
    spec = ServerSpec(model_dir=model_dir, served_model_name=config.model, num_gpu_blocks=config.blocks,
                      module="agentkv.serve", extra_args=["--api-key", config.api_key] if config.api_key else [])
    config.out.mkdir(parents=True, exist_ok=True)
    with ServerProcess(spec, log_path=config.out / "agentkv-server.log", base_env=SERVER_ENV, isolated=True) as server:
        yield server.base_url, server.pid


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="a running agentkv server on loopback (default: start a tiny-model one)")
    parser.add_argument("--pid", type=int, help="with --url: the API server's pid, to sample RSS")
    parser.add_argument("--minutes", type=at_least(float, 0.0, strict=True), default=SoakConfig.minutes)
    parser.add_argument("--max-requests", type=at_least(int, 1), default=SoakConfig.max_requests)
    parser.add_argument("--concurrency", type=at_least(int, 1), default=SoakConfig.concurrency)
    parser.add_argument("--api-key", help="the server's --api-key (a started server gets it)")
    parser.add_argument("--cases", type=names_from(CASES, "cases"), default=list(CASES),
                        help="comma-separated subset of: " + ", ".join(CASES))
    parser.add_argument("--rss-interval", type=at_least(float, 0.0, strict=True), default=SoakConfig.rss_interval,
                        help="seconds")
    parser.add_argument("--seed", type=int, default=SoakConfig.seed)
    parser.add_argument("--model", default=SoakConfig.model, help="served model name")
    parser.add_argument("--blocks", type=at_least(int, 2), default=SoakConfig.blocks,
                        help="a started server's KV blocks")
    parser.add_argument("--out", type=Path, default=SoakConfig.out, help="report soak.json and server log here")


def main(args: argparse.Namespace) -> None:
    config = SoakConfig(url=args.url, pid=args.pid, minutes=args.minutes, max_requests=args.max_requests,
                        concurrency=args.concurrency, api_key=args.api_key,
                        cases=list(args.cases), rss_interval=args.rss_interval,
                        seed=args.seed, model=args.model, blocks=args.blocks, out=args.out)
    try:
        _check_cases(config)  # before a server is started for nothing
    except ValueError as exc:
        raise SystemExit(f"agentkv bench soak: error: {exc}") from None
    if config.url:
        _check_loopback(config.url)
        server: contextlib.AbstractContextManager[tuple[str, int | None]] = contextlib.nullcontext(
            (config.url, config.pid))
    else:
        server = _own_server(config)
    with server as (url, pid):
        report = run_soak(config, url, pid)
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "soak.json").write_text(json.dumps(report, indent=1))
    print(format_report(report))
    print(f"report: {config.out / 'soak.json'}")
