"""Property tests: probabilities stay probabilities, survival grows with the horizon."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.graph import GraphFacts, Predictor, SurvivalConfig, SurvivalScorer, TransitionLearner, first_passage_within

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
@given(stochastic_matrices(), st.integers(1, 8))
def test_first_passage_is_a_probability_and_grows_with_k(matrix, k):
    shorter, _ = first_passage_within(matrix, k)
    longer, _ = first_passage_within(matrix, k + 1)
    assert ((shorter >= 0) & (shorter <= 1)).all()
    assert (longer >= shorter - 1e-12).all()
    assert np.allclose(first_passage_within(matrix, 1)[0], matrix)


@settings(max_examples=100, deadline=None)
@given(st.lists(dispatch, max_size=60), st.integers(1, 6), st.sampled_from(["exact", "hops"]), st.booleans())
def test_learned_model_stays_a_probability_model(dispatches, horizon, method, declare):
    learner = TransitionLearner()
    facts = GraphFacts()
    if declare:
        facts.declare_graph(["a", "b", "c"], edges=[("a", "b"), ("b", "c")], conditional_edges=[("c", "a")])
    for agent, session, parent, warmup in dispatches:
        learner.observe(agent, session=session, parent=parent, warmup=warmup)
    predictor = Predictor(learner, facts)
    chain = predictor.chain()
    assert ((chain.matrix >= 0) & (chain.matrix <= 1 + 1e-12)).all()
    assert (chain.matrix.sum(axis=1) <= 1 + 1e-9).all()
    assert 0.0 <= learner.predictability() <= 1.0
    previous = None
    for k in (horizon, horizon + 1):
        table = SurvivalScorer(predictor, SurvivalConfig(horizon=k, method=method, r_min=0)).refresh()
        values = np.array([table.agent(a) for a in learner.agents])
        assert ((values >= 0) & (values <= 1)).all()
        if previous is not None and method == "exact":
            assert (values >= previous - 1e-12).all()
        previous = values
