"""The warm-up decision: whether to re-prefill the predicted next agent's anchor now, and why not.

One pure policy, used by :class:`~agentkv.warmup.WarmupCoordinator` (live, client side) and by the
replay's ``agentkv+warmup`` (``agentkv bench replay``), so that the replay measures the shipped gate.
It takes plain values and returns a :class:`WarmupDecision` whose ``reason`` names the first gate
that stopped the job (``warm`` when none did). Gates, in order:

* job: ``session_ended``; ``late`` (the next agent already started: its own call computes the
  prefix, a warm-up would only compete with it); ``no_prediction`` (no predicted agent, or a
  transition never observed); ``unlikely`` (the prediction's probability below
  ``min_probability``); ``predictability`` (learned R below ``r_min``);
* target: ``resident`` (the server holds every block of the agent's anchor: nothing to warm);
  ``no_anchor`` (no warmable prefix known); ``busy`` (requests waiting above ``max_waiting``, or
  running + waiting above ``max_load``: a warm-up would delay a user's request); ``costly`` (the
  warm-up's price, see below, exceeds its expected saving); ``no_room``
  (fewer free KV blocks than the anchor needs plus ``min_free_blocks``); ``rate_limit`` (the rate
  limiter refused: checked last, so only jobs that passed every other gate spend a token).

The price (``weigh_load``): a warm-up moves the anchor's prefill off the predicted caller's critical
path, but the prefill shares the engine's next steps with every running request and delays each of
them by about as long. With ``r`` requests running or waiting, the expected saving is ``P * S * (1 + r)``
prefills (the caller's, and the delay it would have put on the ``r`` requests running at its call,
taken as today's), where ``P`` is the prediction's probability and ``S`` the share of the server's
warm-ups that survived until their agent's call (1 when unknown); the cost is ``r``. The job warms
only when ``P * S * (1 + r) >= r``: an idle engine always qualifies; three running requests ask
P * S >= 0.75. The prefill's length cancels out, so no per-token time is needed.

Unknown inputs never block a warm-up (a server without agentkv, metrics that cannot be read): the
gate is skipped and the decision lists it in ``fallbacks`` (``residency_unknown``,
``load_unknown``, ``room_unknown``) so the caller can count it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

__all__ = ["JOB_GATES", "TARGET_GATES", "JobState", "TargetState", "TokenBucket", "WarmupDecision", "WarmupPolicy"]

JOB_GATES: Final = ("session_ended", "late", "no_prediction", "unlikely", "predictability")
TARGET_GATES: Final = ("resident", "no_anchor", "busy", "costly", "no_room", "rate_limit")
WARM: Final = "warm"


class TokenBucket:
    """``rate`` tokens per second, at most ``capacity`` saved up; ``take()`` spends one if available."""

    def __init__(self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = max(0.0, float(rate))
        self.capacity = max(1.0, float(capacity))
        self.clock = clock
        self._tokens = self.capacity
        self._at = clock()

    def take(self) -> bool:
        now = self.clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


@dataclass(frozen=True, slots=True)
class JobState:
    """What is known when a dispatch ends: the session's state and the prediction from its agent.

    ``predicted``: the most likely next agent (None: no prediction); ``probability``: its
    P(next | current); ``observed``: the transition was seen at least once (not only smoothing);
    ``predictability``: the learned R of the whole chain. A manual warm-up has no prediction to
    check: ``manual=True`` skips the prediction gates.
    """

    predicted: str | None
    probability: float = 1.0
    observed: bool = True
    predictability: float = 1.0
    session_ended: bool = False
    late: bool = False
    manual: bool = False


@dataclass(frozen=True, slots=True)
class TargetState:
    """The predicted agent's anchor and the engine, as the server reports them (None: unknown).

    ``anchor_blocks``: blocks the warm-up would prefill (0: nothing warmable known);
    ``resident``: the server holds the whole anchor; ``waiting``/``running``: requests in the
    engine; ``free_blocks``: KV blocks a new request can take (free or evictable); ``survival``:
    the share of warm-ups that lasted until their agent's call (the price's ``S``).
    """

    anchor_blocks: int
    resident: bool | None = None
    waiting: float | None = None
    running: float | None = None
    free_blocks: int | None = None
    survival: float | None = None


@dataclass(frozen=True, slots=True)
class WarmupDecision:
    """``reason``: ``warm`` or the gate that stopped the job; ``fallbacks``: gates skipped for want of data."""

    reason: str
    fallbacks: tuple[str, ...] = ()

    @property
    def warm(self) -> bool:
        return self.reason == WARM


@dataclass(frozen=True, slots=True)
class WarmupPolicy:
    """The thresholds of the gates (see the module doc); ``decide`` is a pure function of its inputs.

    ``max_waiting`` / ``max_load`` None turn the busy gate's checks off; ``weigh_load=False`` the
    price (``costly``).
    """

    r_min: float = 0.3
    min_probability: float = 0.0
    max_waiting: float | None = 0
    max_load: float | None = None
    weigh_load: bool = True
    min_free_blocks: int = 0

    def decide(
        self,
        job: JobState,
        target: TargetState | Callable[[], TargetState],
        take: Callable[[], bool] = lambda: True,
    ) -> WarmupDecision:
        """The decision for one job. ``target`` may be a function returning the target's state: it
        is called only when the job gates pass (so the caller fetches nothing for a job that cannot
        warm); ``take`` (the rate limiter) only when every other gate passed."""
        reason = self.job_gate(job)
        if reason is not None:
            return WarmupDecision(reason)
        state = target() if callable(target) else target
        # a manual warm-up was asked for: no price to weigh
        reason, fallbacks = self.target_gate(state, None if job.manual else job.probability)
        if reason is None:
            reason = WARM if take() else "rate_limit"
        return WarmupDecision(reason, fallbacks)

    def job_gate(self, job: JobState) -> str | None:
        if job.session_ended:
            return "session_ended"
        if job.late:
            return "late"
        if job.manual:
            return None
        if job.predicted is None or not job.observed:
            return "no_prediction"
        if job.probability < self.min_probability:
            return "unlikely"
        if job.predictability < self.r_min:
            return "predictability"
        return None

    def target_gate(self, state: TargetState, probability: float | None) -> tuple[str | None, tuple[str, ...]]:
        """(the target gate that blocks, or None; the gates skipped because their input is unknown).
        ``probability``: the prediction's P(next), which the price weighs with ``state.survival``
        (None: a manual warm-up, not priced)."""
        fallbacks: list[str] = []
        if state.resident is None:
            fallbacks.append("residency_unknown")
        elif state.resident:
            return "resident", ()
        if state.anchor_blocks <= 0:
            return "no_anchor", tuple(fallbacks)
        if state.waiting is None:
            fallbacks.append("load_unknown")
        elif self._busy(state.waiting, state.running):
            return "busy", tuple(fallbacks)
        elif self._costly(probability, state):
            return "costly", tuple(fallbacks)
        if state.free_blocks is None:
            fallbacks.append("room_unknown")
        elif state.free_blocks < state.anchor_blocks + self.min_free_blocks:
            return "no_room", tuple(fallbacks)
        return None, tuple(fallbacks)

    def _busy(self, waiting: float, running: float | None) -> bool:
        if self.max_waiting is not None and waiting > self.max_waiting:
            return True
        return self.max_load is not None and running is not None and running + waiting > self.max_load

    def _costly(self, probability: float | None, state: TargetState) -> bool:
        if not self.weigh_load or probability is None or state.running is None:
            return False
        delayed = state.running + (state.waiting or 0.0)  # queued requests wait for the prefill too
        useful = probability * (1.0 if state.survival is None else state.survival)
        return useful * (1.0 + delayed) < delayed
