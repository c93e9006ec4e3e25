"""How close a server's eviction came to the best possible: its request trace under LRU and Belady.

``agentkv serve`` with ``AGENTKV_TRACE=PATH`` writes one line per admitted request (its prompt's
block keys and the tokens it found cached, ``server_patch/_trace.py``). This replays that trace
through a prefix cache of the same size under LRU and under Belady (evict the block whose next use
is furthest: the classic offline optimum, which needs the future) and compares both with what the
server measured. The replay is sequential (one request at a time, each holding its prompt's full blocks,
outputs not cached), the way a lightly loaded server sees the traffic: the server's own figure can
differ a little either way (requests that run together pin more blocks; generated blocks are cached).

    agentkv bench bound TRACE [--blocks N]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv._arguments import at_least

from .tape.format import Tape, TapeRequest, write_tape

__all__ = ["Bound", "Trace", "TraceError", "TraceRequest", "bound", "main", "read_trace", "to_tape"]


class TraceError(ValueError):
    """A trace that cannot be replayed (no usable line, mixed block sizes, a pool too small)."""


@dataclass(frozen=True)
class TraceRequest:
    id: str
    t: float  # arrival (wall clock, s)
    tokens: int
    hit: int  # tokens the server found cached
    blocks: tuple[str, ...]  # keys of the prompt's full blocks, in order
    agent: str | None = None  # as the server took the request (None: untagged, unrecognized)
    session: str | None = None
    parent: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    block_size: int
    pool_blocks: int | None
    skipped: int  # malformed lines and repeated admissions (a preempted request admitted again)


def _text_or_none(value: object) -> str | None:
    return None if value is None or isinstance(value, bool) else str(value)


def read_trace(path: str | Path) -> Trace:
    """The admissions of ``path`` in order, each request once; malformed lines are skipped and counted."""
    requests: list[TraceRequest] = []
    seen: set[str] = set()
    sizes: set[int] = set()
    pools: set[int] = set()
    skipped = 0
    with open(path, encoding="utf-8", errors="replace") as f:  # an undecodable line is malformed, not fatal
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                request_id, t, tokens, hit = str(row["id"]), float(row["t"]), int(row["tokens"]), int(row["hit"])
                blocks, size = tuple(str(b) for b in row["blocks"]), int(row["block_size"])
                pool = row.get("pool_blocks")
                agent, session, parent, step = map(_text_or_none, map(row.get, ("agent", "session", "parent", "step")))
            except (ValueError, KeyError, TypeError, OverflowError):
                skipped += 1
                continue
            if request_id in seen or size < 1 or tokens < 1 or not 0 <= hit <= tokens or len(blocks) > tokens // size \
                    or not math.isfinite(t):
                skipped += 1
                continue
            seen.add(request_id)
            sizes.add(size)
            if isinstance(pool, int) and pool > 0:
                pools.add(pool)
            requests.append(TraceRequest(request_id, t, tokens, hit, blocks, agent, session, parent,
                                         int(step) if step is not None and step.isdigit() else None))
    if not requests:
        raise TraceError(f"{path}: no request line to replay ({skipped} skipped)")
    if len(sizes) > 1:
        raise TraceError(f"{path}: lines of block sizes {sorted(sizes)}; trace one server at a time")
    return Trace(tuple(requests), sizes.pop(), max(pools) if len(pools) == 1 else None, skipped)


@dataclass(frozen=True)
class Bound:
    requests: int
    prompt_tokens: int
    capacity: int
    measured: float  # share of prompt tokens the server found cached
    lru: float
    belady: float

    @property
    def closed(self) -> float:
        """The share of the LRU -> Belady gap the server closed (NaN when there is none)."""
        gap = self.belady - self.lru
        return (self.measured - self.lru) / gap if gap > 0 else math.nan

    def to_json(self) -> dict[str, Any]:
        """The figures as JSON values (``closed`` null when LRU and Belady hit alike: NaN is not JSON)."""
        closed = self.closed
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens, "capacity": self.capacity,
                "measured": self.measured, "lru": self.lru, "belady": self.belady,
                "closed": None if math.isnan(closed) else closed}


def _hit_tokens(request: TraceRequest, hit_blocks: int, block_size: int) -> int:
    # vLLM computes a prompt's last token whatever is cached
    return min(hit_blocks * block_size, (request.tokens - 1) // block_size * block_size)


def _cached_prefix(blocks: Sequence[str], cache: Any) -> int:
    hit = 0
    for key in blocks:
        if key not in cache:
            break
        hit += 1
    return hit


def _lru(trace: Trace, capacity: int, counted: Sequence[bool]) -> int:
    """Hit tokens under LRU. Invariant: ``cache`` is ordered least recently used first, and a
    request's blocks are touched from its last to its first (vLLM frees a chain in reverse),
    so a prefix's children go before their parents."""
    cache: OrderedDict[str, None] = OrderedDict()
    hits = 0
    for request, count in zip(trace.requests, counted, strict=True):
        if count:
            hits += _hit_tokens(request, _cached_prefix(request.blocks, cache), trace.block_size)
        for key in reversed(request.blocks):
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def _belady(trace: Trace, capacity: int, counted: Sequence[bool]) -> int:
    """Hit tokens under Belady: at each eviction, the cached block whose next use is furthest.

    Invariant: every cached block has a heap entry (-next use, -depth, key) with its current
    next use; entries left behind when a block was used again are skipped when they surface.
    Of blocks next used together, the deepest go first (a child before its parent: a prefix
    without its parent is never hit).
    """
    uses: dict[str, list[int]] = defaultdict(list)
    for index, request in enumerate(trace.requests):
        for key in dict.fromkeys(request.blocks):
            uses[key].append(index)
    never = len(trace.requests)
    cache: dict[str, int] = {}  # key -> its next use
    heap: list[tuple[int, int, str]] = []
    hits = 0
    for index, (request, count) in enumerate(zip(trace.requests, counted, strict=True)):
        if count:
            hits += _hit_tokens(request, _cached_prefix(request.blocks, cache), trace.block_size)
        for depth, key in enumerate(request.blocks):
            times = uses[key]
            position = bisect.bisect_right(times, index)
            cache[key] = times[position] if position < len(times) else never
            heapq.heappush(heap, (-cache[key], -depth, key))
        while len(cache) > capacity:
            negative, _, key = heapq.heappop(heap)
            if cache.get(key) == -negative:
                del cache[key]
    return hits


def bound(trace: Trace, capacity: int | None = None, *, skip_sessions: str | None = None) -> Bound:
    """LRU and Belady on ``trace`` with ``capacity`` blocks (default: the traced server's pool).
    Requests of sessions whose id starts with ``skip_sessions`` (e.g. a benchmark's warm-up) fill
    the cache but are not counted, in the server's figure as in the replays."""
    capacity = capacity or trace.pool_blocks
    if capacity is None:
        raise TraceError("the trace does not say the pool's size: pass --blocks")
    largest = max(len(r.blocks) for r in trace.requests)
    if capacity < largest:
        raise TraceError(f"{capacity} blocks cannot hold the trace's largest prompt ({largest} full blocks)")
    counted = [not (skip_sessions and (r.session or "").startswith(skip_sessions)) for r in trace.requests]
    total = sum(r.tokens for r, count in zip(trace.requests, counted, strict=True) if count)
    if not total:
        raise TraceError(f"no request outside the sessions starting with {skip_sessions!r}")
    measured = sum(r.hit for r, count in zip(trace.requests, counted, strict=True) if count)
    return Bound(sum(counted), total, capacity, measured / total,
                 _lru(trace, capacity, counted) / total, _belady(trace, capacity, counted) / total)


def to_tape(trace: Trace, name: str) -> Tape:
    """The trace as a tape (docs/tapes.md), so that ``agentkv bench replay`` runs every policy on it.

    Each full block is a segment keyed by its block key (``anchor/...`` when two sessions sent
    it, for the report's split only), the rest of a prompt a segment of its own. Arrivals keep
    their times (``tool_gap`` 0: a request arrives when it did, or when its session's previous
    one finished in the replay, if later); outputs are one token (the trace does not say how
    many were generated). Requests the server took for no agent or session are single-request
    sessions of agent ``untagged``.
    """
    sessions: dict[str, set[str]] = defaultdict(set)
    for request in trace.requests:
        for key in request.blocks:
            sessions[key].add(request.session or request.id)
    start = min(r.t for r in trace.requests)
    lines = []
    for request in trace.requests:
        segments = [(f"anchor/{key}" if len(sessions[key]) > 1 else f"b/{key}", trace.block_size)
                    for key in request.blocks]
        rest = request.tokens - len(request.blocks) * trace.block_size
        if rest:
            segments.append((f"{request.id}/rest", rest))
        lines.append(TapeRequest(id=request.id, t=request.t - start,
                                 session=request.session or f"untagged-{request.id}", agent=request.agent or "untagged",
                                 parent=request.parent, segments=tuple(segments), output_tokens=1, tool_gap=0.0,
                                 step=request.step))
    lines.sort(key=lambda r: r.t)
    return Tape({"format": "agentkv-tape", "version": 1, "block_size": trace.block_size, "name": name}, lines)


def describe(result: Bound, trace: Trace) -> list[str]:
    closed = "" if math.isnan(result.closed) else f"; the server closed {result.closed:.0%} of the LRU -> Belady gap"
    return [
        f"{result.requests} requests counted ({trace.skipped} lines skipped), {result.prompt_tokens} prompt tokens, "
        f"block size {trace.block_size}, {result.capacity} blocks",
        f"prompt tokens found cached: server {result.measured:.1%}, LRU {result.lru:.1%}, "
        f"Belady {result.belady:.1%} (evicting by the future){closed}",
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="a trace written by agentkv serve with AGENTKV_TRACE=PATH")
    parser.add_argument("--blocks", type=at_least(int, 1), default=None,
                        help="cache size in blocks (default: the traced server's pool)")
    parser.add_argument("--skip-sessions", metavar="PREFIX", default=None,
                        help="requests of sessions whose id starts with PREFIX fill the cache but are not counted")
    parser.add_argument("--tape", metavar="PATH", default=None,
                        help="also write the trace as a tape (replay it with agentkv bench replay --capacities N+1: "
                        "vLLM's null block)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        trace = read_trace(args.trace)
        result = bound(trace, args.blocks, skip_sessions=args.skip_sessions)
    except (OSError, TraceError) as exc:
        print(f"agentkv bench bound: {exc}")
        return 2
    print(json.dumps(result.to_json()) if args.json else "\n".join(describe(result, trace)))
    if args.tape:
        write_tape(to_tape(trace, Path(args.trace).stem), args.tape)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentkv bench bound", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
