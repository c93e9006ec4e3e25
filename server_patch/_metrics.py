"""agentkv's counters in Prometheus text format, rendered from a stats document."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

__all__ = ["render_metrics"]

_Family = CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily


class _StatsCollector(Collector):
    def __init__(self, stats: dict[str, Any], strict: bool) -> None:
        self._stats = stats
        self._strict = strict

    def collect(self) -> Iterator[_Family]:
        stats = self._stats
        agents = stats.get("agents", {})
        families = (
            ("agentkv_prefix_cache_queries", "Prompt tokens of tagged requests, by agent", "queries"),
            ("agentkv_prefix_cache_hits", "Prompt tokens served from the prefix cache, by agent", "hits"),
        )
        for name, documentation, key in families:
            counter = CounterMetricFamily(name, documentation, labels=["agent"])
            for agent, row in agents.items():
                counter.add_metric([agent], row.get(key, 0))
            yield counter
        survival = GaugeMetricFamily("agentkv_survival", "P(agent runs within the horizon)", labels=["agent"])
        blocks = GaugeMetricFamily("agentkv_cached_blocks", "Tracked cached blocks by agent and class",
                                   labels=["agent", "class"])
        for agent, row in agents.items():
            survival.add_metric([agent], row.get("survival", 0.0))
            blocks.add_metric([agent, "anchor"], row.get("anchor_blocks", 0))
            blocks.add_metric([agent, "history"], row.get("history_blocks", 0))
        yield survival
        yield blocks
        yield from _anchor_and_warmup_families(stats)
        evictions = CounterMetricFamily("agentkv_evictions", "Evicted cached blocks by class", labels=["class"])
        for kind, count in stats.get("evictions", {}).items():
            evictions.add_metric([kind], count)
        yield evictions
        malformed = CounterMetricFamily("agentkv_malformed_metadata", "Malformed tags ignored, by field",
                                        labels=["field"])
        for field, count in stats.get("malformed_metadata", {}).items():
            malformed.add_metric([field], count)
        yield malformed
        yield CounterMetricFamily(
            "agentkv_dispatches", "Agent dispatches learned from", value=stats.get("dispatches", 0)
        )
        yield GaugeMetricFamily("agentkv_predictability", "R = 1 - H(next|current)/H(next)",
                                value=stats.get("predictability", 0.0))
        accuracy = stats.get("top1_accuracy")
        yield GaugeMetricFamily("agentkv_top1_accuracy", "Online top-1 next-agent accuracy",
                                value=float("nan") if accuracy is None else accuracy)
        yield GaugeMetricFamily("agentkv_policy_survival", "1 while eviction is survival-scored, 0 for LRU",
                                value=1.0 if stats.get("policy") == "survival" else 0.0)
        yield GaugeMetricFamily("agentkv_learner_bytes", "Size of the learned state",
                                value=stats.get("learner", {}).get("bytes", 0))
        yield GaugeMetricFamily("agentkv_strict_metadata", "1 when malformed tags are refused with 400",
                                value=1.0 if self._strict else 0.0)


def _anchor_and_warmup_families(stats: dict[str, Any]) -> Iterator[_Family]:
    """Anchor residency (what a warm-up coordinator polls) and the server-side warm-up outcomes."""
    length = GaugeMetricFamily("agentkv_anchor_length_blocks", "Learned anchor length in blocks, by agent",
                               labels=["agent"])
    resident = GaugeMetricFamily("agentkv_anchor_resident_blocks",
                                 "Leading blocks of the agent's anchor cached now", labels=["agent"])
    for agent, row in stats.get("agents", {}).items():
        length.add_metric([agent], row.get("anchor_length_blocks", 0))
        resident.add_metric([agent], row.get("anchor_resident_blocks", 0))
    yield length
    yield resident
    free = stats.get("kv_free_blocks")
    if free is not None:
        yield GaugeMetricFamily("agentkv_kv_free_blocks", "KV blocks free or evictable", value=free)
    warmups = stats.get("warmups", {})
    outcomes = CounterMetricFamily("agentkv_warmups", "Warm-up requests by outcome (sent = useful + wasted + "
                                   "redundant + pending)", labels=["outcome"])
    for outcome in ("sent", "useful", "wasted", "redundant"):
        outcomes.add_metric([outcome], warmups.get(outcome, 0))
    yield outcomes
    yield GaugeMetricFamily("agentkv_warmups_pending", "Warm-ups waiting for their agent's next request",
                            value=warmups.get("pending", 0))
    lead = warmups.get("useful_lead_s")
    if lead is not None:
        cumulative = list(itertools.accumulate(lead["counts"]))
        bounds = [*(f"{bound:g}" for bound in lead["bounds"]), "+Inf"]
        yield HistogramMetricFamily("agentkv_warmup_lead_seconds",
                                    "Time from a useful warm-up's admission to its agent's call's",
                                    buckets=list(zip(bounds, cumulative, strict=True)), sum_value=lead["sum"])


def render_metrics(stats: dict[str, Any], strict: bool) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats, strict))
    return generate_latest(registry)
