"""The server rebuilds the chain's first-passage table off the scheduler's thread (real KVCacheManager)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import server_patch._runtime as runtime_module
from agentkv.graph import PassageBuilder, _passage
from server_patch._runtime import AgentKVRuntime, RuntimeConfig

from .test_runtime import manager, replay


def test_a_stale_table_is_rebuilt_on_a_thread_and_then_read(monkeypatch: pytest.MonkeyPatch):
    builds: list[tuple[str, int]] = []  # (thread, agents) of every table built
    build = _passage.first_passage_steps

    def recording(matrix, *args, **kwargs):
        builds.append((threading.current_thread().name, len(matrix)))
        return build(matrix, *args, **kwargs)

    monkeypatch.setattr(_passage, "first_passage_steps", recording)
    monkeypatch.setattr(runtime_module, "first_passage_steps", recording)
    monkeypatch.setattr(PassageBuilder, "MIN_AGENTS", 2)  # the thread serves chains of 64+ agents: here 4
    now = [0.0]
    kv = manager(160)
    runtime = AgentKVRuntime(RuntimeConfig(refresh_interval=0.0), clock=lambda: now[0], background=True)
    runtime.install(kv)
    for first in range(0, 12, 3):  # 2.5 s between rounds: each finds the table stale
        replay(kv, runtime, 3, first=first)
        now[0] += 2.5
    # the step builds the first table only (none to read); agents added later join the current
    # table padded (padded_passage) until the thread's table of the grown chain is read
    step = threading.current_thread().name
    sizes = [agents for _, agents in builds]
    assert [thread for thread, _ in builds] == [step] + ["agentkv-passage"] * (len(builds) - 1), builds
    assert sizes[0] < sizes[-1] == 4 and len(builds) >= 4, builds

    config = runtime.config.reuse
    chain = runtime.predictor.chain()
    expected = build(chain.matrix, config.steps or config.max_steps,
                     tolerance=0.0 if config.steps else config.step_tolerance)
    deadline = time.monotonic() + 30
    while not np.array_equal(runtime._passage, expected):  # the newest table is taken by a later refresh
        assert time.monotonic() < deadline, "the rebuilt table was never read"
        now[0] += 2.5
        time.sleep(0.01)
        runtime.refresh()
