"""SessionTiming's learned distributions in a snapshot: restored exactly, a bad part dropped alone."""

import copy
import json
import logging

import numpy as np
import pytest

from agentkv.graph import (
    GapTable,
    SessionTiming,
    TimingConfig,
    TransitionLearner,
    load_learned_state,
    load_snapshot,
    save_snapshot,
    snapshot_document,
)
from agentkv.graph._timing_state import export_timing, import_timing


def _trained() -> SessionTiming:
    """Tool loops, hand-offs, told answers, ended and expired sessions, one that came back."""
    timing = SessionTiming()
    now = 0.0
    for s in range(30):
        session = f"s{s}"
        for step, agent in enumerate(("planner", "coder", "critic")[: 1 + s % 3]):
            calls = 1 + (s + step) % 3
            for call in range(calls):  # a tool loop: the same agent and step again
                now += 0.05 * (1 + s % 7) + 0.3 * call
                timing.observe(session, agent, now, step)
                # every fifth session's last tool call hands off (a supervisor's transfer_to_x)
                timing.answered(session, tool_call=call < calls - 1 or s % 5 == 0)
                timing.finished(session)
        if s % 4 == 0:
            timing.expire(session)
        else:
            timing.end(session)
    timing.observe("s0", "coder", now + 40.0, 1)  # came back after its expiry
    timing.observe("live", "planner", now + 41.0, 0)
    return timing


def _assert_same_outputs(restored: SessionTiming, timing: SessionTiming) -> None:
    table, expected = restored.table(), timing.table()
    assert isinstance(table, GapTable)
    assert (table.agents, table.index, table.median_gap) == (expected.agents, expected.index, expected.median_gap)
    for got, want in ((table.tool, expected.tool), (table.handoff, expected.handoff), ((table.cdf,), (expected.cdf,))):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    for agent in (*expected.agents, "never-seen"):
        assert restored.continuation(agent) == timing.continuation(agent)
        for tool_call in (False, True):
            assert restored.continuation_after(agent, tool_call) == timing.continuation_after(agent, tool_call)
    np.testing.assert_array_equal(restored.end_hazards(), timing.end_hazards())
    assert (restored.gaps, restored.starts, restored.gap_agents) == (timing.gaps, timing.starts, timing.gap_agents)


def test_a_snapshot_restores_the_learned_timing_exactly(tmp_path):
    timing = _trained()
    assert timing.end_hazards().any() and timing.continuation_after("coder", True) not in (0.0, 1.0)
    path = tmp_path / "state.json"
    save_snapshot(path, TransitionLearner(), None, timing)
    restored = load_learned_state(path).timing
    _assert_same_outputs(restored, timing)
    assert restored.sessions() == [] and restored.session_rate(1e6) == 0.0  # live sessions and pace: not kept
    assert restored.learned_version == timing.learned_version
    for t in (timing, restored):  # both learn on alike (new sessions: the originals' live ones were not kept)
        for step, agent in enumerate(("planner", "newcomer", "planner")):
            t.observe("next", agent, 9000.0 + 2.5 * step, step)
        t.end("next")
    _assert_same_outputs(restored, timing)


def test_the_export_is_a_copy():
    timing = _trained()
    exported = export_timing(timing)
    before = json.dumps(exported)
    timing.observe("s1", "planner", 1e4, 7)
    timing.observe("more", "critic", 1e4, 0)
    timing.end("more")
    assert json.dumps(exported) == before


def test_a_snapshot_without_timing_restores_it_fresh(tmp_path):
    """One written before the timing was kept (or with none): the counts are restored as ever."""
    learner = TransitionLearner()
    for agent in ("a", "b", "a", "b"):
        learner.observe(agent, "s")
    path = tmp_path / "state.json"
    document = snapshot_document(learner)
    del document["timing"]
    path.write_text(json.dumps(document))
    state = load_learned_state(path)
    assert state.learner.agents == ["a", "b"] and state.timing.gaps == 0 and state.timing.table().agents == ()


def test_a_loader_ignores_a_top_level_part_it_does_not_know(tmp_path):
    """What lets an older agentkv (its loader reads "learner" and "facts" only) read a snapshot with
    the timing, and this one read a snapshot with a part added later, in snapshot version 1."""
    learner = TransitionLearner()
    learner.observe("a", "s")
    learner.observe("b", "s")
    document = snapshot_document(learner, None, _trained())
    document["added_later"] = {"anything": [1, 2]}
    path = tmp_path / "state.json"
    path.write_text(json.dumps(document))
    assert load_snapshot(path)[0].agents == ["a", "b"]
    assert load_learned_state(path).timing.gaps == _trained().gaps


def _set(path: tuple, value: object):
    def change(state: dict) -> None:
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


def _delete(key: str):
    return lambda state: state.pop(key)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda state: state["edges"].append(9000.0), "other bins"),
        (_set(("agents",), "planner"), "list of at most"),
        (_set(("agents", 0), "a b"), "agent"),
        (_set(("agents", 0), 7), "string"),
        (_set(("agents", 1), "planner"), "repeat"),
        (_set(("weights", 0), 0.5), "weights"),
        (_set(("weights", 0), float("nan")), "weights"),
        (_set(("weights", 0), 1e300), "weights"),
        (_set(("gaps", 0, 0, 3), -1.0), "gaps of '"),
        (_set(("gaps", 0, 0, 3), float("inf")), "gaps of '"),
        (_set(("gaps", 0, 0, 3), True), "gaps of '"),
        (_set(("gaps", 0, 1), [0.0] * 47), "gaps of '"),
        (_set(("gaps", 0, 1), [20.0] * 48), "total at most 721.8"),  # a SessionTiming holds at most 721.8
        (_set(("gaps", 0, 1), [1e6] * 48), "numbers in"),  # accepted up to 1e15: it outweighed every gap for ever
        (_set(("global", 1, 3), 1e6), "global gaps"),
        (_set(("gaps",), []), "gaps must be a list"),
        (_set(("continued", 0), -1.5), "continued"),
        (_set(("continued", 0), "3"), "continued"),
        (_set(("handed_off", 0), float("inf")), "handed_off"),
        (_set(("handed_off", 0), 2**63), "handed_off"),
        (_set(("after_told", 0), [[1.0, 2.0]]), "after_told"),
        (_set(("after_told", 0, 1, 0), -3.0), "after_told"),
        (_set(("global", 0), None), "global gaps"),
        (_set(("global_weight",), "1"), "global_weight"),
        (_set(("lengths",), [0.0] * 65), "lengths"),
        (_set(("lengths", 2), 1e300), "lengths"),
        (_set(("lengths",), [4.0] * 64), "lengths must total at most 200"),  # decayed by 0.995 per end
        (_set(("tallies", "gaps"), -1), "tallies"),
        (_set(("tallies",), [1, 2, 3]), "tallies"),
        (_delete("weights"), "weights"),
        (lambda state: state.clear(), "other bins"),
    ],
)
def test_a_bad_timing_part_is_dropped_and_the_learned_counts_kept(tmp_path, caplog, change, reason):
    learner = TransitionLearner()
    for agent in ("a", "b", "a", "b"):
        learner.observe(agent, "s")
    document = snapshot_document(learner, None, _trained())
    change(document["timing"])
    path = tmp_path / "state.json"
    path.write_text(json.dumps(document))
    with pytest.raises((ValueError, KeyError, TypeError), match=reason):
        import_timing(copy.deepcopy(document["timing"]))
    with caplog.at_level(logging.WARNING, logger="agentkv.graph"):
        state = load_learned_state(path)
    assert state.learner.agents == ["a", "b"] and state.timing.gaps == 0 and state.timing.gap_agents == 0
    assert "dropping its session timing" in caplog.text and path.exists()  # the file stays: the next save replaces it


@pytest.mark.parametrize("half_life", [500.0, 0.5])
def test_a_saturated_timing_is_restored(tmp_path, half_life):
    """Its decayed counts at their most, what the refusal of larger ones is bound to (a half-life of
    0.5 gaps rescales the weights every ~170 gaps)."""
    config = TimingConfig(half_life=half_life)
    timing = SessionTiming(config)
    for n in range(int(40 * half_life) + 400):
        timing.observe("s", "loop", 0.5 * n, n % 2)  # a gap within the dispatch, then one to the next
    for n in range(3000):
        timing.observe(f"e{n}", "loop", 0.0)
        timing.end(f"e{n}")
    held = np.array(timing._hist["loop"]).sum() / timing._weight["loop"]
    assert held == pytest.approx(1 / (1 - 2 ** (-1 / half_life)), rel=1e-6)
    assert timing._lengths.sum() == pytest.approx(200.0, rel=1e-6)
    _assert_same_outputs(import_timing(json.loads(json.dumps(export_timing(timing))), config), timing)


def test_all_time_counts_of_an_older_snapshot_keep_their_ratio_at_the_decayed_weight():
    """Before the counts of what followed a request decayed, a snapshot held all-time integers: they
    are read as their ratio, weighing what a long-running server's decayed counts weigh (721.8)."""
    document = export_timing(_trained())
    agent = document["agents"][0]
    document["continued"][0], document["handed_off"][0] = 3_000_000, 1_000_000
    document["after_told"][0][1] = [90_000, 10_000]
    restored = import_timing(document)
    assert restored.continuation(agent) == pytest.approx(0.75)
    assert sum(restored._followed[agent]) == pytest.approx(721.8, rel=1e-3)
    assert restored.continuation_after(agent, True) == pytest.approx(0.9, rel=1e-3)  # the prior's 2 answers
    assert sum(restored._after_told[agent, True]) == pytest.approx(721.8, rel=1e-3)


def test_more_agents_than_the_timing_holds_are_refused():
    document = export_timing(_trained())
    with pytest.raises(ValueError, match="at most 2 names"):
        import_timing(document, TimingConfig(max_agents=2))


def test_the_learned_version_moves_with_what_a_snapshot_keeps_only():
    timing = _trained()
    learned, version = timing.learned_version, timing.version
    timing.answered("live", tool_call=True)  # live sessions' state: transient
    timing.finished("live")
    assert timing.version != version and timing.learned_version == learned
    timing.observe("live", "planner", 1e4, 0)  # a gap learned
    assert timing.learned_version != learned
    learned = timing.learned_version
    timing.end("live")  # a length learned
    assert timing.learned_version != learned
    learned = timing.learned_version
    timing.observe("fresh", "critic", 1e4, 0)  # a start counted
    assert timing.learned_version != learned
