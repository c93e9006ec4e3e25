"""Session timing learned online: when a session's next request comes, and whether it comes at all."""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from agentkv._bounded import ChangeSet

__all__ = ["GapTable", "LiveSessions", "SessionTiming", "TimingConfig"]

# Gap histogram bins (seconds), log-spaced: 20 ms .. 2 h, ~30% wide. A gap below the first
# edge counts in bin 0; one above the last edge in the last bin.
_EDGES = np.geomspace(0.02, 7200.0, 49)
_CENTERS = np.sqrt(_EDGES[:-1] * _EDGES[1:])
_BINS = len(_CENTERS)
_EDGE_LIST = tuple(_EDGES.tolist())  # bisect on plain floats: a numpy call per gap costs ~20x more
_TOOL, _HANDOFF = 0, 1  # rows of a gap histogram
_TOLD_PRIOR = 2.0  # answers of evidence the prior of ``continuation_after`` counts for
_MAX_LENGTH = 64  # session lengths (dispatches) are counted up to this; longer ones share the last bin
_LENGTH_DECAY = 0.995  # per ended session
_MIN_ENDED = 10
_START_WINDOW = 16  # the rate of new sessions is read off this many recent intervals between starts
_PAUSE = 4.0  # an interval over this many times the median is a pause, not the pace of starts
_MAX_EXPIRED = 4096  # sessions that timed out, remembered in case they come back after all
# _INVERSE_LEFT[j, b] = 1 / (time left in bin b for a gap that reached edge j), 0 for b < j
_INVERSE_LEFT = np.triu(1.0 / np.maximum(_CENTERS[None, :] - _EDGES[:-1, None], 1e-3))


@dataclass(frozen=True, slots=True)
class TimingConfig:
    """``half_life``: gaps of an agent weigh half after that many newer gaps of it (and so does each
    count of what followed its requests, after that many newer counts of the same kind).

    ``prior_gaps`` is how many gaps of evidence the global histogram counts for in an agent's
    own (shrinkage for rarely seen agents).
    """

    half_life: float = 500.0
    prior_gaps: float = 8.0
    max_sessions: int = 100_000
    max_agents: int = 256

    def __post_init__(self) -> None:
        if not (self.half_life > 0 and self.prior_gaps > 0):
            raise ValueError("half_life and prior_gaps must be > 0")
        if self.max_sessions < 1 or self.max_agents < 1:
            raise ValueError("max_sessions and max_agents must be >= 1")


class _Session(NamedTuple):  # a tuple: one is built per request, ~5x faster than a frozen dataclass
    agent: str
    seen: float  # arrival time of the session's last request
    step: int | None
    dispatches: int  # dispatches so far (a tool loop's requests share one)
    tool_call: bool | None = None  # the last request's answer was a tool call (None: not told)
    running: int = 0  # its requests admitted and not finished yet (the session is busy, not idle)


class LiveSessions(NamedTuple):
    """The live sessions as columns, one entry per session: its name, current agent, last
    arrival (infinity while a request of it runs: idle 0), dispatches so far, and P(its dispatch
    goes on) given what its last answer was (None: not told)."""

    names: Sequence[str]
    agents: Sequence[str]
    seen: Sequence[float]
    dispatches: Sequence[int]
    going_on: Sequence[float | None]

    def without(self, ended: AbstractSet[str]) -> LiveSessions:
        """These sessions less those in ``ended`` (e.g. a dict's keys)."""
        if ended.isdisjoint(self.names):
            return self
        return self.select([i for i, name in enumerate(self.names) if name not in ended])

    def select(self, positions: Sequence[int]) -> LiveSessions:
        """The sessions at ``positions``, in that order."""
        return LiveSessions(*(tuple(column[i] for i in positions) for column in self))


@dataclass(frozen=True)
class GapTable:
    """Read-only per-agent view of the learned gap distributions, evaluated at bin edges.

    ``tool`` and ``handoff`` are (survival, residual) for the gaps within a dispatch (the agent's
    tool loop) and the gaps to the next dispatch, learned apart: ``survival[i, b]`` = P(gap > edge
    b) for agents[i], ``residual[i, b]`` = the harmonic mean of gap - edge b given gap > edge b;
    row ``len(agents)`` is the global distribution (agents never seen). An idle time long past the
    hand-off gaps says the session is in a tool call, so the current agent's history is the part
    reused next. ``median_gap`` is the median of all gaps of all agents, ``cdf[b]`` the share of
    all gaps in bins 0..b (empty before any gap was seen).
    """

    agents: tuple[str, ...]
    index: dict[str, int]
    median_gap: float
    tool: tuple[np.ndarray, np.ndarray]
    handoff: tuple[np.ndarray, np.ndarray]
    cdf: np.ndarray

    def row(self, agent: str) -> int:
        return self.index.get(agent, len(self.agents))

    def quantile(self, q: float) -> float | None:
        """The gap (s, a bin centre) that a share ``q`` of all gaps are shorter than; None before any gap."""
        if not len(self.cdf):
            return None
        return float(_CENTERS[min(int(np.searchsorted(self.cdf, q)), _BINS - 1)])

    def split_at(self, rows: np.ndarray, idle: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(P(tool gap > idle), its time left, P(hand-off gap > idle), its time left), read
        between the bin edges around ``idle`` (linearly: gaps spread evenly within a bin)."""
        bins, share = _bins_of(idle)  # once for both distributions
        following = np.minimum(bins + 1, _BINS - 1)
        out = []
        for table in (*self.tool, *self.handoff):
            low, high = table[rows, bins], table[rows, following]
            out.append(low + share * (high - low))
        return out[0], out[1], out[2], out[3]


def _bin_of(gap: float) -> int:
    """The histogram bin of one gap (below the first edge: bin 0; above the last: the last bin)."""
    return min(max(bisect.bisect_right(_EDGE_LIST, gap) - 1, 0), _BINS - 1)


def _bins_of(idle: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the bin of each idle time, how far into the bin it is, 0..1); min/max, not np.clip,
    which costs several times more on arrays this small."""
    bins = np.minimum(np.maximum(np.searchsorted(_EDGES, idle, side="right") - 1, 0), _BINS - 1)
    share = (idle - _EDGES[bins]) / (_EDGES[bins + 1] - _EDGES[bins])
    return bins, np.minimum(np.maximum(share, 0.0), 1.0)


def _tables(own: np.ndarray, pooled: np.ndarray, prior_gaps: float) -> tuple[np.ndarray, np.ndarray]:
    """(survival, harmonic time left) of gap counts ``own`` (one row per agent),
    each shrunk towards ``pooled`` by ``prior_gaps`` gaps; a last row is the prior alone."""
    total = pooled.sum()
    prior = pooled / total if total > 0 else np.full(_BINS, 1.0 / _BINS)
    mass = np.vstack([own + prior_gaps * prior[None, :], prior[None, :]])
    # tail sums from bin b on: P(gap >= edge b)
    tail = np.cumsum(mass[:, ::-1], axis=1)[:, ::-1]
    norm = tail[:, :1]
    survival = np.divide(tail, norm, out=np.zeros_like(tail), where=norm > 0)
    # the harmonic mean of the time left, 1 / E[1 / (gap - edge b) | gap >= edge b]: a rate
    # of next use is an average of 1/time, and heavy tails would inflate a plain mean
    inverse = np.sum(mass[:, None, :] * _INVERSE_LEFT[None, :, :], axis=2)
    residual = np.divide(tail, inverse, out=np.zeros_like(tail), where=inverse > 0)
    return survival, residual


def _zero_rows() -> list[list[float]]:
    return [[0.0] * _BINS for _ in range(2)]


def _divide_rows(rows: list[list[float]], divisor: float) -> None:
    for row in rows:
        row[:] = [value / divisor for value in row]


class SessionTiming:
    """Per-agent distributions of the time from a session's request to its next request.

    Learned from request arrivals (what the server sees): the gap after an agent's request
    covers its own generation plus tool time or the hand-off to the next agent. A session whose
    request has not finished (queued or running) is busy: it reads idle 0 and is never taken for
    over. Also tracks each live session's last request and dispatch count, how often a request is
    followed by another request of the same dispatch (an agent's tool loop), the rate at which
    new sessions start, and how many dispatches ended sessions lasted (the hazard that a session
    ends where it is). A session that timed out (``expire``) and comes back after all continues:
    its gap is learned and its end taken back.

    Invariants: ``_hist[agent]`` holds decayed gap counts per bin (multiplied by
    ``_weight[agent]``), row ``_TOOL`` of the gaps within a dispatch and row ``_HANDOFF`` of
    the gaps to the next one; ``_sessions`` is ordered by last arrival, oldest first, and bounded.
    A snapshot keeps the learned part (``_timing_state.py``).
    """

    def __init__(self, config: TimingConfig | None = None) -> None:
        self.config = config or TimingConfig()
        self._decay = 2.0 ** (1.0 / self.config.half_life)
        # plain lists, one per row: a gap adds to one cell of its agent's rows and one of the
        # global rows (numpy element updates cost ~10x more); ``table`` turns them into arrays
        self._hist: OrderedDict[str, list[list[float]]] = OrderedDict()
        self._weight: dict[str, float] = {}
        self._global = _zero_rows()
        self._global_weight = 1.0
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        # decayed counts of what followed a request (each pair weighs half after ``half_life`` newer
        # counts of it): per agent, [one of the same dispatch, one of the next]; per agent and told
        # answer (no tool call, tool call), the same pair
        self._followed: dict[str, list[float]] = {}
        self._after_told: dict[tuple[str, bool], list[float]] = {}
        self._gaps = 0
        self._starts = 0
        self._last_start: float | None = None
        self._start_intervals: deque[float] = deque(maxlen=_START_WINDOW)
        self._start_interval = math.inf  # mean of the recent intervals between starts, pauses left out
        self._lengths = np.zeros(_MAX_LENGTH)  # decayed counts of ended sessions by dispatches
        self._ends = 0  # sessions ended so far (the lengths decay once per end)
        self._expired: OrderedDict[str, tuple[_Session, int]] = OrderedDict()  # timed out: (state, ends then)
        self._touched: ChangeSet[str] = ChangeSet(self.config.max_sessions)  # see ``take_touched``
        self.version = 0

    # -- learning --------------------------------------------------------------------

    def observe(self, session: str, agent: str, now: float, step: int | None = None) -> None:
        """A request of ``agent`` in ``session`` arrived at ``now``."""
        previous = self._sessions.pop(session, None)
        if previous is None:
            previous = self._revived(session)
        dispatches = 1
        if previous is None:
            self._note_start(now)
        else:
            same_dispatch = step is not None and previous.step == step and previous.agent == agent
            self._add_gap(previous.agent, max(0.0, now - previous.seen), same_dispatch)
            which = 0 if same_dispatch else 1
            self._count(self._followed.setdefault(previous.agent, [0.0, 0.0]), which)
            if previous.tool_call is not None:
                self._count(self._after_told.setdefault((previous.agent, previous.tool_call), [0.0, 0.0]), which)
            dispatches = previous.dispatches + (not same_dispatch)
        running = 1 if previous is None else previous.running + 1
        self._sessions[session] = _Session(agent, now, step, dispatches, None, running)
        if len(self._sessions) > self.config.max_sessions:
            self._sessions.popitem(last=False)
        self._touched.add(session)
        self.version += 1

    def _count(self, pair: list[float], which: int) -> None:
        # the pair's older counts weigh less at each new one: a long-running server follows a change
        # in an agent's tool use (all-time counts would answer for the agent it was months ago)
        pair[0] /= self._decay
        pair[1] /= self._decay
        pair[which] += 1.0

    def take_touched(self) -> set[str] | None:
        """The sessions that had a request, a told answer or an end since the last call (None:
        too many to list, take every session as touched); the next call starts afresh."""
        return self._touched.take()

    def finished(self, session: str) -> None:
        """A request of the session finished (answered, aborted or failed): it no longer keeps
        the session busy."""
        state = self._sessions.get(session)
        if state is None:
            return
        # built field by field: ``_replace`` costs twice as much, and this runs for every finished request
        self._sessions[session] = _Session(state.agent, state.seen, state.step, state.dispatches, state.tool_call,
                                           max(0, state.running - 1))
        self._touched.add(session)  # re-evaluated with the next evaluation: an answer alone need not start one

    def answered(self, session: str, tool_call: bool) -> None:
        """The session's last request finished; its answer was a tool call or not (a tool call
        brings the same agent back once the tool returns)."""
        state = self._sessions.get(session)
        if state is not None and state.tool_call is not tool_call:
            self._sessions[session] = state._replace(tool_call=tool_call)
            self._touched.add(session)
            self.version += 1

    def end(self, session: str) -> None:
        """The session is over (an event said so): learn its length."""
        self._expired.pop(session, None)
        state = self._sessions.pop(session, None)
        if state is not None:
            self._count_end(session, state)

    def expire(self, session: str) -> None:
        """The session was idle beyond its learned gaps: learn its length, and remember it in case
        it comes back (then ``observe`` takes the end back and learns the long gap)."""
        state = self._sessions.pop(session, None)
        if state is not None:
            self._count_end(session, state)
            self._expired[session] = (state, self._ends)
            if len(self._expired) > _MAX_EXPIRED:
                self._expired.popitem(last=False)

    def _count_end(self, session: str, state: _Session) -> None:
        self._lengths *= _LENGTH_DECAY
        self._lengths[min(state.dispatches, _MAX_LENGTH) - 1] += 1.0
        self._ends += 1
        self._touched.add(session)
        self.version += 1

    def _revived(self, session: str) -> _Session | None:
        """The state of a session that timed out and came back, its counted end taken back."""
        found = self._expired.pop(session, None)
        if found is None:
            return None
        state, ends = found
        bin_ = min(state.dispatches, _MAX_LENGTH) - 1
        self._lengths[bin_] = max(0.0, self._lengths[bin_] - _LENGTH_DECAY ** (self._ends - ends))
        return state._replace(running=0)

    def end_hazards(self) -> np.ndarray:
        """``h[n - 1]`` = P(a session ends after its n-th dispatch | it lasted that long), learned
        from the lengths of ended sessions (all 0 until ``_MIN_ENDED`` have ended); the last
        entry holds for every longer session."""
        if self._lengths.sum() < _MIN_ENDED:
            return np.zeros(_MAX_LENGTH)
        tail = np.cumsum(self._lengths[::-1])[::-1]
        return self._lengths / (tail + 1.0)  # +1: one unseen longer session keeps it below 1

    def call_outside_session(self, now: float) -> None:
        """A request that belongs to no session arrived at ``now``: for the pace of starts it is a
        session of one call, over once answered; it leaves no session state and no count in
        ``starts`` (no session of it is ever live)."""
        self._note_pace(now)
        self.version += 1

    def _note_start(self, now: float) -> None:
        self._starts += 1
        self._note_pace(now)

    def _note_pace(self, now: float) -> None:
        # A pause (a quiet night, the minute between two test runs) would hold a running mean
        # down for many starts after the pace picks up again; ``session_rate`` covers the pause
        # in progress, so the pace is the mean of the recent intervals without the pauses.
        if self._last_start is not None:
            self._start_intervals.append(max(now - self._last_start, 1e-3))
            pace = sorted(self._start_intervals)
            limit = _PAUSE * pace[(len(pace) - 1) // 2]
            kept = [interval for interval in pace if interval <= limit]
            self._start_interval = sum(kept) / len(kept)
        self._last_start = now

    def _add_gap(self, agent: str, gap: float, same_dispatch: bool) -> None:
        b = _bin_of(gap)
        hist = self._hist.get(agent)
        if hist is None:
            if len(self._hist) >= self.config.max_agents:
                stale, _ = self._hist.popitem(last=False)
                self._weight.pop(stale, None)
                self._followed.pop(stale, None)
                self._after_told.pop((stale, True), None)
                self._after_told.pop((stale, False), None)
            hist = self._hist[agent] = _zero_rows()
            self._weight[agent] = 1.0
        else:
            self._hist.move_to_end(agent)
        weight = self._weight[agent] * self._decay
        if weight > 1e100:  # rescale: counts are stored multiplied by the growing weight
            _divide_rows(hist, weight)
            weight = 1.0
        self._weight[agent] = weight
        hist[_TOOL if same_dispatch else _HANDOFF][b] += weight
        self._global_weight *= self._decay
        if self._global_weight > 1e100:
            _divide_rows(self._global, self._global_weight)
            self._global_weight = 1.0
        self._global[_TOOL if same_dispatch else _HANDOFF][b] += self._global_weight
        self._gaps += 1

    # -- reading ---------------------------------------------------------------------

    @property
    def gaps(self) -> int:
        return self._gaps

    @property
    def learned_version(self) -> int:
        """Changes when what a snapshot keeps (``_timing_state.py``) changes: a gap, a start or an
        end learned; ``version`` changes with the live sessions too, on every request."""
        return self._gaps + self._starts + self._ends

    @property
    def starts(self) -> int:
        """Sessions started so far."""
        return self._starts

    @property
    def gap_agents(self) -> int:
        """How many agents have a gap distribution of their own (the rows of ``table``)."""
        return len(self._hist)

    def sessions(self) -> list[tuple[str, str, float, int, float | None]]:
        """(session, current agent, last arrival (infinity while a request runs), dispatches so far,
        P(its dispatch goes on) given what its last answer was (None: not told)) of every live
        session, oldest first."""
        return list(zip(*self.live(), strict=True))

    def live(self) -> LiveSessions:
        """The live sessions as columns (what ``score_reuse`` reads), oldest first."""
        if not self._sessions:
            return LiveSessions((), (), (), (), ())
        agents, seen, _, dispatches, tool_calls, running = zip(*self._sessions.values(), strict=True)
        if any(running):
            seen = tuple(math.inf if busy else at for at, busy in zip(seen, running, strict=True))
        going_on: Sequence[float | None] = tool_calls
        if tool_calls.count(None) != len(tool_calls):
            told: dict[tuple[str, bool], float] = {}  # once per agent and answer kind
            for key in zip(agents, tool_calls, strict=True):
                if key[1] is not None and key not in told:
                    told[key] = self.continuation_after(*key)
            going_on = [told.get(key) for key in zip(agents, tool_calls, strict=True)]
        return LiveSessions(tuple(self._sessions), agents, seen, dispatches, going_on)

    def implied_step(self, session: str, agent: str) -> int:
        """The dispatch step of a request that carries none: the session's current one when its
        last request was ``agent``'s (a tool loop's calls, as recognition counts them), else the next.
        A session taken for over (``expire``) that comes back continues its step too."""
        state = self._sessions.get(session)
        if state is None and session in self._expired:
            state = self._expired[session][0]
        if state is None or state.step is None:
            return 0
        return state.step if state.agent == agent else state.step + 1

    def agent_of(self, session: str) -> str | None:
        """The agent of the session's last request (None: not a live session)."""
        state = self._sessions.get(session)
        return None if state is None else state.agent

    def told(self, session: str) -> bool | None:
        """Whether the session's last answer was a tool call, as the server was told (None: not told)."""
        state = self._sessions.get(session)
        return None if state is None else state.tool_call

    def continuation_after(self, agent: str, tool_call: bool) -> float:
        """P(the same dispatch sends another request | the answer called a tool, or not), learned
        per agent from the answers the server was told of. Before any evidence a tool call brings
        the agent back (a ReAct loop) and an answer ends its dispatch; a hand-off tool (a
        supervisor's ``transfer_to_x``) is learned as a tool call that does not."""
        same, following = self._after_told.get((agent, tool_call), (0.0, 0.0))
        prior = 1.0 if tool_call else 0.0
        return (same + _TOLD_PRIOR * prior) / (same + following + _TOLD_PRIOR)

    def continuation(self, agent: str) -> float:
        """P(a request of ``agent`` is followed by another request of the same dispatch)."""
        going_on, handed = self._followed.get(agent, (0.0, 0.0))
        return going_on / (going_on + handed) if going_on + handed > 0 else 0.0

    def pace(self) -> float | None:
        """The recent interval between session starts (calls outside any session included), pauses
        left out, as the centre of its gap bin: it moves in the bins' ~30% steps, not with every
        start. None before two starts."""
        if not math.isfinite(self._start_interval):
            return None
        return float(_CENTERS[_bin_of(self._start_interval)])

    def session_rate(self, now: float) -> float:
        """New sessions per second, calls outside any session included (0 until two started);
        decays while none start."""
        if self._last_start is None or not math.isfinite(self._start_interval):
            return 0.0
        return 1.0 / max(self._start_interval, now - self._last_start)

    def table(self) -> GapTable:
        """Survival and time left of every agent's gap distribution, at the bin edges."""
        agents = tuple(self._hist)
        own = np.array([self._hist[a] for a in agents], dtype=float).reshape(len(agents), 2, _BINS) \
            / np.array([self._weight[a] for a in agents], dtype=float).reshape(-1, 1, 1)
        pooled = np.array(self._global) / self._global_weight
        prior_gaps = self.config.prior_gaps
        tool = _tables(own[:, _TOOL], pooled[_TOOL], prior_gaps)
        handoff = _tables(own[:, _HANDOFF], pooled[_HANDOFF], prior_gaps)
        every = pooled[_TOOL] + pooled[_HANDOFF]
        total = every.sum()
        cdf = np.cumsum(every / total) if total > 0 else np.zeros(0)
        median_gap = float(_CENTERS[min(int(np.searchsorted(cdf, 0.5)), _BINS - 1)]) if len(cdf) \
            else float(_CENTERS.mean())
        return GapTable(agents, {a: i for i, a in enumerate(agents)}, median_gap, tool, handoff, cdf)

    def state_bytes(self) -> int:
        return (len(self._hist) + 1) * 2 * _BINS * 8 + sum(len(s) + 40 for s in self._sessions)
