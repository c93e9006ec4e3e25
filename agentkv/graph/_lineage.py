"""Per-session lineage records of the TransitionLearner: what each session's last call taught."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LearnedTransition", "Observation", "SessionLineage"]


@dataclass(slots=True)
class LearnedTransition:
    """What one call taught: ``weight`` added to ``counts[previous, agent]``, undoable exactly.

    ``best_before`` is the row's ``_best`` before the call; ``prediction`` the dispatch number
    of the accuracy prediction the call was scored by and ``hit`` its outcome.
    """

    previous: int
    weight: float
    best_before: int
    prediction: int
    hit: bool


@dataclass(slots=True)
class SessionLineage:
    """A live session: its current agent (index), last activity, step, and what that call taught.

    ``learned`` is None when the call taught no transition (an entry) or was already taken back.
    """

    index: int
    seen: float
    step: int | None
    learned: LearnedTransition | None = None


@dataclass(frozen=True, slots=True)
class Observation:
    """One learned dispatch: ``previous`` is None for the first agent of a session."""

    agent: str
    session: str | None
    previous: str | None
    predicted: str | None
