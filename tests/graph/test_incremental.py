"""Incremental evaluation: copied session rows, the sessions whose scores moved, the live columns."""

import numpy as np
import pytest

from agentkv.graph import (
    History,
    LiveSessions,
    Predictor,
    ReuseConfig,
    SessionTiming,
    TimingConfig,
    TransitionLearner,
    score_reuse,
)

AGENTS = "wxyz"


def _workload() -> tuple[TransitionLearner, SessionTiming, float]:
    """A ring w -> x -> y -> z -> w with 1-3 s gaps, six live sessions at different agents, told
    answers for two of them and a learned end hazard (twelve ended sessions)."""
    learner, timing = TransitionLearner(), SessionTiming()
    t = 0.0
    for session in range(12):
        parent = None
        for step in range(session % 4 + 2):
            agent = AGENTS[step % 4]
            learner.observe(agent, f"old{session}", parent)
            timing.observe(f"old{session}", agent, t, step=step)
            parent, t = agent, t + 1.0 + step % 3
        timing.end(f"old{session}")
    for session in range(6):
        agent = AGENTS[session % 4]
        timing.observe(f"s{session}", agent, t - session * 0.7, step=0)
    timing.answered("s1", True)
    timing.answered("s2", False)
    timing.take_touched()  # as an evaluation does: later touches are the tests' own
    return learner, timing, t


def _score(learner, timing, sessions, now, gaps, reuse=None):
    chain = Predictor(learner).chain()
    return score_reuse(chain, gaps, sessions, now=now, session_start_rate=0.2,
                       continuation={a: timing.continuation(a) for a in chain.agents},
                       interposed=learner.interposed_rate(), predictability=learner.predictability(),
                       gap_count=timing.gaps, config=ReuseConfig(r_min=0.0), end_hazard=timing.end_hazards(),
                       reuse=reuse)


def test_live_columns_are_the_session_tuples():
    _, timing, _ = _workload()
    live = timing.live()
    assert [tuple(row) for row in zip(*live, strict=True)] == timing.sessions()
    assert live.going_on[1] == pytest.approx(1.0) and live.going_on[2] == pytest.approx(0.0)
    assert live.without({"s0", "s3"}).names == ("s1", "s2", "s4", "s5")
    assert live.without(set()) is live


def test_reusing_a_table_with_every_session_touched_is_a_full_evaluation():
    learner, timing, t = _workload()
    gaps = timing.table()
    previous = _score(learner, timing, timing.live(), t, gaps)
    full = _score(learner, timing, timing.live(), t + 0.4, gaps)
    reused = _score(learner, timing, timing.live(), t + 0.4, gaps, reuse=(previous, set(timing.live().names)))
    assert np.array_equal(reused.session_rate, full.session_rate)
    assert np.array_equal(reused.anchor_rate, full.anchor_rate)
    assert reused.sessions == full.sessions and reused.dead == full.dead


def test_untouched_sessions_keep_their_rows_and_the_anchors_sum_over_all():
    learner, timing, t = _workload()
    gaps = timing.table()
    previous = _score(learner, timing, timing.live(), t, gaps)
    timing.observe("s3", "x", t)  # s3's next request, and a new session
    timing.observe("s9", "w", t)
    later = t + 0.3
    reused = _score(learner, timing, timing.live(), later, gaps, reuse=(previous, timing.take_touched()))
    full = _score(learner, timing, timing.live(), later, gaps)
    for session, row in reused.sessions.items():
        if session in ("s3", "s9"):
            assert np.array_equal(reused.session_rate[row], full.session_rate[full.sessions[session]])
        else:  # idle 0.3 s longer by now, but not re-evaluated
            assert np.array_equal(reused.session_rate[row], previous.session_rate[previous.sessions[session]])
    # the anchors combine the rows the table holds, as a full evaluation combines its own
    assert not np.array_equal(reused.anchor_rate, previous.anchor_rate)
    unused = np.log1p(-reused.session_rate * reused.resolution).sum(axis=0)
    only_live = -np.expm1(unused) / reused.resolution
    assert np.all(reused.anchor_rate >= only_live - 1e-15)  # plus the sessions yet to start


def test_same_inputs_give_the_full_evaluation_exactly():
    learner, timing, t = _workload()
    gaps = timing.table()
    previous = _score(learner, timing, timing.live(), t, gaps)
    timing.observe("s4", "y", t)  # only s4 moved; the clock did not
    reused = _score(learner, timing, timing.live(), t, gaps, reuse=(previous, timing.take_touched()))
    full = _score(learner, timing, timing.live(), t, gaps)
    assert np.array_equal(reused.session_rate, full.session_rate)
    assert np.array_equal(reused.anchor_rate, full.anchor_rate)


def test_a_new_agent_in_the_chain_evaluates_every_session():
    learner, timing, t = _workload()
    gaps = timing.table()
    previous = _score(learner, timing, timing.live(), t, gaps)
    learner.observe("v", "s0", "w")  # the chain grows a fifth agent
    reused = _score(learner, timing, timing.live(), t + 0.2, gaps, reuse=(previous, set()))
    full = _score(learner, timing, timing.live(), t + 0.2, gaps)
    assert reused.agents == full.agents != previous.agents
    assert np.array_equal(reused.session_rate, full.session_rate)


def test_changed_sessions_names_exactly_the_sessions_whose_history_scores_moved():
    learner, timing, t = _workload()
    gaps = timing.table()
    before = _score(learner, timing, timing.live(), t, gaps)
    timing.observe("s0", "x", t + 5.0)  # s0 moves on; s5 ends; s7 starts
    timing.end("s5")
    timing.observe("s7", "w", t + 5.0)
    after = _score(learner, timing, timing.live(), t + 5.0, gaps)
    changed = after.changed_sessions(before)
    assert changed is not None and {"s0", "s5", "s7"} <= changed
    score_before, score_after = before.scorer(), after.scorer()
    for session in after.sessions.keys() & before.sessions.keys():
        moved = any(score_before(History(session, frozenset(a))) != score_after(History(session, frozenset(a)))
                    for a in AGENTS)
        assert (session in changed) == moved
    assert after.changed_sessions(after) == set()
    learner.observe("v", "s0", "x")
    assert _score(learner, timing, timing.live(), t + 5.0, gaps).changed_sessions(after) is None


def test_touched_sessions_are_taken_once_and_overflow_to_none():
    timing = SessionTiming(TimingConfig(max_sessions=3))
    assert timing.take_touched() == set()
    timing.observe("a", "w", 0.0)
    timing.answered("a", True)
    timing.observe("b", "x", 0.5)
    timing.end("b")
    assert timing.take_touched() == {"a", "b"}
    assert timing.take_touched() == set()
    for session in "cdef":
        timing.observe(session, "w", 1.0)
    assert timing.take_touched() is None  # more than max_sessions: take every session as touched
    assert timing.take_touched() == set()


def test_live_sessions_is_a_named_tuple_of_columns():
    live = LiveSessions(("s",), ("w",), (1.0,), (2,), (None,))
    assert live.without({"s"}) == LiveSessions((), (), (), (), ())
