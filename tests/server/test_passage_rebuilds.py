"""The chain's first-passage table is rebuilt for a changed chain, never for a session event."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import server_patch._runtime as runtime_module
from agentkv.graph import _passage
from server_patch._runtime import AgentKVRuntime, RuntimeConfig


def test_session_events_rebuild_no_first_passage_table_but_a_declared_graph_does(monkeypatch: pytest.MonkeyPatch):
    """Session starts and ends bump ``facts.version`` (the scores see them at once) but leave the
    chain alone: keyed on it, every event rebuilt the table (~0.4 s at 256 agents)."""
    builds: list[int] = []
    build = _passage.first_passage_steps

    def counting(matrix, *args, **kwargs):
        builds.append(len(matrix))
        return build(matrix, *args, **kwargs)

    monkeypatch.setattr(_passage, "first_passage_steps", counting)
    monkeypatch.setattr(runtime_module, "first_passage_steps", counting)
    now = [0.0]
    runtime = AgentKVRuntime(RuntimeConfig(), clock=lambda: now[0])
    agents = [f"a{i}" for i in range(8)]
    rng = np.random.default_rng(0)
    for _ in range(500):
        runtime.learner.observe(agents[rng.integers(8)], parent=agents[rng.integers(8)], now=0.0)
    runtime.table = runtime._evaluate(0.0)
    assert builds == [8]
    for i in range(10):
        if i % 2:
            runtime.facts.start_session(f"s{i}")
        else:
            runtime.facts.end_session(f"s{i}", cancelled=i % 4 == 0)
        now[0] += 0.01
        runtime.table = runtime._evaluate(now[0])
    assert builds == [8]
    runtime.facts.declare_graph(agents, edges=list(itertools.pairwise(agents)))
    runtime.table = runtime._evaluate(now[0] + 0.01)
    assert builds == [8, 8]
