"""Tapes: frozen, replayable multi-agent request streams (docs/tapes.md).

A tape is a JSONL file: one header object, then one object per LLM request in arrival
order. A request's prompt is a concatenation of named *segments* (``[key, n_tokens]``);
the token ids of a segment are a deterministic function of its key (``segment_tokens``),
so a tape carries no token ids and anyone can write one by hand. Replaying the same tape
under different cache policies gives paired comparisons. No vLLM import: ``format`` is the
file format, ``generator`` writes tapes of the workloads in ``workloads.py``.
"""

from .format import (
    ANCHOR_PREFIX,
    DEFAULT_OFFSET,
    DEFAULT_VOCAB,
    FORMAT,
    VERSION,
    Tape,
    TapeError,
    TapeRequest,
    TimeModel,
    measured_predictability,
    read_tape,
    segment_kind,
    segment_tokens,
    write_tape,
)
from .generator import WorkloadConfig, generate

__all__ = ["ANCHOR_PREFIX", "DEFAULT_OFFSET", "DEFAULT_VOCAB", "FORMAT", "VERSION", "Tape", "TapeError", "TapeRequest",
           "TimeModel", "WorkloadConfig", "generate", "measured_predictability", "read_tape", "segment_kind",
           "segment_tokens", "write_tape"]
