"""Session timing learned online: when a session's next request comes, and whether it comes at all."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

__all__ = ["GapTable", "SessionTiming", "TimingConfig"]

# Gap histogram bins (seconds), log-spaced: 20 ms .. 2 h, ~30% wide. A gap below the first
# edge counts in bin 0; one above the last edge in the last bin.
_EDGES = np.geomspace(0.02, 7200.0, 49)
_CENTERS = np.sqrt(_EDGES[:-1] * _EDGES[1:])
_BINS = len(_CENTERS)
_MAX_LENGTH = 64  # session lengths (dispatches) are counted up to this; longer ones share the last bin
_LENGTH_DECAY = 0.995  # per ended session
_MIN_ENDED = 10
# _INVERSE_LEFT[j, b] = 1 / (time left in bin b for a gap that reached edge j), 0 for b < j
_INVERSE_LEFT = np.triu(1.0 / np.maximum(_CENTERS[None, :] - _EDGES[:-1, None], 1e-3))


@dataclass(frozen=True, slots=True)
class TimingConfig:
    """``half_life``: gaps of an agent weigh half after that many newer gaps of it.

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


@dataclass(frozen=True, slots=True)
class _Session:
    agent: str
    seen: float  # arrival time of the session's last request
    step: int | None
    dispatches: int  # dispatches so far (a tool loop's requests share one)


@dataclass(frozen=True)
class GapTable:
    """Read-only per-agent view of the learned gap distributions, evaluated at bin edges.

    ``survival[i, b]`` = P(gap > edge b) for agents[i]; ``residual[i, b]`` = the harmonic mean of
    gap - edge b given gap > edge b; ``mean_gap`` the median gap over all agents. Row
    ``len(agents)`` is the global distribution (agents never seen).
    """

    agents: tuple[str, ...]
    index: dict[str, int]
    survival: np.ndarray
    residual: np.ndarray
    mean_gap: float

    def row(self, agent: str) -> int:
        return self.index.get(agent, len(self.agents))

    def at(self, rows: np.ndarray, idle: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(P(gap > idle), E[remaining time | gap > idle]) for each (row, idle) pair."""
        bins = np.clip(np.searchsorted(_EDGES, idle, side="right") - 1, 0, _BINS - 1)
        survival = self.survival[rows, bins]
        residual = self.residual[rows, bins] - np.maximum(idle - _EDGES[bins], 0.0)
        return survival, residual


class SessionTiming:
    """Per-agent distributions of the time from a session's request to its next request.

    Learned from request arrivals only (what the server sees): the gap after an agent's request
    covers its own generation plus tool time or the hand-off to the next agent. Also tracks each
    live session's last request and dispatch count, how often a request is followed by another
    request of the same dispatch (an agent's tool loop), the rate at which new sessions start, and
    how many dispatches ended sessions lasted (the hazard that a session ends where it is).

    Invariants: ``_hist[agent]`` holds decayed gap counts per bin (multiplied by
    ``_weight[agent]``); ``_sessions`` is ordered by last arrival, oldest first, and bounded.
    """

    def __init__(self, config: TimingConfig | None = None) -> None:
        self.config = config or TimingConfig()
        self._decay = 2.0 ** (1.0 / self.config.half_life)
        self._hist: OrderedDict[str, np.ndarray] = OrderedDict()
        self._weight: dict[str, float] = {}
        self._global = np.zeros(_BINS)
        self._global_weight = 1.0
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._continued: dict[str, int] = {}  # per agent: requests followed by one of the same dispatch
        self._handed_off: dict[str, int] = {}  # ... and by another dispatch
        self._gaps = 0
        self._starts = 0
        self._first_start: float | None = None
        self._last_start = 0.0
        self._start_interval = math.inf  # EWMA of the time between session starts
        self._lengths = np.zeros(_MAX_LENGTH)  # decayed counts of ended sessions by dispatches
        self.version = 0

    # -- learning --------------------------------------------------------------------

    def observe(self, session: str, agent: str, now: float, step: int | None = None) -> None:
        """A request of ``agent`` in ``session`` arrived at ``now``."""
        previous = self._sessions.pop(session, None)
        dispatches = 1
        if previous is None:
            self._note_start(now)
        else:
            self._add_gap(previous.agent, max(0.0, now - previous.seen))
            same_dispatch = step is not None and previous.step == step and previous.agent == agent
            counts = self._continued if same_dispatch else self._handed_off
            counts[previous.agent] = counts.get(previous.agent, 0) + 1
            dispatches = previous.dispatches + (not same_dispatch)
        self._sessions[session] = _Session(agent, now, step, dispatches)
        if len(self._sessions) > self.config.max_sessions:
            self._sessions.popitem(last=False)
        self.version += 1

    def end(self, session: str) -> None:
        """The session is over (an event, or idle beyond its learned gaps): learn its length."""
        state = self._sessions.pop(session, None)
        if state is not None:
            self._lengths *= _LENGTH_DECAY
            self._lengths[min(state.dispatches, _MAX_LENGTH) - 1] += 1.0
            self.version += 1

    def end_hazard(self, dispatches: int) -> float:
        """P(a session ends after its ``dispatches``-th dispatch | it lasted that long), learned
        from the lengths of ended sessions (0 until ``_MIN_ENDED`` have ended)."""
        if self._lengths.sum() < _MIN_ENDED:
            return 0.0
        n = min(dispatches, _MAX_LENGTH) - 1
        tail = float(self._lengths[n:].sum())
        return float(self._lengths[n]) / (tail + 1.0)  # +1: one unseen longer session keeps it below 1

    def _note_start(self, now: float) -> None:
        self._starts += 1
        if self._first_start is None:
            self._first_start = now
        elif self._starts == 2:
            self._start_interval = max(now - self._first_start, 1e-3)
        else:
            self._start_interval = 0.9 * self._start_interval + 0.1 * max(now - self._last_start, 1e-3)
        self._last_start = now

    def _add_gap(self, agent: str, gap: float) -> None:
        b = min(max(int(np.searchsorted(_EDGES, gap, side="right")) - 1, 0), _BINS - 1)
        hist = self._hist.get(agent)
        if hist is None:
            if len(self._hist) >= self.config.max_agents:
                stale, _ = self._hist.popitem(last=False)
                self._weight.pop(stale, None)
                self._continued.pop(stale, None)
                self._handed_off.pop(stale, None)
            hist = self._hist[agent] = np.zeros(_BINS)
            self._weight[agent] = 1.0
        else:
            self._hist.move_to_end(agent)
        weight = self._weight[agent] * self._decay
        if weight > 1e100:  # rescale: counts are stored multiplied by the growing weight
            hist /= weight
            weight = 1.0
        self._weight[agent] = weight
        hist[b] += weight
        self._global_weight *= self._decay
        if self._global_weight > 1e100:
            self._global /= self._global_weight
            self._global_weight = 1.0
        self._global[b] += self._global_weight
        self._gaps += 1

    # -- reading ---------------------------------------------------------------------

    @property
    def gaps(self) -> int:
        return self._gaps

    @property
    def gap_agents(self) -> int:
        """How many agents have a gap distribution of their own (the rows of ``table``)."""
        return len(self._hist)

    def sessions(self) -> list[tuple[str, str, float, float]]:
        """(session, current agent, last arrival, P(it ends here)) of every live session, oldest first."""
        lengths = {min(state.dispatches, _MAX_LENGTH) for state in self._sessions.values()}
        # only the lengths live sessions have; all 0 until enough sessions ended (see end_hazard)
        hazards = {n: self.end_hazard(n) for n in lengths} if self._lengths.sum() >= _MIN_ENDED \
            else dict.fromkeys(lengths, 0.0)
        return [(s, state.agent, state.seen, hazards[min(state.dispatches, _MAX_LENGTH)])
                for s, state in self._sessions.items()]

    def last_seen(self, session: str) -> float | None:
        state = self._sessions.get(session)
        return None if state is None else state.seen

    def continuation(self, agent: str) -> float:
        """P(a request of ``agent`` is followed by another request of the same dispatch)."""
        going_on, handed = self._continued.get(agent, 0.0), self._handed_off.get(agent, 0.0)
        return going_on / (going_on + handed) if going_on + handed > 0 else 0.0

    def session_rate(self, now: float) -> float:
        """New sessions per second (0 until two sessions started); decays while none start."""
        if not math.isfinite(self._start_interval):
            return 0.0
        return 1.0 / max(self._start_interval, now - self._last_start)

    def table(self) -> GapTable:
        """Survival and time left of every agent's gap distribution, at the bin edges."""
        agents = tuple(self._hist)
        own = np.array([self._hist[a] / self._weight[a] for a in agents]).reshape(len(agents), _BINS)
        pooled = self._global / self._global_weight
        total = pooled.sum()
        prior = pooled / total if total > 0 else np.full(_BINS, 1.0 / _BINS)
        mass = np.vstack([own + self.config.prior_gaps * prior[None, :], prior[None, :]])
        # tail sums from bin b on: P(gap >= edge b)
        tail = np.cumsum(mass[:, ::-1], axis=1)[:, ::-1]
        norm = tail[:, :1]
        survival = np.divide(tail, norm, out=np.zeros_like(tail), where=norm > 0)
        # the harmonic mean of the time left, 1 / E[1 / (gap - edge b) | gap >= edge b]: a rate
        # of next use is an average of 1/time, and heavy tails would inflate a plain mean
        inverse = np.sum(mass[:, None, :] * _INVERSE_LEFT[None, :, :], axis=2)
        residual = np.divide(tail, inverse, out=np.zeros_like(tail), where=inverse > 0)
        mean_gap = float(_CENTERS[np.searchsorted(np.cumsum(prior), 0.5)]) if total > 0 else float(_CENTERS.mean())
        return GapTable(agents, {a: i for i, a in enumerate(agents)}, survival, residual, mean_gap)

    def state_bytes(self) -> int:
        return (len(self._hist) + 1) * _BINS * 8 + sum(len(s) + 40 for s in self._sessions)
