"""The learning core: transition learner, graph facts, predictor and survival scorer.

Pure Python + numpy + networkx; shared by the client and the vLLM server extension.
"""

from ._facts import END, START, FactsFull, GraphFacts
from ._learner import LearnerConfig, Observation, TransitionLearner, transition_entropy_ratio
from ._peers import PeerExport
from ._predictor import ChainModel, Prediction, Predictor
from ._snapshot import SNAPSHOT_VERSION, SnapshotError, load_snapshot, restore_or_fresh, save_snapshot
from ._survival import (
    SurvivalConfig,
    SurvivalScorer,
    SurvivalTable,
    block_score,
    first_passage_within,
    heap_key,
    hop_survival,
)

__all__ = [
    "END",
    "SNAPSHOT_VERSION",
    "START",
    "ChainModel",
    "FactsFull",
    "GraphFacts",
    "LearnerConfig",
    "Observation",
    "PeerExport",
    "Prediction",
    "Predictor",
    "SnapshotError",
    "SurvivalConfig",
    "SurvivalScorer",
    "SurvivalTable",
    "TransitionLearner",
    "block_score",
    "first_passage_within",
    "heap_key",
    "hop_survival",
    "load_snapshot",
    "restore_or_fresh",
    "save_snapshot",
    "transition_entropy_ratio",
]
