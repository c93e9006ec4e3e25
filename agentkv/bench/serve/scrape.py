"""What the benchmark reads from the servers: vLLM's prefix-cache counters (Prometheus text),
agentkv's warm-up outcomes and its recent recognitions."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agentkv.protocol import STATS_PATH

__all__ = ["engine_counters", "engine_recognitions", "engine_warmups", "prefix_cache_counters"]

_HITS, _QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def prefix_cache_counters(metrics_text: str) -> tuple[float, float]:
    """(hits, queries) in tokens: vLLM's prefix-cache counters summed over their label sets."""
    totals = {_HITS: 0.0, _QUERIES: 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals[_HITS], totals[_QUERIES]


async def engine_counters(client: httpx.AsyncClient, engines: Sequence[str]) -> list[tuple[float, float]]:
    """(hits, queries) of each engine."""
    counters = []
    for root in engines:
        response = await client.get(root + "/metrics")
        response.raise_for_status()
        counters.append(prefix_cache_counters(response.text))
    return counters


async def engine_warmups(client: httpx.AsyncClient, engines: Sequence[str]) -> collections.Counter[str] | None:
    """The warm-up outcomes the agentkv engines counted (``warmups`` of their stats), summed, with
    the useful ones' leads by bucket (``lead_le_0.05``, ..., ``lead_over_30``); None when an
    engine's stats cannot be read (a difference with a read that failed would be no count at all)."""
    total: collections.Counter[str] = collections.Counter()
    for root in engines:
        try:
            response = await client.get(root + STATS_PATH)
            response.raise_for_status()
            outcomes = response.json().get("warmups") or {}
            total.update({k: int(outcomes.get(k, 0)) for k in ("sent", "useful", "wasted", "redundant")})
            lead = outcomes.get("useful_lead_s")
            if lead and lead["bounds"]:
                bounds = lead["bounds"]
                names = [*(f"lead_le_{bound:g}" for bound in bounds), f"lead_over_{bounds[-1]:g}"]
                total.update(dict(zip(names, map(int, lead["counts"]), strict=False)))
        except (httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError):
            return None
    return total


async def engine_recognitions(client: httpx.AsyncClient, engines: Sequence[str]) -> list[list[Any]]:
    """The engines' recent recognitions: [request id, agent, session, prompt tokens], in arrival order."""
    out: list[list[Any]] = []
    for root in engines:
        response = await client.get(root + "/agentkv/v1/recognized")
        response.raise_for_status()
        out += response.json()["recognized"]
    return out
