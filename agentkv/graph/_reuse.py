"""Next use of every cached group, anchors and session history alike, in one unit.

The value of keeping a block is the rate of its next use, in reuses per second, so that an
anchor, a session's history and an untagged prefix compare directly. One session's use of a
prefix at its k-th next dispatch, expected after time t, counts P(use at k) * (1 - exp(-tau/t)) /
tau: about P/t for t >> tau, and never more than one use per tau, the time resolution (the gap a
tenth of all learned gaps are shorter than). An anchor's rate combines every live session and the
sessions yet to start as independent chances of a use within tau, so that many unlikely uses do
not outweigh one near-certain use.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ._passage import by_origin, first_passage_steps
from ._predictor import ChainModel
from ._session_rates import SURE as _SURE
from ._session_rates import session_rates
from ._timing import GapTable, LiveSessions

__all__ = [
    "UNCACHED",
    "UNTAGGED",
    "Anchor",
    "Group",
    "History",
    "ReuseConfig",
    "ReuseTable",
    "Uncached",
    "Untagged",
    "recency_scorer",
    "score_reuse",
]


class Anchor(NamedTuple):
    """Blocks reused across sessions: the fixed prefix of ``agents`` (a shared prefix names several)."""

    agents: frozenset[str]


class History(NamedTuple):
    """Blocks of one session's conversation, behind the anchors of ``agents``."""

    session: str
    agents: frozenset[str]


class Untagged(NamedTuple):
    """Blocks of requests nobody described."""


class Uncached(NamedTuple):
    """Free blocks whose prefix-cache hash was dropped while they waited (a prefix-cache reset, a
    KV connector's invalidation): no request can hit them, so they are recycled first."""

    # a tuple of its own: without a field it would be ``()``, equal to ``Untagged()`` (one key of
    # the queue's groups, scored as whichever came first)
    uncached: None = None


UNTAGGED = Untagged()
UNCACHED = Uncached()
Group = Anchor | History | Untagged | Uncached


@dataclass(frozen=True, slots=True)
class ReuseConfig:
    """``r_min``: below this learned predictability every group scores alike (exact LRU), as they
    do while nothing is learned (no transition and no session start rate; sessions of one call
    each teach no transition, R = 0, but their agents' start rates rank the anchors). Off (0) by
    default: a chain that cannot tell the next agent (R near 0) still tells an anchor every
    session calls from one session's history, and ranking by it beats LRU by 8-10 points of hit
    rate on uniformly random routing (docs/server.md#the-eviction-order); set it to demand an
    order before acting on it.

    ``max_steps`` caps the dispatches looked ahead (the sum stops earlier once the chance of a
    first use at a further step is below ``step_tolerance``); ``steps`` fixes the count instead.
    ``end_floor`` is the least chance that a session ends after any dispatch. The time
    resolution tau is the gap that a share ``resolution_quantile`` of all learned gaps are
    shorter than, at least ``min_time`` (s): no sooner next use is told apart. ``dead_tail`` is
    the share of an agent's learned gaps beyond which an idle session counts as abandoned (after
    ``min_gaps`` gaps were seen; before, while there are at least ``min_gaps`` session starts per
    gap, every session not running counts as over: almost none continues). An untagged block is
    valued at ``untagged_weight`` times a typical live session's next use.
    """

    r_min: float = 0.0
    max_steps: int = 24
    steps: int | None = None
    step_tolerance: float = 0.002
    end_floor: float = 0.02
    min_time: float = 0.05
    resolution_quantile: float = 0.1
    dead_tail: float = 0.002
    min_gaps: int = 32
    untagged_weight: float = 0.5

    def __post_init__(self) -> None:
        if self.max_steps < 1 or (self.steps is not None and self.steps < 1):
            raise ValueError("max_steps and steps must be >= 1")
        if not (0 <= self.r_min <= 1 and 0 <= self.end_floor < 1 and 0 < self.dead_tail < 1
                and 0 <= self.resolution_quantile < 1):
            raise ValueError("r_min must be in [0, 1], end_floor and resolution_quantile in [0, 1), "
                             "dead_tail in (0, 1)")
        if not self.min_time > 0 or self.step_tolerance < 0 or self.min_gaps < 1 or not self.untagged_weight > 0:
            raise ValueError("min_time and untagged_weight must be > 0, step_tolerance >= 0, min_gaps >= 1")


_FLOOR = 1e-9  # reuses per second of a group nothing will reuse (keeps logs finite)
_STEPS = 20  # score resolution: 1/20 of a log unit (5%)
_LOG_FLOOR = math.floor(math.log(_FLOOR) * _STEPS) / _STEPS


def _quantized(logs: np.ndarray) -> np.ndarray:
    return np.floor(logs * _STEPS) / _STEPS


def _combined(rates: Sequence[float], resolution: float) -> float:
    """The rate of the first use among independent streams: 1 - prod(1 - rate * tau), over tau."""
    unused = sum(math.log1p(-min(rate * resolution, _SURE)) for rate in rates)
    return -math.expm1(unused) / resolution


SessionEntry = tuple[str, str, float] | tuple[str, str, float, int] | tuple[str, str, float, int, float | None]


def _columns(sessions: Sequence[SessionEntry]) -> LiveSessions:
    """Session tuples (the optional fields default to 1 dispatch and not told) as columns."""
    return LiveSessions(
        [entry[0] for entry in sessions], [entry[1] for entry in sessions], [entry[2] for entry in sessions],
        [entry[3] if len(entry) > 3 else 1 for entry in sessions],  # type: ignore[misc]
        [entry[4] if len(entry) > 4 else None for entry in sessions])  # type: ignore[misc]


@dataclass(frozen=True)
class ReuseTable:
    """One evaluation of the model: read-only, shared with the eviction path.

    ``anchor_rate[a]``: expected rate (1/s) of the next use of agents[a]'s anchor by any live or
    new session; ``session_rate[s, a]``: rate of the next use of agent a's prefix in live session
    sessions[s] (its history behind a's anchor), evaluated while the session was at agent
    agents[session_agents[s]]; ``dispatched_rate[d, a]``: the same for a session that has just
    dispatched agents[d] (what a session that moved on since, or started since, is scored by).
    Invariant: session_rate[s, a] <= anchor_rate[a] (and a history scored by ``dispatched_rate`` is
    capped at its anchor's), so a history block never outranks the anchor blocks it extends. When
    not ``predictable`` every tagged group scores 0.0 (pure recency).
    """

    agents: tuple[str, ...]
    index: dict[str, int]
    anchor_rate: np.ndarray
    sessions: dict[str, int]
    session_rate: np.ndarray
    session_agents: np.ndarray
    dispatched_rate: np.ndarray
    dead: tuple[str, ...]
    steps: int
    horizon_s: float
    resolution: float
    predictability: float
    predictable: bool
    untagged_weight: float = 0.5
    time_unit: float = 1.0  # the resolution, or the pace of starts while no gap is learned: the workload's time scale

    def score(self, group: Group) -> float:
        """log(reuses per second) of a group: smaller is evicted first."""
        return self.scorer()(group)

    def scorer(self, retired: Callable[[str], bool] | None = None,
               retired_score: float = -math.inf,
               current: Callable[[str], str | None] | None = None,
               untagged_under_anchors: bool = False,
               in_resolutions: bool = False,
               continuation: Callable[[str], float | None] | None = None) -> Callable[[Group], float]:
        """A fast ``score`` for the eviction path; sessions that ``retired(session)`` says are
        over score ``retired_score`` (a fact outranks the model, also while it is not predictable).
        ``untagged_under_anchors``: untagged blocks score at most the lowest anchor above the floor
        (see ``_untagged_score``). ``continuation(session)``: the chance that a conversation's
        agent continues it with its next call (None: a session): its history scores that share of
        the agent's anchor, never below an untagged block (it is one no session is known for).

        ``in_resolutions``: every other score is multiplied by ``time_unit`` (the time resolution, in
        seconds), so that a recency term ``decay * t`` added to it (the free queue's key) counts time
        in resolutions, not seconds: ``score + decay * t`` orders as ``log value + decay * t /
        resolution``. Recency then weighs as much against the model on a workload whose calls come
        minutes apart as on one whose calls come a second apart (per second, anchors reused an hour
        apart were evicted as under LRU).

        ``current(session)`` names the agent a session dispatched last (None: unknown). The table
        lags the sessions by up to a refresh interval: the history of a session that dispatched
        another agent since (or started since) is scored as just dispatched by that agent, never
        above what its row says. Without it a fast session's new history keeps the value of the
        dispatch it just made ("this agent is next") and outranks anchors, or, for a session
        started since, is evicted first.

        Lookups are prepared here once per table, so that re-scoring a group costs a few
        dictionary reads and one array read (no list of every session's scores is built: a
        refresh re-scores only the groups of the sessions ``changed_sessions`` names). Scores are
        quantized to 1/``_STEPS`` of a log unit: drifts of a few percent leave a group's score,
        and so the queue's heap, alone; ties go to recency.
        """
        if not self.predictable:
            return recency_scorer(retired, retired_score)
        unit = self.time_unit if in_resolutions else 1.0
        floor = _LOG_FLOOR * unit
        index, sessions = self.index, self.sessions
        anchor_rates: list[float] = self.anchor_rate.tolist()
        anchor_logs: list[float] = (_quantized(np.log(self.anchor_rate + _FLOOR)) * unit).tolist()
        session_logs = self._session_quantized  # read per group (times ``unit``): a refresh re-scores few of them
        dispatched_logs: dict[int, np.ndarray] = {}  # per dispatching agent, computed when first read
        session_agents: list[int] = self.session_agents.tolist()
        untagged: list[float] = []  # computed on the first untagged group (a median is costly)
        columns: dict[frozenset[str], tuple[int, ...]] = {}
        conversations: dict[tuple[frozenset[str], float], float] = {}

        def untagged_score() -> float:
            if not untagged:
                untagged.append(self._untagged_score(untagged_under_anchors) * unit)
            return untagged[0]

        def conversation_score(agents: frozenset[str], share: float) -> float:
            found = columns.get(agents) or columns_of(agents)
            rate = share * max((anchor_rates[i] for i in found), default=0.0)
            score = conversations[agents, share] = max(
                untagged_score(), math.floor(math.log(rate + _FLOOR) * _STEPS) / _STEPS * unit)
            return score

        def columns_of(agents: frozenset[str]) -> tuple[int, ...]:
            found = columns[agents] = tuple(i for a in agents if (i := index.get(a)) is not None)
            return found

        # called for every group of the free queue at every refresh: the common cases (one agent)
        # take one dictionary read each and no further call
        def score(group: Group) -> float:
            kind = type(group)
            if kind is History:
                session = group.session  # type: ignore[union-attr]
                if continuation is not None and (share := continuation(session)) is not None:
                    agents = group.agents  # type: ignore[union-attr]
                    return conversations.get((agents, share)) or conversation_score(agents, share)
                if retired is not None and retired(session):
                    return retired_score
                row = sessions.get(session)
                agents = group.agents  # type: ignore[union-attr]
                found = columns.get(agents) or columns_of(agents)
                if row is None:
                    own = floor
                elif len(found) == 1:
                    own = session_logs.item(row, found[0]) * unit
                else:
                    own = max((session_logs.item(row, i) * unit for i in found), default=floor)
                if current is not None and (agent := current(session)) is not None and (
                        at := index.get(agent)) is not None and (row is None or at != session_agents[row]):
                    moved_logs = dispatched_logs.get(at)
                    if moved_logs is None:
                        moved_logs = dispatched_logs[at] = self._dispatched_quantized(at) * unit
                    moved = moved_logs.item(found[0]) if len(found) == 1 else max(
                        (moved_logs.item(i) for i in found), default=floor)
                    return moved if row is None else min(moved, own)  # type: ignore[no-any-return]
                return own  # type: ignore[no-any-return]
            if kind is Anchor:
                agents = group.agents  # type: ignore[union-attr]
                found = columns.get(agents) or columns_of(agents)
                if len(found) == 1:
                    return anchor_logs[found[0]]
                combined = _combined([anchor_rates[i] for i in found], self.resolution)
                return math.floor(math.log(combined + _FLOOR) * _STEPS) / _STEPS * unit
            if kind is Uncached:
                return -math.inf
            return untagged_score()

        return score

    @functools.cached_property
    def _session_quantized(self) -> np.ndarray:
        """The quantized log rates of ``session_rate``: what a history group scores."""
        return _quantized(np.log(self.session_rate + _FLOOR))

    def _dispatched_quantized(self, dispatched: int) -> np.ndarray:
        """What the history of a session that just dispatched agents[dispatched] scores, under its anchor
        (per row: with many agents the whole table costs more than the few rows a refresh reads)."""
        return _quantized(np.log(np.minimum(self.dispatched_rate[dispatched], self.anchor_rate) + _FLOOR))

    def changed_sessions(self, before: ReuseTable) -> set[str] | None:
        """The sessions whose history groups may score otherwise under this table than under
        ``before`` (with the same ``retired``), or None when any group may (other agents, or
        predictability crossed ``r_min``, or ``time_unit`` moved: scores ``in_resolutions`` all do).
        Anchor and untagged groups may change either way."""
        if self.agents != before.agents or not (self.predictable and before.predictable) or \
                self.time_unit != before.time_unit:
            return None
        changed = set(before.sessions.keys() - self.sessions.keys())
        names = list(self.sessions)
        if not before.sessions:
            return changed.union(names)
        rows = np.array(list(map(before.sessions.get, names, itertools.repeat(-1))), dtype=np.intp)
        moved = (self._session_quantized != before._session_quantized[rows]).any(axis=1) | (rows < 0)
        # a session that had moved on under ``before`` (scored as just dispatched) is scored by its own row now
        moved |= before.session_agents[rows] != self.session_agents
        changed.update(names[i] for i in np.flatnonzero(moved).tolist())
        return changed

    def _untagged_score(self, under_anchors: bool = False) -> float:
        """``untagged_weight`` times a typical live conversation's next use (or a typical anchor's
        while no session is live), in the unit of every group: a typical value of 0 (most live
        sessions at an agent that ends them, or idle past every learned gap) scores the floor,
        never above the anchors. ``under_anchors``: at most the lowest anchor the model expects a
        use of, so that untagged blocks (the queries of calls outside any session, when nothing
        recognizes sessions) meet the anchors in recency order at best, as under LRU; half a
        typical session's next use (the one due next) outranked the anchors of the agents it
        passed, whose next use is a session later."""
        if self.session_rate.size:
            typical = self.session_rate.max(axis=1)
        else:
            typical = self.anchor_rate[self.anchor_rate > 0]
        value = float(np.median(typical)) if len(typical) else 0.0
        score = math.floor(math.log(self.untagged_weight * value + _FLOOR) * _STEPS) / _STEPS
        if under_anchors and (expected := self.anchor_rate[self.anchor_rate > 0]).size:
            return min(score, float(_quantized(np.log(expected.min() + _FLOOR))))  # that anchor's score
        return score

    def survival(self, agent: str) -> float:
        """P(agent's anchor is used within ``horizon_s``), read off its rate."""
        i = self.index.get(agent)
        if not self.predictable:
            return 1.0
        return 0.0 if i is None else float(-math.expm1(-float(self.anchor_rate[i]) * self.horizon_s))


def recency_scorer(retired: Callable[[str], bool] | None = None,
                   retired_score: float = -math.inf) -> Callable[[Group], float]:
    """The scores of LRU: every group alike (ties go to recency), except what is known to be
    worthless: uncached blocks and the history of sessions ``retired(session)`` says are over."""

    def score(group: Group) -> float:
        kind = type(group)
        if kind is History and retired is not None and retired(group.session):  # type: ignore[union-attr]
            return retired_score
        return -math.inf if kind is Uncached else 0.0

    return score


def score_reuse(
    chain: ChainModel,
    gaps: GapTable,
    sessions: LiveSessions | Sequence[SessionEntry],
    *,
    now: float,
    session_start_rate: float,
    continuation: Mapping[str, float],
    interposed: np.ndarray | None,
    predictability: float,
    gap_count: int,
    config: ReuseConfig,
    session_count: int = 0,
    passage: np.ndarray | None = None,
    end_hazard: np.ndarray | None = None,
    reuse: tuple[ReuseTable, Container[str]] | None = None,
    pace: float | None = None,
) -> ReuseTable:
    """Evaluate the next-use model (pure: no state, no clock of its own).

    ``sessions``: the live sessions as columns, or as (session, current agent, last arrival[,
    dispatches so far[, P(its dispatch goes on) given whether its last answer called a tool, None
    when not told]]);
    ``end_hazard[n - 1]``: P(a session ends after its n-th dispatch | it lasted that long), the
    last entry for all longer ones (None: sessions never end), learned from ended sessions'
    lengths; ``session_start_rate``: new sessions per second; ``continuation[a]``: P(a request of
    a is followed by another request of the same dispatch); ``gap_count``, ``session_count``: the
    gaps between a session's requests and the sessions started so far; ``interposed[a]``: calls of
    a made between two dispatches, per dispatch (e.g. a speaker selector); ``passage``: a cached
    ``first_passage_steps`` of this chain. ``reuse``: (an earlier table, the sessions whose own
    inputs changed since): every other session it scored keeps its row (not re-evaluated: its
    idle time and the chain moved on a little) when the chain's agents, the time resolution and
    the steps are the same; the caller passes only a table of the same gap distributions, passage
    and end hazard. The anchors always sum over every session. ``pace``: the interval between
    session starts (``SessionTiming.pace``), the table's ``time_unit`` while no gap is learned (calls
    outside any session teach none): with a unit of 1 s the queue's recency would count seconds, and
    outweigh every value where calls come a minute apart.
    """
    n = len(chain.agents)
    index = chain.index
    matrix = chain.matrix
    if passage is None:
        passage = first_passage_steps(matrix, config.steps or config.max_steps,
                                      tolerance=0.0 if config.steps else config.step_tolerance)
    steps = len(passage)
    learned = gaps.quantile(config.resolution_quantile)  # None: no gap learned yet
    resolution = max(learned or 0.0, config.min_time)
    median_gap = max(gaps.median_gap, resolution)
    ahead = np.arange(steps) * median_gap  # time from the next dispatch to the k-th next one

    hazard = end_hazard if end_hazard is not None and len(end_hazard) else np.zeros(1)
    live = sessions if isinstance(sessions, LiveSessions) else _columns(sessions)
    chain_rows = list(map(index.get, live.agents))
    if None in chain_rows:  # agents the chain does not know: their sessions are not scored
        live = live.select([i for i, row in enumerate(chain_rows) if row is not None])
        chain_rows = [row for row in chain_rows if row is not None]
    names = live.names
    known = len(names)
    positions = dict(zip(names, range(known), strict=True))
    # the sessions whose rows are copied from ``previous`` (their inputs did not change), from where
    copied: np.ndarray | None = None
    evaluated: Sequence[int] = range(known)
    if reuse is not None and known:
        previous, fresh = reuse
        if previous.agents == chain.agents and previous.resolution == resolution and previous.steps == steps:
            before = np.fromiter(map(previous.sessions.get, names, itertools.repeat(-1)), np.intp, known)
            for name in fresh:
                if (position := positions.get(name)) is not None:
                    before[position] = -1
            kept = before >= 0
            copied, evaluated = np.flatnonzero(kept), np.flatnonzero(~kept).tolist()
    session_rate = np.empty((known, n))
    dead: tuple[str, ...] = ()
    # the rows of one session per agent that has just dispatched it (idle 0, its first dispatch):
    # what the history of a session that moved on since this table scores by; the same chain, gaps
    # and hazard give the same rows (a partial evaluation copies them)
    dispatched = previous.dispatched_rate if copied is not None else np.zeros((0, n))
    if len(evaluated) or (copied is None and n):
        part = live if copied is None else live.select(evaluated)
        rows = chain_rows if copied is None else [chain_rows[i] for i in evaluated]
        if copied is None:  # evaluated along with the live sessions: one pass
            part = LiveSessions((*names, *chain.agents), (*part.agents, *chain.agents), (*part.seen, *(now,) * n),
                                (*part.dispatches, *(1,) * n), (*part.going_on, *(None,) * n))
            rows = [*rows, *range(n)]
        rates, still = session_rates(chain, gaps, part, rows, now=now, continuation=continuation,
                                     interposed=interposed, hazard=hazard, passage=passage, resolution=resolution,
                                     median_gap=median_gap, ahead=ahead, end_floor=config.end_floor)
        if copied is None:
            dispatched, session_rate, still = rates[known:], rates[:known], still[:known]
        else:
            session_rate[evaluated] = rates
        if gap_count >= config.min_gaps:  # P(a gap this long | the request's kind) below the tail: abandoned
            dead = tuple(names[evaluated[i]] for i in np.flatnonzero(still < config.dead_tail).tolist())
        elif session_count >= config.min_gaps * max(1, gap_count):
            # (almost) no session continues, fewer than one in min_gaps: one whose request finished
            # is over (if it comes back, it continues); else sessions of one call each would stay
            # live, and be scored at every refresh, until min_gaps gaps are learned
            dead = tuple(names[i] for i in evaluated if math.isfinite(live.seen[i]))
    if copied is not None and len(copied):
        session_rate[copied] = previous.session_rate[before[copied]]

    # log P(no live session uses the anchor within the resolution): sessions are independent
    unused = np.log1p(-session_rate * resolution).sum(axis=0) if known else np.zeros(n)
    if session_start_rate > 0 and n:
        # first visits from a new session's entry: e_1 = entry, e_k = entry @ F_{k-1} minus revisits
        entry = chain.entry
        first = np.empty((steps, n))
        first[0] = entry
        from_entry = (entry @ by_origin(passage).reshape(n, -1)).reshape(steps, n)  # one pass over the table
        np.subtract(from_entry[:-1], entry[None, :] * np.diagonal(passage[:-1], axis1=1, axis2=2), out=first[1:])
        if hazard.any():  # ... made while the new session still runs
            first = first * np.cumprod(np.concatenate([[1.0], 1.0 - hazard[np.minimum(np.arange(1, steps),
                                                                                      len(hazard)) - 1]]))[:, None]
        # sessions yet to start are a Poisson stream of uses at this rate
        new_rate = (np.minimum(np.maximum(first, 0.0), 1.0) / (1.0 / session_start_rate + ahead)[:, None]).sum(axis=0)
        if interposed is not None and len(interposed) == n:
            new_rate = new_rate + session_start_rate * interposed
        unused = unused - new_rate * resolution
    anchor_rate = -np.expm1(unused) / resolution
    return ReuseTable(
        agents=chain.agents,
        index=index,
        anchor_rate=anchor_rate,
        sessions=positions,
        session_rate=session_rate,
        session_agents=np.array(chain_rows, dtype=np.intp),
        dispatched_rate=dispatched,
        dead=dead,
        steps=steps,
        horizon_s=steps * median_gap,
        resolution=resolution,
        predictability=predictability,
        # nothing learned (no transition, no session start rate): LRU. Sessions of one call each
        # teach no transition (R = 0), but how often each agent starts one still ranks the anchors
        predictable=(predictability > 0 or session_start_rate > 0) and predictability >= config.r_min,
        untagged_weight=config.untagged_weight,
        time_unit=resolution if learned is not None else max(pace or 1.0, config.min_time),
    )
