"""Bounded per-agent rows for stats and ``/metrics``: the busiest agents, the rest as OTHER."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["OTHER", "agent_rows", "tracked"]

OTHER = "(other)"  # not a valid agent id, so it never collides with an agent's name


def tracked(counter: Counter[str], agent: str, limit: int) -> str:
    """``agent`` while ``counter`` has room for it (``limit`` keys), else OTHER."""
    return agent if agent in counter or len(counter) < limit else OTHER


def agent_rows(
    names: Iterable[str],
    queries: Counter[str],
    hits: Counter[str],
    blocks: Mapping[str, Counter[str]],
    survival: Callable[[str], float],
    anchor_length: Callable[[str], int],
    anchor_resident: Callable[[str], int],
    listed: int,
) -> dict[str, dict[str, Any]]:
    """Rows of the ``listed`` agents with the most prompt tokens (sorted by name); every other
    agent's queries, hits and blocks summed into one OTHER row, so the totals are preserved."""
    ranked = sorted(set(names), key=lambda a: (-queries[a], a))
    rows: dict[str, dict[str, Any]] = {}
    for agent in sorted(ranked[:listed]):
        held = blocks.get(agent, Counter())
        rows[agent] = {
            "queries": queries[agent],
            "hits": hits[agent],
            "anchor_blocks": held["anchor"],
            "history_blocks": held["history"],
            "survival": 0.0 if agent == OTHER else survival(agent),
            "anchor_length_blocks": anchor_length(agent),
            "anchor_resident_blocks": 0 if agent == OTHER else anchor_resident(agent),
        }
    rest = ranked[listed:]
    if rest:
        other = rows.setdefault(OTHER, {"queries": 0, "hits": 0, "anchor_blocks": 0, "history_blocks": 0,
                                        "survival": 0.0, "anchor_length_blocks": 0,
                                        "anchor_resident_blocks": 0})
        for agent in rest:
            held = blocks.get(agent, Counter())
            other["queries"] += queries[agent]
            other["hits"] += hits[agent]
            other["anchor_blocks"] += held["anchor"]
            other["history_blocks"] += held["history"]
    return rows
