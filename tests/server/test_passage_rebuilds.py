"""The chain's first-passage table is rebuilt for a changed chain, never for a session event."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import server_patch._runtime as runtime_module
from agentkv.graph import PassageBuilder, _passage
from server_patch._runtime import AgentKVRuntime, RuntimeConfig


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The agents of every first-passage table built from now on."""
    sizes: list[int] = []
    build = _passage.first_passage_steps

    def counting(matrix, *args, **kwargs):
        sizes.append(len(matrix))
        return build(matrix, *args, **kwargs)

    monkeypatch.setattr(_passage, "first_passage_steps", counting)
    monkeypatch.setattr(runtime_module, "first_passage_steps", counting)
    return sizes


def test_session_events_rebuild_no_first_passage_table_but_a_declared_graph_does(builds: list[int]):
    """Session starts and ends bump ``facts.version`` (the scores see them at once) but leave the
    chain alone: keyed on it, every event rebuilt the table (~0.4 s at 256 agents)."""
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


def test_a_chain_of_many_agents_is_rebuilt_when_it_has_5_percent_more_agents_not_at_each_new_one(
        builds: list[int]):
    now = [0.0]
    runtime = AgentKVRuntime(RuntimeConfig(refresh_interval=0.0), clock=lambda: now[0], background=False)
    agents = PassageBuilder.MIN_AGENTS
    for turn in range(20):  # 20 x 64 dispatches: evidence enough that a few more do not rebuild
        for k in range(agents):
            runtime.learner.observe(f"a{k}", f"s{turn}", f"a{k - 1}" if k else "", step=k)
    runtime.refresh()
    assert builds == [agents]
    for k in range(agents, agents + 3):  # two agents join padded in; the third (5% more: 67) rebuilds
        runtime.learner.observe(f"a{k}", "late", f"a{k - 1}", step=k)
        runtime.refresh()
        assert runtime._passage.shape[1] == k + 1
    assert builds == [agents, agents + 3]
    # without 5% more evidence it is rebuilt every 2 s per 64 agents (its cost grows with the chain)
    for at, built in ((2.05, 2), (2.1, 3)):  # 2 s x 67 / 64 = 2.09 s
        now[0] = at
        runtime.learner.observe("a0", f"at {at}", "", step=0)
        runtime.refresh()
        assert len(builds) == built, (at, builds)
