"""SessionTiming's learned distributions in a snapshot (``_snapshot.py``): exported and validated.

Kept: the gap histograms (per agent and pooled), how often each agent's request was followed by
one of the same dispatch or of the next (also after a told answer; decayed), the ended sessions' length
histogram and the counters. Not kept: the live sessions (transient, like the learner's) and the
pace of session starts: its clock point means nothing after a restart, and the recent intervals
are a pace of the traffic before it (a restart often changes that); two new starts learn it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from agentkv.protocol import validate_id

from ._timing import _BINS, _EDGE_LIST, _LENGTH_DECAY, _MAX_LENGTH, SessionTiming, TimingConfig

__all__ = ["export_timing", "import_timing"]

_MAX_COUNT = 1e15  # any total of counts that are not decayed: sums stay exact below
_MAX_WEIGHT = 1e100  # ``_add_gap`` rescales a weight past this back to 1
_MAX_TALLY = 2**62  # the largest count a snapshot may hold (older ones held all-time counts of what followed)


def export_timing(timing: SessionTiming) -> dict[str, Any]:
    """A copy of ``timing``'s learned distributions (cheap: the engine's lock is held meanwhile)."""
    agents = list(timing._hist)
    told = timing._after_told
    return {
        "edges": list(_EDGE_LIST),  # the bins the counts are of: another layout is not read as this one
        "agents": agents,  # least recently seen first (the first recycled)
        "gaps": [[row[:] for row in hist] for hist in timing._hist.values()],  # [tool, hand-off] x bins
        "weights": [timing._weight[agent] for agent in agents],  # the counts are stored multiplied by these
        # decayed counts of the requests followed by one of the same dispatch, and of the next
        "continued": [timing._followed.get(agent, (0.0, 0.0))[0] for agent in agents],
        "handed_off": [timing._followed.get(agent, (0.0, 0.0))[1] for agent in agents],
        # [same dispatch, next] after an answer without, and with, a tool call
        "after_told": [[[*told.get((agent, tool_call), (0.0, 0.0))] for tool_call in (False, True)]
                       for agent in agents],
        "global": [row[:] for row in timing._global],
        "global_weight": timing._global_weight,
        "lengths": timing._lengths.tolist(),
        "tallies": {"gaps": timing._gaps, "starts": timing._starts, "ends": timing._ends},
    }


def import_timing(state: object, config: TimingConfig | None = None) -> SessionTiming:
    """A SessionTiming that knows what ``state`` (an ``export_timing``) learned, with no live
    sessions; ValueError naming the first thing wrong with it."""
    if type(state) is not dict:
        raise ValueError("the timing part must be an object")
    if state.get("edges") != list(_EDGE_LIST):
        raise ValueError("timing: gap counts of other bins than this agentkv's")
    timing = SessionTiming(config)
    agents = state["agents"]
    if type(agents) is not list or len(agents) > timing.config.max_agents:
        raise ValueError(f"timing: agents must be a list of at most {timing.config.max_agents} names")
    for name in agents:
        validate_id(name, "agent")
    if len(set(agents)) != len(agents):
        raise ValueError("timing: agent names repeat")
    n = len(agents)
    # Decayed counts beyond what decay lets a SessionTiming of this half-life hold are refused (the part
    # dropped with a warning), not scaled down: no such SessionTiming wrote them, so, like the learner's
    # counts past their bound, they are corrupt or forged, and scaled they would pass for a real history.
    gaps_bound = _decayed_total(timing._decay)  # per agent, and the pooled gaps (one decay per gap)
    weights = _numbers(state["weights"], n, "weights", _MAX_WEIGHT, low=1.0)
    gaps = _list(state["gaps"], n, "gaps")
    followed = zip(_numbers(state["continued"], n, "continued", _MAX_TALLY),
                   _numbers(state["handed_off"], n, "handed_off", _MAX_TALLY), strict=True)
    told = _list(state["after_told"], n, "after_told")
    for agent, rows, weight, told_rows, pair in zip(agents, gaps, weights, told, followed, strict=True):
        timing._hist[agent] = _histogram(rows, weight, gaps_bound, f"gaps of {agent!r}")
        timing._weight[agent] = weight
        if any(pair):
            timing._followed[agent] = _decayed_pair(pair, gaps_bound)
        for tool_call, told_pair in zip((False, True), _list(told_rows, 2, "after_told"), strict=True):
            same_next = _numbers(told_pair, 2, "after_told", _MAX_TALLY)
            if any(same_next):
                timing._after_told[agent, tool_call] = _decayed_pair(same_next, gaps_bound)
    global_weight = _numbers([state["global_weight"]], 1, "global_weight", _MAX_WEIGHT, low=1.0)[0]
    timing._global = _histogram(state["global"], global_weight, gaps_bound, "global gaps")
    timing._global_weight = global_weight
    lengths_bound = _decayed_total(1.0 / _LENGTH_DECAY)  # one decay per ended session
    lengths = _numbers(state["lengths"], _MAX_LENGTH, "lengths", lengths_bound)
    if not sum(lengths) <= lengths_bound:
        raise ValueError(f"timing: lengths must total at most {lengths_bound:g}")
    timing._lengths = np.array(lengths, dtype=float)
    tallies = state["tallies"]
    if type(tallies) is not dict:
        raise ValueError("timing: tallies must be an object")
    timing._gaps, timing._starts, timing._ends = _tallies([tallies[k] for k in ("gaps", "starts", "ends")], 3,
                                                          "tallies")
    return timing


def _list(value: object, length: int, what: str) -> list[Any]:
    if type(value) is not list or len(value) != length:
        raise ValueError(f"timing: {what} must be a list of {length}")
    return value


def _numbers(value: object, length: int, what: str, high: float, low: float = 0.0) -> list[float]:
    """``length`` numbers in [low, high] (NaN and infinities fail the comparison), as floats."""
    numbers = _list(value, length, what)
    if not all(type(x) in (int, float) and low <= x <= high for x in numbers):
        raise ValueError(f"timing: {what} must be numbers in [{low:g}, {high:g}]")
    return [float(x) for x in numbers]


def _tallies(value: object, length: int, what: str) -> list[int]:
    numbers = _list(value, length, what)
    if not all(type(x) is int and 0 <= x < _MAX_TALLY for x in numbers):
        raise ValueError(f"timing: {what} must be integers in [0, 2**62)")
    return numbers


def _decayed_pair(pair: Sequence[float], bound: float) -> list[float]:
    """A pair of decayed counts, scaled down to total ``bound`` if it holds more: a snapshot of agentkv
    before these counts decayed holds all-time counts, whose ratio is what they tell; the scaled pair
    weighs what a long-running server's decayed one would."""
    total = sum(pair)
    return [x * bound / total for x in pair] if total > bound else list(pair)


def _decayed_total(growth: float) -> float:
    """The most decayed counts can total when each new count weighs ``growth`` times the one before
    (the older ones divided by it): 1 + 1/growth + 1/growth**2 + ... = growth / (growth - 1), 721.8 at a
    half-life of 500 gaps, plus rounding's slack (``growth - 1`` is exact, ``1 - 1/growth`` is not);
    ``_MAX_COUNT`` when little or nothing is forgotten."""
    return min(growth / (growth - 1.0) * (1.0 + 1e-6), _MAX_COUNT) if growth > 1.0 else _MAX_COUNT


def _histogram(value: object, weight: float, bound: float, what: str) -> list[list[float]]:
    """Two rows (tool, hand-off) of ``_BINS`` decayed counts, multiplied by ``weight``, totalling at most ``bound``."""
    rows = [_numbers(row, _BINS, what, bound * weight) for row in _list(value, 2, what)]
    if not sum(map(sum, rows)) / weight <= bound:
        raise ValueError(f"timing: {what} must total at most {bound:g}")
    return rows
