"""The next-use model against hand-computed values, and the timing it learns from."""

import math
import tracemalloc

import numpy as np
import pytest

from agentkv.graph import (
    UNCACHED,
    UNTAGGED,
    Anchor,
    GraphFacts,
    History,
    Predictor,
    ReuseConfig,
    SessionTiming,
    TimingConfig,
    TransitionLearner,
    first_passage_steps,
    first_passage_within,
    recency_scorer,
    score_reuse,
)
from agentkv.graph._passage import by_origin
from agentkv.graph._session_rates import _over_steps

A, B, C = 0, 1, 2
a, b = 0.3, 0.6
# A -> B with a, A stays with 1-a; B -> C with b, B -> A with 1-b; C -> A always.
CHAIN = np.array([[1 - a, a, 0.0], [1 - b, 0.0, b], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_first_passage_matches_closed_form_on_three_agent_chain(k):
    within, _ = first_passage_within(CHAIN, k)
    assert within[A, B] == pytest.approx(1 - (1 - a) ** k)  # leaving A is the only way to B
    c_from_a = {1: 0.0, 2: a * b, 3: a * b * (2 - a), 4: a * b * (1 + (1 - a) + (1 - a) ** 2 + a * (1 - b))}
    assert within[A, C] == pytest.approx(c_from_a[k])
    a_from_a = {1: 1 - a, 2: 1 - a + a * (1 - b), 3: 1.0, 4: 1.0}
    assert within[A, A] == pytest.approx(a_from_a[k])


def test_first_passage_steps_stop_once_no_first_visit_is_likely():
    ring = np.roll(np.eye(4), 1, axis=1)  # a deterministic 4-cycle: every agent first seen by step 4
    steps = first_passage_steps(ring, 24, tolerance=0.002)
    assert len(steps) == 5  # step 5 visits nothing for the first time
    assert steps[3].diagonal() == pytest.approx(np.ones(4))
    assert len(first_passage_steps(ring, 24, tolerance=0.0)) == 24


@pytest.mark.parametrize("rows", [[2, 0, 2], [1, 0, 1, 2, 3], [0, 1, 2, 3], [3, 3, 0, 1, 2, 3]])
def test_a_session_reads_the_passage_rows_of_its_agent_weighted_by_step(rows):
    # sessions of one agent share one product over that agent's rows of the table, read in place
    rng = np.random.default_rng(len(rows))
    table = by_origin(first_passage_steps(rng.random((4, 4)) / 4, 5, tolerance=0.0))
    weights = rng.random((5, len(rows)))
    expected = np.array([sum(weights[k, s] * table[row, k] for k in range(5)) for s, row in enumerate(rows)])
    assert np.allclose(_over_steps(weights, table, np.array(rows)), expected, rtol=1e-12, atol=0)


def test_the_first_passage_table_is_stored_by_origin():
    passage = first_passage_steps(np.full((3, 3), 0.3), 4, tolerance=0.0)
    assert passage.shape == (4, 3, 3)
    assert np.shares_memory(by_origin(passage), passage)  # no copy per evaluation


def _learned(edges: dict[tuple[str, str], int]) -> TransitionLearner:
    learner = TransitionLearner()
    for (src, dst), count in edges.items():
        for _ in range(count):
            learner.observe(dst, parent=src)
    return learner


def _timing(gap: float, agents: str, samples: int = 200) -> SessionTiming:
    """Every agent's requests are followed by the session's next request after ``gap`` seconds."""
    timing = SessionTiming()
    for n in range(samples):
        agent = agents[n % len(agents)]
        timing.observe("warm", agent, n * gap)
    timing.end("warm")
    return timing


def _table(learner, timing, sessions, now, **config):
    chain = Predictor(learner).chain()
    return score_reuse(chain, timing.table(), sessions, now=now, session_start_rate=0.0, continuation={},
                       interposed=None, predictability=learner.predictability(), gap_count=timing.gaps,
                       config=ReuseConfig(**{"r_min": 0.0, **config}))


def _within(time: float, resolution: float) -> float:
    """Reuses per second of one use expected after ``time``: P(within the resolution) / resolution."""
    return -math.expm1(-resolution / time) / resolution


def test_a_deterministic_ring_values_the_next_agent_by_the_time_to_it():
    learner = _learned({("x", "y"): 200, ("y", "z"): 200, ("z", "x"): 200})
    timing = _timing(2.0, "xyz")
    table = _table(learner, timing, [("s", "x", 100.0)], now=100.0)
    rates = {agent: table.session_rate[0, table.index[agent]] for agent in "xyz"}
    # y is next, in about one gap; z one gap later; x itself a gap after that
    assert rates["y"] > rates["z"] > rates["x"] > 0
    assert rates["y"] == pytest.approx(_within(2.0, table.resolution), rel=0.3)
    assert rates["z"] == pytest.approx(_within(4.0, table.resolution), rel=0.3)
    assert table.score(History("s", frozenset({"y"}))) == pytest.approx(math.log(rates["y"]), abs=0.05)  # quantized


def test_the_time_resolution_is_a_low_percentile_of_the_learned_gaps():
    learner = _learned({("x", "y"): 100, ("y", "x"): 100})
    timing = SessionTiming()
    for n in range(200):  # gaps of 0.5 s (a fifth of them), 8 s and 15.5 s
        timing.observe("warm", "xy"[n % 2], n * 8.0 + (0.0 if n % 5 else -7.5))
    assert _table(learner, timing, [], now=0.0).resolution == pytest.approx(0.5, rel=0.15)
    assert _table(learner, SessionTiming(), [], now=0.0).resolution == ReuseConfig().min_time  # no gap yet


def test_while_no_gap_is_learned_the_time_unit_is_the_pace_of_calls():
    """Calls outside any session teach no gap: the time unit is then the interval between calls (the
    centre of its gap bin), never below ``min_time``, so that the queue's recency counts calls, not
    seconds. Once a session's gap is learned, the unit is the resolution again."""
    learner = _learned({("x", "y"): 100, ("y", "x"): 100})
    chain = Predictor(learner).chain()

    def unit(timing):
        return score_reuse(chain, timing.table(), [], now=0.0, session_start_rate=0.0, continuation={},
                           interposed=None, predictability=learner.predictability(), gap_count=timing.gaps,
                           config=ReuseConfig(), pace=timing.pace()).time_unit

    assert SessionTiming().pace() is None and unit(SessionTiming()) == 1.0  # nothing tells the time scale
    for spacing in (0.001, 2.0, 60.0, 3600.0):
        timing = SessionTiming()
        for n in range(20):
            timing.call_outside_session(n * spacing)
        assert timing.pace() == pytest.approx(spacing, rel=0.15) if spacing > 0.02 else timing.pace() < 0.03
        assert unit(timing) == max(timing.pace(), ReuseConfig().min_time)
        timing.observe("s", "x", 20 * spacing)
        timing.observe("s", "y", 21 * spacing)  # a session's gap: the resolution rules
        assert timing.gaps == 1 and unit(timing) == pytest.approx(max(spacing, ReuseConfig().min_time), rel=0.15)


def test_history_never_outranks_its_anchor_and_anchors_combine_sessions_as_independent_chances():
    learner = _learned({("x", "y"): 100, ("y", "x"): 100})
    timing = _timing(1.0, "xy")
    sessions = [("s1", "x", 10.0), ("s2", "x", 10.0), ("s3", "y", 10.0)]
    table = _table(learner, timing, sessions, now=10.5)
    tau = table.resolution
    assert (table.session_rate <= table.anchor_rate[None, :] + 1e-12).all()
    y = table.index["y"]
    unused = np.log1p(-table.session_rate[:, y] * tau).sum()  # no session uses y within tau
    assert table.anchor_rate[y] == pytest.approx(-math.expm1(unused) / tau)
    for session, _, _ in sessions:
        for agent in "xy":
            assert table.score(History(session, frozenset(agent))) <= table.score(Anchor(frozenset(agent)))
    # a prefix shared by both agents is used by either of them
    both = table.score(Anchor(frozenset("xy")))
    either = -math.expm1(np.log1p(-table.anchor_rate * tau).sum()) / tau
    assert both == pytest.approx(math.log(either + 1e-9), abs=0.05)  # quantized


def test_many_sure_uses_of_an_anchor_count_at_most_one_use_per_resolution():
    learner = _learned({("x", "y"): 200, ("y", "x"): 200})
    timing = _timing(2.0, "xy")
    sessions = [(f"s{i}", "x", 100.0) for i in range(10)]  # every one calls y next, in about 2 s
    table = _table(learner, timing, sessions, now=100.0)
    y = table.index["y"]
    assert table.anchor_rate[y] <= 1.0 / table.resolution
    # each session's history is worth most of the anchor (adding rates would make it a tenth)
    assert (table.session_rate[:, y] >= 0.5 * table.anchor_rate[y]).all()


def test_a_session_in_a_short_tool_call_outranks_the_anchor_of_a_rare_agent():
    # u runs once in a while (new sessions start at u, one every 600 s); s1 is in a 2 s tool call
    learner = _learned({("x", "x"): 300, ("u", "x"): 3})
    timing = _timing(2.0, "x")
    chain = Predictor(learner).chain()
    table = score_reuse(chain, timing.table(), [("s1", "x", 99.0)], now=100.0, session_start_rate=1 / 600,
                        continuation={}, interposed=None, predictability=1.0, gap_count=timing.gaps,
                        config=ReuseConfig())
    assert table.score(History("s1", frozenset("x"))) > table.score(Anchor(frozenset("u")))


def test_a_session_told_its_answer_called_a_tool_keeps_the_agents_history_above_one_told_not():
    # a ring x -> y -> z -> x with 3 s hand-offs; x calls one tool per dispatch (2 s)
    timing = SessionTiming()
    t, step = 0.0, 0
    for _ in range(60):
        timing.observe("warm", "x", t, step=step)
        t += 2.0
        timing.observe("warm", "x", t, step=step)  # the tool returned: same dispatch
        for agent in "yz":
            t, step = t + 3.0, step + 1
            timing.observe("warm", agent, t, step=step)
        t, step = t + 3.0, step + 1
    timing.end("warm")
    learner = _learned({("x", "y"): 100, ("y", "z"): 100, ("z", "x"): 100})
    for session, tool_call in (("tool", True), ("answer", False), ("untold", None)):
        timing.observe(session, "x", t, step=0)
        if tool_call is not None:
            timing.answered(session, tool_call)
    assert [entry[4] for entry in timing.sessions()] == [1.0, 0.0, None]  # the prior: a tool call brings x back
    chain = Predictor(learner).chain()
    table = score_reuse(chain, timing.table(), timing.sessions(), now=t + 0.5, session_start_rate=0.0,
                        continuation={a: timing.continuation(a) for a in "xyz"}, interposed=None,
                        predictability=1.0, gap_count=timing.gaps, config=ReuseConfig())
    tool, answer, untold = (table.score(History(s, frozenset("x"))) for s in ("tool", "answer", "untold"))
    assert tool > untold > answer  # back in 1.5 s; a mix; back after three hand-offs
    # after the answer, y is next: that session's y-history is worth more than the tool-caller's
    assert table.score(History("answer", frozenset("y"))) > table.score(History("tool", frozenset("y")))


def test_a_hand_off_tool_is_learned_as_a_tool_call_that_does_not_bring_the_agent_back():
    timing = SessionTiming()
    for n in range(20):  # the supervisor calls transfer_to_coder (a tool call); the coder runs next
        session = f"s{n}"
        timing.observe(session, "supervisor", 10.0 * n, step=0)
        timing.answered(session, True)
        timing.observe(session, "coder", 10.0 * n + 1, step=1)
        timing.answered(session, True)  # the coder's tool call: a ReAct loop
        timing.observe(session, "coder", 10.0 * n + 3, step=1)
    assert timing.continuation_after("supervisor", True) == pytest.approx(2 / 22, rel=0.02)  # 20 decayed counts
    assert timing.continuation_after("coder", True) == 1.0
    assert timing.continuation_after("coder", False) == 0.0  # no evidence: the prior


def test_an_abandoned_session_goes_first_without_any_end_event():
    learner = _learned({("x", "y"): 100, ("y", "x"): 100})
    timing = _timing(1.0, "xy")
    table = _table(learner, timing, [("live", "x", 99.5), ("gone", "x", 0.0)], now=100.0)
    assert table.dead == ("gone",)  # idle 100 s where every gap was 1 s
    gone, live = (table.score(History(s, frozenset("y"))) for s in ("gone", "live"))
    assert gone < live - 10


def test_an_unknown_session_and_unknown_agents_score_at_the_floor():
    learner = _learned({("x", "y"): 10})
    table = _table(learner, _timing(1.0, "xy"), [], now=1.0)
    assert table.score(History("nobody", frozenset("x"))) == pytest.approx(math.log(1e-9), abs=0.05)
    assert table.score(Anchor(frozenset({"stranger"}))) == pytest.approx(math.log(1e-9), abs=0.05)


def test_unpredictable_workloads_score_every_group_alike():
    learner = _learned({(x, y): 10 for x in "abc" for y in "abc"})
    table = _table(learner, _timing(1.0, "abc"), [("s", "a", 0.0)], now=1.0, r_min=0.2)
    assert not table.predictable
    assert {table.score(g) for g in (UNTAGGED, Anchor(frozenset("a")), History("s", frozenset("b")))} == {0.0}


def test_sessions_of_one_call_each_rank_the_anchors_by_how_often_their_agents_start_one():
    """Independent calls (each its own session) teach no transition, R = 0; their agents' start
    rates still tell which anchor is reused soonest. With no start rate either, nothing is learned."""
    learner, timing = TransitionLearner(), SessionTiming()
    for n in range(60):  # "often" starts two sessions in three, "seldom" one
        agent = "seldom" if n % 3 == 2 else "often"
        learner.observe(agent, f"s{n}", now=float(n))
        timing.observe(f"s{n}", agent, float(n), step=0)
    assert learner.predictability() == 0.0
    chain = Predictor(learner).chain()

    def table(start_rate: float, r_min: float = 0.0):
        return score_reuse(chain, timing.table(), [], now=60.0, session_start_rate=start_rate, continuation={},
                           interposed=None, predictability=0.0, gap_count=timing.gaps, config=ReuseConfig(r_min=r_min))

    ranked = table(timing.session_rate(60.0))
    assert ranked.predictable
    often, seldom = ranked.score(Anchor(frozenset({"often"}))), ranked.score(Anchor(frozenset({"seldom"})))
    assert often > seldom > ranked.score(History("s59", frozenset({"often"})))
    for unranked in (table(0.0), table(timing.session_rate(60.0), r_min=0.1)):
        assert not unranked.predictable
        assert {unranked.score(g) for g in (Anchor(frozenset({"often"})), Anchor(frozenset({"seldom"})))} == {0.0}


def test_sessions_that_hardly_ever_continue_are_over_once_their_call_finished():
    """Before ``min_gaps`` gaps are learned an idle session's gap cannot be judged against them;
    while there are ``min_gaps`` session starts per gap or more, a session whose call finished is
    over (not one still running)."""
    learner, timing = TransitionLearner(), SessionTiming()
    for n in range(40):
        learner.observe("a", f"s{n}", now=float(n))
        timing.observe(f"s{n}", "a", float(n), step=0)
        if n < 39:
            timing.finished(f"s{n}")
    chain = Predictor(learner).chain()

    def dead(session_count: int) -> set[str]:
        return set(score_reuse(chain, timing.table(), timing.live(), now=40.0, session_start_rate=1.0,
                               continuation={}, interposed=None, predictability=0.0, gap_count=timing.gaps,
                               session_count=session_count, config=ReuseConfig()).dead)

    assert timing.gaps == 0 and timing.starts == 40
    assert dead(timing.starts) == {f"s{n}" for n in range(39)}
    assert dead(ReuseConfig().min_gaps - 1) == set()  # too few sessions to conclude anything
    timing.observe("s0", "a", 41.0, step=1)  # one came back after all (and runs): 40 starts, 1 gap
    assert dead(timing.starts) == {f"s{n}" for n in range(1, 39)}
    timing.observe("s1", "a", 42.0, step=1)  # two in 40: too many to take every idle one for over
    assert dead(timing.starts) == set()


@pytest.mark.parametrize("predictable", [True, False])
def test_uncached_blocks_go_first_whether_or_not_the_workload_is_predictable(predictable):
    ring = {("a", "b"): 10, ("b", "c"): 10, ("c", "a"): 10}
    learner = _learned(ring if predictable else {(x, y): 10 for x in "abc" for y in "abc"})
    table = _table(learner, _timing(1.0, "abc"), [("s", "a", 0.0)], now=1.0, r_min=0.2)
    assert table.predictable is predictable
    others = (UNTAGGED, Anchor(frozenset("a")), History("s", frozenset("b")), History("over", frozenset("b")))
    for score in (table.scorer(), table.scorer(retired={"over"}.__contains__, retired_score=-50.0)):
        assert score(UNCACHED) == -math.inf < min(map(score, others))
    lru = recency_scorer({"over"}.__contains__, -50.0)
    assert [lru(g) for g in (UNCACHED, *others)] == [-math.inf, 0.0, 0.0, 0.0, -50.0]


def test_interposed_agents_are_valued_before_every_dispatch():
    learner = _learned({("x", "y"): 100, ("y", "x"): 100})
    timing = _timing(1.0, "xy")
    chain = Predictor(learner).chain()
    interposed = np.zeros(len(chain.agents) + 1)[:-1]
    plain = score_reuse(chain, timing.table(), [("s", "x", 0.0)], now=0.5, session_start_rate=0.0,
                        continuation={}, interposed=None, predictability=1.0, gap_count=timing.gaps,
                        config=ReuseConfig())
    learner.observe("sel", parent="x")  # a third agent the chain knows, never dispatched to
    chain = Predictor(learner).chain()
    interposed = np.array([1.0 if agent == "sel" else 0.0 for agent in chain.agents])
    table = score_reuse(chain, timing.table(), [("s", "x", 0.0)], now=0.5, session_start_rate=0.0,
                        continuation={}, interposed=interposed, predictability=1.0, gap_count=timing.gaps,
                        config=ReuseConfig())
    sel = table.index["sel"]
    assert table.anchor_rate[sel] > plain.anchor_rate.max()  # called before every next dispatch


def test_declared_facts_rule_out_a_next_agent():
    facts = GraphFacts()
    learner = _learned({("a", "c"): 20, ("a", "b"): 1})
    facts.declare_graph(["a", "b", "c"], edges=[("a", "b"), ("b", "c")])
    chain = Predictor(learner, facts).chain()
    timing = _timing(1.0, "ab")
    table = score_reuse(chain, timing.table(), [("s", "a", 0.0)], now=0.1, session_start_rate=0.0,
                        continuation={}, interposed=None, predictability=1.0, gap_count=timing.gaps,
                        config=ReuseConfig(steps=1))
    assert table.session_rate[0, table.index["c"]] == 0.0
    assert table.session_rate[0, table.index["b"]] > 0.0


# -- SessionTiming ---------------------------------------------------------------------------


def test_gap_distribution_survival_and_residual_time():
    timing = SessionTiming()
    now = 0.0
    for n in range(400):  # gaps alternate 1 s and 10 s, every one a hand-off (no steps)
        now += 1.0 if n % 2 else 10.0
        timing.observe("s", "x", now)
    table = timing.table()
    row = np.array([table.row("x")])

    def handoff_at(idle: float) -> tuple[float, float]:
        _, _, survival, residual = table.split_at(row, np.array([idle]))
        return float(survival[0]), float(residual[0])

    survival, residual = handoff_at(0.0)
    assert survival == pytest.approx(1.0)
    assert residual == pytest.approx(1 / ((1 / 1 + 1 / 10) / 2), rel=0.15)  # harmonic mean of the time left
    survival, residual = handoff_at(3.0)  # only the 10 s gaps are left
    assert survival == pytest.approx(0.5, abs=0.03)
    assert residual == pytest.approx(7.0, rel=0.15)
    assert handoff_at(1000.0)[0] < 0.01
    assert table.median_gap in (pytest.approx(1.0, rel=0.3), pytest.approx(10.0, rel=0.3))


def test_time_left_moves_smoothly_with_the_idle_time_within_a_bin():
    # gaps spread evenly over 50-150 s: an idle time late in a ~30% wide bin still has the rest of
    # the spread ahead of it, not a time left near zero
    timing = SessionTiming()
    now = 0.0
    for n in range(1001):
        now += 50.0 + (n * 37 % 1001) / 10.0
        timing.observe("s", "x", now)
    table = timing.table()
    row = np.array([table.row("x")])
    idle = np.arange(60.0, 135.0, 0.5)
    survival, residual = table.split_at(np.repeat(row, len(idle)), idle)[2:]
    assert (np.diff(survival) <= 1e-12).all()  # never rises with the idle time
    assert residual.min() > 5.0  # the harmonic mean of the time left of a uniform spread is ~10 s here
    assert np.abs(np.diff(residual)).max() < 1.5  # no jump at a bin edge


def test_session_start_rate_and_continuation():
    timing = SessionTiming()
    for n in range(20):
        timing.observe(f"s{n}", "x", 5.0 * n, step=0)
        timing.observe(f"s{n}", "x", 5.0 * n + 1, step=0)  # the same dispatch: a tool loop
        timing.observe(f"s{n}", "y", 5.0 * n + 2, step=1)
    assert timing.session_rate(95.0) == pytest.approx(0.2)
    assert timing.session_rate(195.0) == pytest.approx(0.01)  # no session for 100 s: the rate decays
    assert timing.continuation("x") == pytest.approx(0.5, rel=1e-3)  # the older counts weigh a little less
    assert timing.continuation("y") == 0.0


def test_the_continuation_follows_a_change_in_an_agent_s_tool_use():
    """After 3,000 sessions in which x's calls always ran a tool loop, x stops calling tools: 1,000
    sessions later (two half-lives of x's counts) the estimates have followed; all-time counts would
    still read 0.75 and 0.9 (3,000 of the 4,000 requests, of the told answers)."""
    timing = SessionTiming()
    now = 0.0
    for n in range(4000):
        loops = n < 3000
        session = f"s{n}"
        timing.observe(session, "x", now, step=0)
        timing.answered(session, tool_call=True)  # a hand-off tool (transfer_to_y) once x stops looping
        if loops:
            timing.observe(session, "x", now + 1.0, step=0)
            timing.answered(session, tool_call=False)
        timing.observe(session, "y", now + 2.0, step=1)
        timing.end(session)
        now += 5.0
    assert timing.continuation("x") < 0.2
    assert timing.continuation_after("x", True) < 0.3


def test_calls_outside_any_session_set_the_pace_of_starts_and_leave_no_session():
    timing = SessionTiming()
    for n in range(10):
        timing.observe(f"s{n}", "x", 10.0 * n, step=0)
        timing.call_outside_session(10.0 * n + 5.0)  # between every two sessions
    assert timing.session_rate(95.0) == pytest.approx(0.2)
    assert timing.starts == 10 and timing.live().names == tuple(f"s{n}" for n in range(10))


def test_the_start_rate_picks_up_the_pace_as_soon_as_sessions_start_again_after_a_pause():
    timing = SessionTiming()
    timing.observe("early", "x", 0.0, step=0)
    for n in range(3):  # after a 40 s pause, sessions start every 0.25 s
        timing.observe(f"s{n}", "x", 40.0 + 0.25 * n, step=0)
    assert timing.session_rate(40.5) == pytest.approx(4.0)  # a running mean would read ~0.03/s
    assert timing.session_rate(50.5) == pytest.approx(0.1)  # ... and a new pause decays it


def test_timing_state_is_bounded():
    timing = SessionTiming(TimingConfig(max_sessions=10, max_agents=4))
    for n in range(1000):
        timing.observe(f"s{n % 3}", f"agent{n % 9}", float(n))
    assert len(timing.table().agents) == 4
    for n in range(1000):
        timing.observe(f"new{n}", "agent0", 1000.0 + n)
    assert len(timing.sessions()) == 10


def test_session_lengths_give_the_hazard_of_ending_here():
    timing = SessionTiming()
    assert not timing.end_hazards().any()  # nothing ended yet: no opinion
    for n in range(20):  # every session runs exactly 3 dispatches, then ends
        for step in range(3):
            timing.observe(f"s{n}", "xyz"[step], 10.0 * n + step, step=step)
        timing.end(f"s{n}")
    hazards = timing.end_hazards()
    assert hazards[0] == hazards[1] == 0.0
    assert hazards[2] > 0.9
    timing.observe("live", "x", 500.0, step=0)
    timing.observe("live", "y", 501.0, step=1)
    timing.observe("live", "z", 502.0, step=2)
    assert timing.sessions()[-1][3] == 3


def test_uses_beyond_a_sessions_learned_end_count_for_nothing():
    learner = _learned({("x", "y"): 200, ("y", "z"): 200, ("z", "x"): 200})
    timing = SessionTiming()
    for n in range(20):  # every session runs x, y, z, then ends
        for step in range(3):
            timing.observe(f"s{n}", "xyz"[step], 10.0 * n + step, step=step)
        timing.end(f"s{n}")
    timing.observe("live", "x", 500.0, step=0)
    chain = Predictor(learner).chain()

    def rates(end_hazard):
        table = score_reuse(chain, timing.table(), timing.sessions(), now=500.5, session_start_rate=0.0,
                            continuation={}, interposed=None, predictability=1.0, gap_count=timing.gaps,
                            config=ReuseConfig(r_min=0.0), end_hazard=end_hazard)
        return {agent: table.session_rate[0, table.index[agent]] for agent in "xyz"}

    forever, learned = rates(None), rates(timing.end_hazards())
    # y and z come in this session's 2nd and 3rd dispatches; x again only in a 4th, which never comes
    assert learned["y"] == pytest.approx(forever["y"], rel=0.01)
    assert learned["z"] == pytest.approx(forever["z"], rel=0.01)
    assert forever["x"] > 0 and learned["x"] < 0.1 * forever["x"]


def test_a_request_without_a_step_continues_the_dispatch_of_its_agent():
    timing = SessionTiming()
    assert timing.implied_step("s", "a") == 0  # a new session
    timing.observe("s", "a", 0.0, 0)
    assert timing.implied_step("s", "a") == 0 and timing.implied_step("s", "b") == 1
    timing.observe("s", "b", 1.0, 1)
    assert timing.implied_step("s", "a") == 2
    timing.expire("s")  # taken for over in b's tool call, which then returns: the same dispatch
    assert timing.implied_step("s", "b") == 1 and timing.implied_step("s", "c") == 2
    assert timing.implied_step("t", "b") == 0  # a session never seen


def test_a_busy_session_is_idle_0_and_a_timed_out_one_that_returns_continues():
    timing = SessionTiming()
    timing.observe("s", "a", 0.0, 0)
    assert timing.live().seen == (math.inf,)  # its request waits or runs: idle 0, whatever the time
    timing.finished("s")
    assert timing.live().seen == (0.0,)  # idle since its arrival, as the gaps are counted
    timing.observe("s", "b", 4.0, 1)
    timing.finished("s")
    timing.expire("s")  # idle beyond its gaps: counted as ended after 2 dispatches ...
    assert timing.live().names == () and timing._lengths[1] == pytest.approx(1.0)
    timing.observe("s", "a", 100.0, 2)  # ... until it comes back: the end is taken back, the gap learned
    assert timing.live().dispatches == (3,) and timing._lengths.sum() == pytest.approx(0.0)
    table = timing.table()
    survival = table.split_at(np.array([table.row("b")]), np.array([50.0]))[2]
    assert timing.gaps == 2 and survival[0] > 0.3  # b's 96 s gap to the return is in its hand-off gaps


def test_a_session_that_moved_on_since_the_table_scores_as_just_dispatched_not_as_before():
    # a ring x -> y -> z -> x: the table saw session "s" at x; it has called y since (faster than
    # a refresh), and "new" started at x since. The row of "s" says y is next: its new history
    # behind y would outrank anchors; once y is dispatched, y is three dispatches away.
    learner = _learned({("x", "y"): 200, ("y", "z"): 200, ("z", "x"): 200})
    timing = _timing(1.0, "xyz")
    table = _table(learner, timing, [("s", "x", 100.0)], now=100.0)
    just = {agent: table.dispatched_rate[table.index[agent]] for agent in "xyz"}
    assert just["y"][table.index["z"]] > just["y"][table.index["y"]]  # after y: z is next, y three dispatches on
    stale = table.scorer()
    current = {"s": "y", "new": "x"}.get
    score = table.scorer(current=current)
    y_history, z_history = History("s", frozenset("y")), History("s", frozenset("z"))
    assert score(y_history) < stale(y_history) - 0.5  # no longer "y is next"
    assert score(y_history) == pytest.approx(math.log(just["y"][table.index["y"]]), abs=0.06)
    assert score(z_history) <= stale(z_history)  # never above what its row says
    assert score(History("new", frozenset("y"))) == pytest.approx(math.log(just["x"][table.index["y"]]), abs=0.06)
    assert stale(History("new", frozenset("y"))) < score(History("new", frozenset("y")))  # not the floor
    assert score(History("s", frozenset("x"))) <= score(Anchor(frozenset("x")))
    assert table.scorer(current={"s": "x"}.get)(y_history) == stale(y_history)  # it did not move: its row


def test_over_steps_copies_no_slice_of_the_table_per_session():
    """Gathering table[rows] cost S x K x n floats (0.5 GiB at 256 agents and 10k sessions); past
    ``_GATHER_LIMIT`` entries the products are taken per row instead."""
    rng = np.random.default_rng(0)
    n, steps, sessions = 64, 24, 4000
    table = rng.random((n, steps, n))
    rows = rng.integers(0, n, sessions).astype(np.intp)
    weights = rng.random((steps, sessions))
    tracemalloc.start()
    try:
        _over_steps(weights, table, rows)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * sessions * n * 8  # the result, and a little more; a gather is 24 times it


def _ending_at_b() -> tuple[TransitionLearner, GraphFacts, SessionTiming]:
    """a -> b, and every session ends after b (the declared graph agrees: b -> END)."""
    learner = TransitionLearner()
    for i in range(50):
        learner.observe("a", session=f"w{i}", parent="", now=0.0)
        learner.observe("b", session=f"w{i}", now=0.0)
        learner.end_session(f"w{i}")
    facts = GraphFacts()
    facts.declare_graph(["a", "b"], edges=[("__start__", "a"), ("a", "b"), ("b", "__end__")])
    return learner, facts, _timing(2.0, "ab")


def test_untagged_blocks_score_at_the_floor_when_the_typical_live_session_is_worth_nothing():
    """Half of a typical live session's next use: a session at an agent that ends it has none,
    so untagged blocks must not outrank the anchors (they scored 0.0, one reuse per second)."""
    learner, facts, timing = _ending_at_b()
    table = score_reuse(Predictor(learner, facts).chain(), timing.table(), [("s", "b", 100.0)], now=100.5,
                        session_start_rate=0.5, continuation={}, interposed=None,
                        predictability=learner.predictability(), gap_count=timing.gaps, config=ReuseConfig())
    assert table.predictable and float(np.median(table.session_rate.max(axis=1))) == 0.0
    untagged = table.score(UNTAGGED)
    assert untagged < min(table.score(Anchor(frozenset(agent))) for agent in "ab")
    assert untagged == table.score(History("unknown", frozenset("a")))  # the floor


def test_untagged_blocks_can_be_kept_under_every_anchor_the_model_expects_a_use_of():
    """Half of a typical live session's next use is half of its next agent's (b's): above the anchor
    of a, which only new sessions use, when they start seldom. A server without recognition keeps
    its untagged blocks (the queries of calls outside any session) under every such anchor."""
    learner, facts, timing = _ending_at_b()
    table = score_reuse(Predictor(learner, facts).chain(), timing.table(), [("s", "a", 100.0)], now=100.5,
                        session_start_rate=0.05, continuation={}, interposed=None,
                        predictability=learner.predictability(), gap_count=timing.gaps, config=ReuseConfig())
    anchors = {agent: table.score(Anchor(frozenset(agent))) for agent in "ab"}
    assert anchors["b"] > table.score(UNTAGGED) > anchors["a"]
    assert table.scorer(untagged_under_anchors=True)(UNTAGGED) == anchors["a"]  # met in recency order


def test_a_conversation_scores_the_share_of_its_agents_anchor_its_continuation_is_and_no_less_than_untagged():
    """Without recognition, the history of a call outside any session (a conversation) is valued by
    the chance that its agent's next call continues it: that share of the agent's anchor, never
    below an untagged block; a session's history is scored as before."""
    learner, facts, timing = _ending_at_b()
    table = score_reuse(Predictor(learner, facts).chain(), timing.table(), [("s", "a", 100.0)], now=100.5,
                        session_start_rate=0.05, continuation={}, interposed=None,
                        predictability=learner.predictability(), gap_count=timing.gaps, config=ReuseConfig())
    shares = {"#likely": 0.5, "#never": 0.0}
    score = table.scorer(untagged_under_anchors=True, continuation=shares.get)
    b = frozenset("b")
    likely = math.floor(math.log(0.5 * table.anchor_rate[table.index["b"]] + 1e-9) * 20) / 20
    assert score(History("#likely", b)) == likely > score(UNTAGGED)
    assert score(History("#never", b)) == score(UNTAGGED)
    assert score(History("s", b)) == table.score(History("s", b))  # continuation None: a session


def test_a_declared_graph_keeps_the_learned_chance_of_ending_after_an_agent():
    """The declared graph bounds where a session goes next, not whether it stops: b's row keeps
    its learned ending share (half the sessions end after b), only b -> a is ruled out."""
    learner = TransitionLearner()
    for i in range(100):
        learner.observe("a", session=f"s{i}", parent="", now=0.0)
        learner.observe("b", session=f"s{i}", now=0.0)
        if i % 2:
            learner.observe("c", session=f"s{i}", now=0.0)
        learner.end_session(f"s{i}")
    plain = Predictor(learner).chain()
    facts = GraphFacts()
    facts.declare_graph(["a", "b", "c"], edges=[("__start__", "a"), ("a", "b"), ("c", "__end__")],
                        conditional_edges=[("b", "c"), ("b", "__end__")])
    declared = Predictor(learner, facts).chain()
    b, c = plain.index["b"], plain.index["c"]
    assert declared.matrix[b].sum() == pytest.approx(plain.matrix[b].sum())
    assert declared.matrix[b, c] == pytest.approx(0.5, abs=0.01)
    assert declared.matrix[b, plain.index["a"]] == 0.0
    assert declared.entry.sum() == pytest.approx(1.0)  # a new session starts somewhere
