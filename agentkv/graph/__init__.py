"""The learning core: transition learner, session timing, graph facts, predictor and next-use scoring.

Pure Python + numpy + networkx; shared by the client and the vLLM server extension.
"""

from ._facts import END, START, FactsFull, GraphFacts
from ._learner import LearnerConfig, Observation, TransitionLearner, transition_entropy_ratio
from ._passage import PassageBuilder, first_passage_steps, first_passage_within, padded_passage, passage_size
from ._peers import COUNTS_FORMAT, COUNTS_VERSION, PEER_WEIGHT_FLOOR, PeerExport
from ._predictor import ChainModel, Prediction, Predictor, top_successors
from ._reuse import (
    UNCACHED,
    UNTAGGED,
    Anchor,
    Group,
    History,
    ReuseConfig,
    ReuseTable,
    Uncached,
    Untagged,
    recency_scorer,
    score_reuse,
)
from ._snapshot import (
    SNAPSHOT_VERSION,
    LearnedState,
    SnapshotError,
    load_learned_state,
    load_snapshot,
    restore_snapshot,
    save_snapshot,
    snapshot_document,
    write_snapshot,
)
from ._timing import GapTable, LiveSessions, SessionTiming, TimingConfig

__all__ = [
    "COUNTS_FORMAT",
    "COUNTS_VERSION",
    "END",
    "PEER_WEIGHT_FLOOR",
    "SNAPSHOT_VERSION",
    "START",
    "UNCACHED",
    "UNTAGGED",
    "Anchor",
    "ChainModel",
    "FactsFull",
    "GapTable",
    "GraphFacts",
    "Group",
    "History",
    "LearnedState",
    "LearnerConfig",
    "LiveSessions",
    "Observation",
    "PassageBuilder",
    "PeerExport",
    "Prediction",
    "Predictor",
    "ReuseConfig",
    "ReuseTable",
    "SessionTiming",
    "SnapshotError",
    "TimingConfig",
    "TransitionLearner",
    "Uncached",
    "Untagged",
    "first_passage_steps",
    "first_passage_within",
    "load_learned_state",
    "load_snapshot",
    "padded_passage",
    "passage_size",
    "recency_scorer",
    "restore_snapshot",
    "save_snapshot",
    "score_reuse",
    "snapshot_document",
    "top_successors",
    "transition_entropy_ratio",
    "write_snapshot",
]
