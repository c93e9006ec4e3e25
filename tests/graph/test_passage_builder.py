"""PassageBuilder: first-passage tables built off the caller's thread, handed over whole, newest first."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from agentkv.graph import PassageBuilder, first_passage_steps, padded_passage, passage_size


def _chain(n: int, seed: int) -> np.ndarray:
    rows = np.random.default_rng(seed).random((n, n))
    return rows / rows.sum(axis=1, keepdims=True)


def _wait_take(builder: PassageBuilder, timeout: float = 30.0) -> np.ndarray:
    deadline = time.monotonic() + timeout
    while (table := builder.take()) is None:
        assert time.monotonic() < deadline, "no table was built"
        time.sleep(0.001)
    return table


def test_a_table_built_in_the_background_is_the_one_built_in_place_and_taken_once():
    matrix = _chain(PassageBuilder.MIN_AGENTS, 0)
    builder = PassageBuilder()
    builder.submit(matrix, 24, tolerance=0.002)
    table = _wait_take(builder)
    assert builder._worker is not None and builder._worker is not threading.current_thread()
    np.testing.assert_array_equal(table, first_passage_steps(matrix, 24, tolerance=0.002))
    assert builder.take() is None  # handed over once


def test_the_newest_submit_wins_and_a_table_is_never_partial():
    builder = PassageBuilder()
    matrices = [_chain(128, seed) for seed in range(6)]
    for matrix in matrices:  # faster than the builds: the waiting job is replaced
        builder.submit(matrix, 24, tolerance=0.0)
    expected = first_passage_steps(matrices[-1], 24, tolerance=0.0)
    deadline = time.monotonic() + 30
    while True:
        table = _wait_take(builder)
        assert table.shape == expected.shape  # whole tables only
        if np.array_equal(table, expected):
            break
        assert time.monotonic() < deadline, "the newest submit was never built"


@pytest.mark.parametrize(("agents", "background"),
                         [(PassageBuilder.MIN_AGENTS - 1, True), (PassageBuilder.MIN_AGENTS, False)])
def test_a_small_chain_or_no_background_is_built_in_submit(agents: int, background: bool):
    matrix = _chain(agents, 1)
    builder = PassageBuilder(background=background)
    builder.submit(matrix, 6, tolerance=0.0)
    assert builder._worker is None
    np.testing.assert_array_equal(builder.take(), first_passage_steps(matrix, 6, tolerance=0.0))


def test_a_padded_table_keeps_the_old_chain_and_says_nothing_of_the_agents_added():
    old = first_passage_steps(_chain(5, 1), 6, tolerance=0.0)
    grown = padded_passage(old, 7)
    assert grown.shape == (old.shape[0], 7, 7)
    assert np.array_equal(grown[:, :5, :5], old)
    assert not grown[:, 5:, :].any() and not grown[:, :, 5:].any()
    assert grown.transpose(1, 0, 2).flags["C_CONTIGUOUS"]  # stored by origin, as its readers take it


@pytest.mark.parametrize(("built", "agents", "size"), [
    (None, 300, 300),  # no table yet
    (63, 64, 64),  # under 64 agents: rebuilt at every new one (half a millisecond)
    (64, 66, 64), (64, 67, 67),  # from 64 on, kept until the chain has 5% more agents (64 // 20 = 3)
    (200, 209, 200), (200, 210, 210),
    (200, 150, 150),  # a smaller chain (a restored snapshot) is built anew
])
def test_a_table_of_many_agents_is_kept_until_the_chain_has_5_percent_more(built: int | None, agents: int,
                                                                           size: int):
    assert passage_size(built, agents) == size
