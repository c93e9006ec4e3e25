"""TransitionLearner: counts, lineage, predictability, accuracy, forgetting, bounds."""

import numpy as np
import pytest

from agentkv.bench.topologies import AGENTS, sample_dispatches, stationary, topology
from agentkv.graph import LearnerConfig, Predictor, TransitionLearner


def _counts(learner: TransitionLearner) -> dict[tuple[str, str], float]:
    agents = learner.agents
    matrix = learner.counts()
    return {(agents[i], agents[j]): matrix[i, j] for i, j in zip(*np.nonzero(matrix), strict=True)}


def test_interleaved_sessions_keep_their_own_lineage():
    learner = TransitionLearner()
    for x, y in zip(["a", "b", "c"], ["x", "y", "z"], strict=True):
        learner.observe(x, session="s1")
        learner.observe(y, session="s2")
    assert _counts(learner) == {("a", "b"): 1, ("b", "c"): 1, ("x", "y"): 1, ("y", "z"): 1}
    assert learner.entry_counts().tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert learner.session_agents() == {"s1": "c", "s2": "z"}


def test_explicit_parent_outranks_session_state_and_warmups_teach_nothing():
    learner = TransitionLearner()
    learner.observe("a", session="s")
    assert learner.observe("b", session="s", warmup=True) is None
    learner.observe("c", session="s", parent="b")
    learner.observe("d", session="s", parent="")  # a new lineage in the same session
    assert _counts(learner) == {("b", "c"): 1}
    assert learner.current_agent("s") == "d"


def test_requests_of_one_dispatch_are_learned_once():
    learner = TransitionLearner()
    learner.observe("a", session="s", parent="", step=0)
    for _ in range(3):  # a's tool loop: three requests, one dispatch
        learner.observe("b", session="s", parent="a", step=1)
    learner.observe("b", session="s", parent="b", step=2)  # b dispatched again: a real b -> b
    assert _counts(learner) == {("a", "b"): 1, ("b", "b"): 1}
    assert learner.dispatches == 3


def test_transition_matrix_applies_epsilon_smoothing():
    learner = TransitionLearner(LearnerConfig(epsilon=0.5))
    for _ in range(3):
        learner.observe("b", parent="a")
    learner.observe("a", parent="b")
    matrix = learner.transition_matrix()
    # row a: counts (0, 3) -> (0.5, 3.5) / 4
    assert matrix[0].tolist() == pytest.approx([0.125, 0.875])
    assert matrix.sum(axis=1) == pytest.approx([1.0, 1.0])


def test_predictability_is_one_for_a_deterministic_pipeline():
    learner = TransitionLearner()
    for _ in range(40):
        for agent in AGENTS:
            learner.observe(agent, session="s")
    assert learner.predictability() == pytest.approx(1.0)
    assert learner.recent_accuracy == 1.0


def test_predictability_is_near_zero_for_uniform_random_routing():
    rng = np.random.default_rng(7)
    learner = TransitionLearner()
    for index in rng.integers(0, 6, size=20_000):
        learner.observe(AGENTS[index], session="s")
    assert learner.predictability() < 0.01


def test_selector_like_trace_reaches_076_top1_within_50_dispatches():
    topo = topology("selector")
    assert topo.predictability == pytest.approx(0.57, abs=0.005)
    trace = list(sample_dispatches(topo, 250, seed=3))
    learner = TransitionLearner()
    for agent in trace[:50]:
        learner.observe(agent, session="s")
    # the argmax predictor learned from 50 dispatches, scored exactly under the true chain
    predictor = Predictor(learner)
    pi = stationary(topo.matrix)
    expected = sum(pi[i] * topo.matrix[i, AGENTS.index(predictor.predict(a).agent)] for i, a in enumerate(AGENTS))
    assert expected >= 0.76
    # and online (predict, then update) over the dispatches that follow
    before = (learner._correct, learner._predictions)
    for agent in trace[50:]:
        learner.observe(agent, session="s")
    online = (learner._correct - before[0]) / (learner._predictions - before[1])
    assert online >= 0.76


def test_forgetting_follows_a_drifting_workload():
    config = LearnerConfig(half_life=20)
    learner, stubborn = TransitionLearner(config), TransitionLearner()
    for model in (learner, stubborn):
        for _ in range(300):
            model.observe("b", parent="a")
        for _ in range(60):
            model.observe("c", parent="a")
    assert Predictor(learner).predict("a").agent == "c"
    assert Predictor(stubborn).predict("a").agent == "b"
    assert learner.counts().sum() == pytest.approx(sum(0.5 ** (k / 20) for k in range(360)), rel=1e-9)


def test_forgetting_survives_rescaling():
    learner = TransitionLearner(LearnerConfig(half_life=0.01))  # weight overflows fast
    for _ in range(30):
        learner.observe("b", parent="a")
    assert np.isfinite(learner.counts()).all()
    assert learner.counts()[0, 1] == pytest.approx(1.0)


def test_agent_table_is_bounded_and_drops_the_least_recently_seen():
    learner = TransitionLearner(LearnerConfig(max_agents=4))
    for agent in "abcd":
        learner.observe(agent, session="s")
    learner.observe("a", session="t")  # a is fresh again; b is now the stalest
    learner.observe("e", session="u")
    assert sorted(learner.agents) == ["a", "c", "d", "e"]
    assert ("a", "b") not in _counts(learner)
    assert learner.transition_matrix().shape == (4, 4)


def test_session_ends_make_rows_substochastic():
    learner = TransitionLearner(LearnerConfig(epsilon=0.5))
    for s in ("s1", "s2", "s3"):
        learner.observe("a", session=s)
        learner.observe("b", session=s)
        learner.end_session(s)
    learner.end_session("never-seen")
    assert learner.end_counts().tolist() == [0.0, 3.0]
    matrix = learner.transition_matrix()
    assert matrix[0].tolist() == pytest.approx([0.5 / 4, 3.5 / 4])
    assert matrix[1].tolist() == pytest.approx([0.5 / 4, 0.5 / 4])  # (0 + eps) / (0 + 2 eps + 3 ends)
    assert learner.session_agents() == {}


def test_sessions_expire_when_idle_and_are_capped():
    now = [0.0]
    learner = TransitionLearner(LearnerConfig(session_ttl=10, max_sessions=3), clock=lambda: now[0])
    learner.observe("a", session="old")
    now[0] = 11.0
    learner.observe("a", session="new")
    assert learner.session_agents() == {"new": "a"}
    assert learner.end_counts().tolist() == [1.0]  # idle past the TTL counts as an end
    for s in ("s1", "s2", "s3"):
        learner.observe("a", session=s)
    assert list(learner.session_agents()) == ["s1", "s2", "s3"]


def test_accuracy_is_none_before_any_prediction():
    learner = TransitionLearner()
    learner.observe("a", session="s")
    assert learner.accuracy is None and learner.recent_accuracy is None


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        LearnerConfig(epsilon=0)
    with pytest.raises(ValueError):
        LearnerConfig(half_life=-1)
    with pytest.raises(ValueError):
        LearnerConfig(max_agents=1)
