"""Property tests: probabilities stay probabilities; next-use values keep the chain order."""

import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.graph import (
    UNTAGGED,
    Anchor,
    ChainModel,
    GraphFacts,
    History,
    LearnerConfig,
    Predictor,
    ReuseConfig,
    SessionTiming,
    TransitionLearner,
    Uncached,
    first_passage_within,
    score_reuse,
    top_successors,
)
from agentkv.graph import _session_rates as session_rates
from agentkv.graph._session_rates import _over_steps

agents = st.sampled_from(["a", "b", "c", "d", "e"])
sessions = st.sampled_from(["s1", "s2", "s3", None])
dispatch = st.tuples(agents, sessions, st.sampled_from([None, "", "a", "c"]), st.booleans())


@st.composite
def stochastic_matrices(draw):
    n = draw(st.integers(1, 6))
    raw = np.array(draw(st.lists(st.floats(0, 1), min_size=n * n, max_size=n * n))).reshape(n, n)
    raw[raw.sum(axis=1) == 0, 0] = 1.0
    return raw / raw.sum(axis=1, keepdims=True)


@settings(max_examples=150, deadline=None)
@given(stochastic_matrices(), st.lists(st.sampled_from("abcdefz"), max_size=8))
def test_the_top_successor_is_the_rows_single_best_or_nothing(matrix, asked):
    """What the view tells a warm-up coordinator (docs/protocol.md §2.4): exactly the stats row's
    best entry, left out on a tie and for an agent the chain does not know."""
    names = tuple("abcdef"[: len(matrix)])
    matrix = np.round(matrix, 1)  # ties are common
    chain = ChainModel(names, matrix, np.full(len(names), 1 / len(names)), {a: i for i, a in enumerate(names)})
    told = top_successors(chain, asked)
    for agent in set(asked):
        row = sorted(((p, b) for b, p in zip(names, matrix[names.index(agent)], strict=True)), reverse=True) \
            if agent in names else []
        single = bool(row) and (len(row) == 1 or row[0][0] > row[1][0])
        assert (agent in told) == single
        if single:
            assert (told[agent].agent, told[agent].probability) == (row[0][1], row[0][0])


@settings(max_examples=150, deadline=None)
@given(stochastic_matrices(), st.integers(1, 8))
def test_first_passage_is_a_probability_and_grows_with_k(matrix, k):
    shorter, _ = first_passage_within(matrix, k)
    longer, _ = first_passage_within(matrix, k + 1)
    assert ((shorter >= 0) & (shorter <= 1)).all()
    assert (longer >= shorter - 1e-12).all()
    assert np.allclose(first_passage_within(matrix, 1)[0], matrix)


@settings(max_examples=100, deadline=None)
@given(st.lists(dispatch, max_size=60), st.lists(st.floats(0, 50), min_size=1, max_size=60), st.booleans(),
       st.floats(0, 100))
def test_learned_model_stays_a_probability_model_and_history_never_outranks_its_anchor(dispatches, gaps, declare,
                                                                                          later):
    learner, _, table, chain = _learned_table(dispatches, gaps, declare, later)
    assert ((chain.matrix >= 0) & (chain.matrix <= 1 + 1e-12)).all()
    assert (chain.matrix.sum(axis=1) <= 1 + 1e-9).all()
    assert 0.0 <= learner.predictability() <= 1.0
    assert np.isfinite(table.anchor_rate).all() and (table.anchor_rate >= 0).all()
    assert np.isfinite(table.session_rate).all() and (table.session_rate >= 0).all()
    assert (table.session_rate <= table.anchor_rate[None, :] + 1e-9).all()
    assert np.isfinite(table.dispatched_rate).all() and (table.dispatched_rate >= 0).all()
    # also scored as having moved on to any agent since the table (or started since: "new")
    moved = [table.scorer(current=lambda session, agent=agent: agent) for agent in chain.agents]
    for session in [*table.sessions, "new"]:
        for agents in ({"a"}, {"a", "b"}, {"c"}):
            group = frozenset(agents)
            for score in (table.score, *moved):
                assert score(History(session, group)) <= table.score(Anchor(group)) + 1e-9
    assert all(0.0 <= table.survival(agent) <= 1.0 for agent in chain.agents)


@settings(max_examples=100, deadline=None)
@given(st.lists(dispatch, max_size=60), st.lists(st.floats(0, 50), min_size=1, max_size=60), st.booleans(),
       st.floats(0, 100))
def test_scores_in_resolutions_are_every_score_times_the_time_unit(dispatches, gaps, declare, later):
    """The free queue adds decay * t to a score: scores in resolutions make its recency count time in
    resolutions (the floor and the unknown sessions' included: unscaled, they outranked scaled anchors)."""
    _, timing, table, _ = _learned_table(dispatches, gaps, declare, later)
    # no gap: the pace of calls tells the time scale, or nothing does
    assert table.time_unit == (table.resolution if timing.gaps else max(timing.pace() or 1.0, ReuseConfig().min_time))
    retired = {"s1"}.__contains__
    for current in (None, lambda session: "b"):
        plain = table.scorer(retired=retired, current=current)
        scaled = table.scorer(retired=retired, current=current, in_resolutions=True)
        groups = [UNTAGGED, Uncached(), *(Anchor(frozenset(a)) for a in ({"a"}, {"a", "b"}, {"z"}))]
        groups += [History(s, frozenset(a)) for s in [*table.sessions, "s1", "new"] for a in ({"a"}, {"b", "c"})]
        for group in groups:
            assert scaled(group) == pytest.approx(plain(group) * table.time_unit, rel=1e-12, abs=1e-12) or \
                scaled(group) == plain(group) == -math.inf


def _learned_table(dispatches, gaps, declare, later):
    learner = TransitionLearner()
    timing = SessionTiming()
    facts = GraphFacts()
    if declare:
        facts.declare_graph(["a", "b", "c"], edges=[("a", "b"), ("b", "c")], conditional_edges=[("c", "a")])
    now = 0.0
    for n, (agent, session, parent, warmup) in enumerate(dispatches):
        now += gaps[n % len(gaps)]
        learner.observe(agent, session=session, parent=parent, warmup=warmup)
        if session is not None and not warmup:
            timing.observe(session, agent, now)
        elif not warmup:
            timing.call_outside_session(now)
    predictor = Predictor(learner, facts)
    chain = predictor.chain()
    table = score_reuse(chain, timing.table(), timing.sessions(), now=now + later, session_start_rate=0.1,
                        continuation={"a": 0.5}, interposed=None, predictability=1.0, gap_count=timing.gaps,
                        config=ReuseConfig(), pace=timing.pace())
    return learner, timing, table, chain


def _over_steps_by_gathering(weights: np.ndarray, table: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The formula ``_over_steps`` replaced (a copy of the table's slice per session): the reference."""
    n = len(table)
    split = len(rows) - n if len(rows) >= n and np.array_equal(rows[len(rows) - n:], np.arange(n)) else len(rows)
    out = np.empty((len(rows), table.shape[2]))
    np.einsum("sk,skn->sn", weights[:, :split].T, table.take(rows[:split], axis=0), out=out[:split])
    if split < len(rows):
        np.einsum("sk,skn->sn", weights[:, split:].T, table, out=out[split:])
    return out


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 7), st.integers(1, 6), st.lists(st.integers(0, 6), max_size=40), st.booleans(),
       st.integers(0, 2**32 - 1), st.booleans())
def test_summing_over_steps_per_chain_row_is_the_gathered_sum(n, steps, drawn, every_agent, seed, grouped):
    """Grouping sessions by chain row (past ``_GATHER_LIMIT``; here forced) changes no bit, and a
    session's value does not depend on which sessions are evaluated with it: a partial evaluation
    (a few sessions, gathered) reproduces a full one exactly."""
    rng = np.random.default_rng(seed)
    rows = np.array([row % n for row in drawn] + (list(range(n)) if every_agent else []), dtype=np.intp)
    table = rng.random((n, steps, n))
    weights = rng.random((steps, len(rows)))
    with mock.patch.object(session_rates, "_GATHER_LIMIT", 0 if grouped else session_rates._GATHER_LIMIT):
        full = _over_steps(weights, table, rows)
    assert full.shape == (len(rows), n)
    assert np.array_equal(full, _over_steps_by_gathering(weights, table, rows))
    for s in range(min(len(rows), 5)):
        assert np.array_equal(_over_steps(weights[:, s:s + 1], table, rows[s:s + 1])[0], full[s])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), sessions, st.sampled_from([None, "", "a", "b", "e"]),
                          st.sampled_from([None, 1, 2]), st.booleans()), max_size=60))
def test_the_sessions_naming_each_agent_slot_are_indexed_exactly(calls):
    """``_naming[i]``: the live sessions whose agent, or whose taught transition's previous agent, is
    slot i, so that recycling a slot visits those alone; after any calls, ends, interposed calls and
    recycled slots (3 agents, 3 sessions), no session names a slot another agent took over, nor does an expired
    one remembered in case it comes back."""
    now = [0.0]
    learner = TransitionLearner(LearnerConfig(max_agents=3, max_sessions=3, session_ttl=30), clock=lambda: now[0])
    last: dict[str, str] = {}
    for agent, session, parent, step, ends in calls:
        now[0] += 7.0
        learner.observe(agent, session=session, parent=parent, step=step)
        if session is not None:
            last[session] = agent
        if ends and session is not None:
            learner.end_session(session)
        states = learner._sessions
        assert all(learner.current_agent(s) == last[s] for s in states)
        for slot, naming in enumerate(learner._naming):
            assert naming == {s for s, state in states.items() if state.index == slot or (
                state.learned is not None and state.learned.previous == slot)}
        expired = learner._expired._entries  # remembered until they return, apart from the live ones
        assert not expired.keys() & states.keys()
        assert all(learner.agents[e.index] == last[s] for s, e in expired.items())
        assert learner._expired._by_slot == {
            slot: {s for s, e in expired.items() if e.index == slot} for slot in {e.index for e in expired.values()}}
    assert len(learner._naming) == len(learner.agents)
