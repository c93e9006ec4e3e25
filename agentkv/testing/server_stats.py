"""Reading a real agentkv server's stats in tests: fetch, wait, and deltas since a snapshot.

A server fixture may be shared by several test modules that run in any order, so a test
asserts on what changed since it started (:class:`StatsSnapshot`), never on counters since
the server started.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from agentkv.protocol import STATS_MAX_AGE, STATS_PATH

__all__ = ["StatsSnapshot", "cached_tokens", "fetch_stats", "learned", "wait_for"]


def fetch_stats(base_url: str, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``GET /agentkv/v1/stats`` of the server at ``base_url`` (loopback, no proxy), no older than
    the call: the server serves a document again for up to ``STATS_MAX_AGE``, and a younger one
    may predate the requests sent just before (another test's, on a shared server)."""
    time.sleep(STATS_MAX_AGE)
    response = httpx.get(base_url + STATS_PATH, headers=dict(headers or {}), trust_env=False, timeout=30)
    response.raise_for_status()
    return response.json()


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``check`` until true (background event delivery is asynchronous)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@dataclass(frozen=True)
class StatsSnapshot:
    """The stats document of one server at one moment, to measure what a test added.

    Invariant: ``before`` is never modified; every delta is ``now - before`` for a counter
    that only grows, so a delta counts exactly the traffic sent since :meth:`take`
    (plus any concurrent traffic, which the test suite never sends).
    """

    base_url: str
    before: dict[str, Any]

    @classmethod
    def take(cls, base_url: str) -> StatsSnapshot:
        time.sleep(STATS_MAX_AGE)  # a younger document may predate the traffic sent before the test
        return cls(base_url, fetch_stats(base_url))

    def now(self) -> dict[str, Any]:
        time.sleep(STATS_MAX_AGE)  # ... or predate the test's own last requests
        return fetch_stats(self.base_url)

    def delta(self, *path: str, now: Mapping[str, Any] | None = None) -> float:
        """How much the counter at ``path`` (e.g. ``"sessions", "ended"``) grew; absent counts as 0."""
        return _counter(now if now is not None else self.now(), path) - _counter(self.before, path)

    def agent_delta(self, agent: str, counter: str = "queries", now: Mapping[str, Any] | None = None) -> float:
        """How much ``agent``'s per-agent counter grew (an agent first seen since the snapshot started at 0)."""
        return self.delta("agents", agent, counter, now=now)


def _counter(document: Mapping[str, Any], path: tuple[str, ...]) -> float:
    value: Any = document
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return 0.0
        value = value[key]
    return float(value)


def learned(stats: Mapping[str, Any], agent: str, successor: str) -> bool:
    """Whether the server's most likely next agent after ``agent`` is ``successor``, by far.

    The server smooths every row over all the agents it has seen, so the probability depends
    on every agent any test sent to that server: the tests that check it use a server of their
    module's own.
    """
    row = stats["transitions"][agent]
    others = [p for a, p in row.items() if a != successor]
    return row.get(successor, 0.0) >= 5 * max(others, default=0.0) and row.get(successor, 0.0) > 0.5


def cached_tokens(client: httpx.Client, prompt: list[int], headers: Mapping[str, str] | None = None) -> int:
    """Send ``prompt`` (token ids) as a one-token completion of the tiny model; the prompt tokens
    the server reports it found cached."""
    response = client.post("/v1/completions", headers=headers,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    response.raise_for_status()
    return (response.json()["usage"]["prompt_tokens_details"] or {}).get("cached_tokens") or 0
