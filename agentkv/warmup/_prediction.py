"""The next agent after a dispatch: from a client-side learner, or from the server's learned stats."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._server import ServerView

__all__ = ["Prediction", "predict_from_stats", "predict_from_view", "predict_with_learner", "predictor_of"]

Prediction = tuple[str, float, bool, float]
"""(next agent, its probability, whether that transition was observed, predictability R)."""


def predict_with_learner(predictor: Any, learner: Any, agent: str) -> Prediction | None:
    """The ``Predictor``'s guess after ``agent`` (None: nothing to predict). Not thread-safe: lock the learner."""
    prediction = predictor.predict(agent)
    if prediction is None:
        return None
    # a smoothed row without any observed successor predicts nothing
    observed = _observed(learner, agent, prediction.agent)
    return prediction.agent, float(prediction.probability), observed, float(learner.predictability())


def predict_from_stats(stats: Mapping[str, Any], agent: str) -> Prediction | None:
    """The most likely successor of ``agent`` in ``GET /agentkv/v1/stats`` (None: unknown or a tie)."""
    row = (stats.get("transitions") or {}).get(agent) or {}
    if not isinstance(row, Mapping) or not row:
        return None
    ranked = sorted(((float(p), str(a)) for a, p in row.items()), reverse=True)
    if len(ranked) > 1 and ranked[0][0] <= ranked[1][0]:
        return None  # a tie (e.g. the uniform row of an agent never followed): no information
    return ranked[0][1], ranked[0][0], True, float(stats.get("predictability") or 0.0)


def predict_from_view(view: ServerView, agent: str) -> Prediction | None:
    """The server's prediction after ``agent`` in an agentkv view (None: unknown or a tie)."""
    guess = view.successors.get(agent)
    if guess is None or view.predictability is None:
        return None
    return guess[0], guess[1], True, view.predictability


def _observed(learner: Any, agent: str, target: str) -> bool:
    """Whether ``learner`` has actually seen ``agent -> target`` (True if it cannot tell)."""
    counts = getattr(learner, "counts", None)
    if counts is None:
        return True
    agents = list(learner.agents)
    if agent not in agents or target not in agents:
        return False
    return bool(counts()[agents.index(agent), agents.index(target)] > 0)


def predictor_of(learner: Any) -> tuple[Any, Any]:
    """(predictor, learner) from a TransitionLearner, a Predictor, or None."""
    if learner is None:
        return None, None
    if hasattr(learner, "predict") and hasattr(learner, "learner"):
        return learner, learner.learner
    if hasattr(learner, "observe"):
        from agentkv.graph import Predictor

        return Predictor(learner), learner
    raise TypeError(f"learner must be a TransitionLearner or a Predictor, not {type(learner).__name__}")
