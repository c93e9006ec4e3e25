"""The replay sweep: tapes x capacities x policies, with the pressure preflight (``agentkv bench replay``)."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._defaults import DEFAULT_MARGIN, DEFAULT_MULTIPLIERS, DEFAULT_POLICIES
from .plan import TapePlan
from .replay import CapacityError, replay, time_model_of
from .report import targets
from .tape import Tape, TapeError, TimeModel, read_tape

__all__ = ["candidate_capacities", "sweep"]

_log = logging.getLogger(__name__)


_PLANS: dict[str, TapePlan] = {}


def _plan(path: str) -> TapePlan:
    plan = _PLANS.get(path)
    if plan is None:
        try:
            tape = read_tape(path)
            model = time_model_of(tape)  # a bad workload.time_model fails here, named with its path
        except (TapeError, OSError) as exc:
            raise TapeError(f"{path}: {exc}") from exc
        if not tape.requests:
            raise TapeError(f"{path}: the tape has no requests to replay")
        restarts = _restarts(tape)
        if restarts > len(tape.requests) // 2:
            _log.warning('%s: %d of %d requests have parent "" after their session\'s first request (each starts a '
                         'new conversation, agentkv learns no transition from it); leave parent out if the tape '
                         'does not track it', path, restarts, len(tape.requests))
        plan = _PLANS[path] = TapePlan(tape)
        late, worst = _late_requests(plan, model)
        if late > len(tape.requests) // 20:
            _log.warning("%s: %d of %d requests arrive after their t with no cache hit and no queue: their "
                         "session's previous request, timed by the tape's time model, plus its tool_gap ends up to "
                         "%.1f s later (a session's calls are replayed one after another, parallel ones too); "
                         "requests start in tape order, so later ones wait behind them", path, late,
                         len(tape.requests), worst)
    return plan


def _late_requests(plan: TapePlan, model: TimeModel) -> tuple[int, float]:
    """(requests more than 1 s later than their ``t``, the latest by how much) when every request
    is served at once, with no cache hit: arrivals the tape's own times cannot have meant."""
    arrival = [request.t for request in plan.requests]
    late, worst = 0, 0.0
    for index, request in enumerate(plan.requests):
        following = plan.next_in_session[index]
        if following is not None:
            done = arrival[index] + model.duration(len(plan.prompts[index]), request.output_tokens)
            arrival[following] = max(arrival[following], done + request.tool_gap)
        behind = arrival[index] - request.t
        late += behind > 1.0
        worst = max(worst, behind)
    return late, worst


def _cell(path: str, name: str, policy: str, capacity: int, ttl: float | None) -> dict[str, Any]:
    result = replay(_plan(path), policy, capacity, ttl=ttl)
    out = result.to_json()
    out["tape"] = name
    return out


def tape_names(paths: Sequence[str], names: Sequence[str]) -> list[str]:
    """Report names of the tapes at ``paths``: each header's ``name``, except that tapes sharing
    one are named by their file (hand-written tapes often have none and all read ``tape``), and
    by their file with a count where those are alike too."""
    shared = {name for name in names if names.count(name) > 1}
    chosen = [Path(path).stem if name in shared else name for path, name in zip(paths, names, strict=True)]
    taken = {name for name in chosen if chosen.count(name) == 1}
    counts: dict[str, int] = {}
    out = []
    for name in chosen:
        if name not in taken:
            count = counts.get(name, 0) + 1
            while f"{name}-{count}" in taken:  # another tape's own name already reads so
                count += 1
            counts[name] = count
            name = f"{name}-{count}"
            taken.add(name)
        out.append(name)
    return out


def _restarts(tape: Tape) -> int:
    """Requests with parent "" in a session that already had one (the session id starts over)."""
    seen: set[str] = set()
    count = 0
    for request in tape.requests:
        count += request.parent == "" and request.session in seen
        seen.add(request.session)
    return count


def candidate_capacities(plan: TapePlan, multipliers: Sequence[float] = DEFAULT_MULTIPLIERS) -> list[int]:
    """Capacities in blocks: multiples of the tape's largest request (+1 for vLLM's null block), rounded to
    10 from 100 blocks on; below that rounded up, so that a tape of small requests keeps its multiples."""
    largest = plan.max_request_blocks
    sizes = (m * largest for m in multipliers if m >= 1)
    return sorted({(round(size / 10.0) * 10 if size >= 100 else math.ceil(size)) + 1 for size in sizes})


def sweep(paths: Sequence[str], *, policies: Sequence[str] = DEFAULT_POLICIES, capacities: Sequence[int] | None = None,
          multipliers: Sequence[float] = DEFAULT_MULTIPLIERS, margin: float = DEFAULT_MARGIN, preflight: bool = True,
          skip_dropped: bool = False, ttl: float | None = None, jobs: int = 2, progress: bool = True) -> dict[str, Any]:
    """Run every (tape, capacity, policy) cell; returns the report dict (see report.markdown)."""
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm

    tapes = []
    for path in paths:
        plan = _plan(path)
        caps = sorted(set(capacities)) if capacities else candidate_capacities(plan, multipliers)
        small = [c for c in caps if c - 1 < plan.max_request_blocks]
        if capacities and small:
            print(f"{path}: capacities {', '.join(map(str, small))} cannot hold the tape's largest request "
                  f"({plan.max_request_blocks} blocks + the null block): not run", file=sys.stderr)
        caps = [c for c in caps if c - 1 >= plan.max_request_blocks]
        if not caps:
            raise CapacityError(f"{path}: no capacity holds the tape's largest request "
                                f"({plan.max_request_blocks} blocks + the null block)")
        tapes.append({"path": path, "name": plan.tape.name, "topology": plan.topology_name,
                      "target_r": plan.tape.header.get("target_predictability"), "summary": plan.tape.summary(),
                      "max_request_blocks": plan.max_request_blocks, "anchor_blocks": plan.anchor_blocks,
                      "candidates": caps, "kept": list(caps)})
    names = tape_names(paths, [t["name"] for t in tapes])
    for tape, name in zip(tapes, names, strict=True):
        tape["name"] = name
    # every table of the report is relative to lru and belady: they always run and stay in it
    first = ["lru", "belady"]
    policies = [*(p for p in first if p not in policies), *policies]
    rest = [p for p in policies if p not in first]
    results: list[dict[str, Any]] = []
    total = sum(len(t["candidates"]) for t in tapes) * (len(first) + len(rest))
    bar = tqdm(total=total, desc="replay", unit="cell", disable=not progress, file=sys.stderr)
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=_mp_context()) if jobs > 1 else None

    def run(cells: list[tuple[str, str, str, int]]) -> None:
        if pool is None:
            for path, name, policy, cap in cells:
                results.append(_cell(path, name, policy, cap, ttl))
                bar.update(1)
            return
        futures = [pool.submit(_cell, path, name, policy, cap, ttl) for path, name, policy, cap in cells]
        for future in futures:
            results.append(future.result())
            bar.update(1)

    try:
        run([(t["path"], t["name"], p, c) for t in tapes for c in t["candidates"] for p in first])
        if preflight:
            done = _index(results)
            for t in tapes:
                t["kept"] = [c for c in t["candidates"]
                             if 100 * (done[t["name"], c, "belady"] - done[t["name"], c, "lru"]) >= margin]
        cells = [(t["path"], t["name"], p, c) for t in tapes
                 for c in (t["kept"] if skip_dropped else t["candidates"]) for p in rest]
        bar.total = len(results) + len(cells)
        bar.refresh()
        run(cells)
    finally:
        if pool is not None:
            pool.shutdown()
    bar.close()
    order = {p: i for i, p in enumerate(policies)}
    results.sort(key=lambda r: (names.index(r["tape"]), r["capacity"], order[r["policy"]]))
    report = {"policies": list(policies), "margin": margin, "preflight": preflight, "tapes": tapes, "results": results}
    report["targets"] = targets(report)
    return report


def _index(results: Sequence[dict[str, Any]]) -> dict[tuple[str, int, str], float]:
    return {(r["tape"], r["capacity"], r["policy"]): r["hit_rate"] for r in results}


def _mp_context() -> Any:
    import multiprocessing

    # fork shares the imported vLLM with the workers (spawn would re-import it per worker)
    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
