"""Survival scoring against hand-computed closed forms."""

import math

import numpy as np
import pytest

from agentkv.graph import (
    GraphFacts,
    Predictor,
    SurvivalConfig,
    SurvivalScorer,
    TransitionLearner,
    block_score,
    first_passage_within,
    heap_key,
    hop_survival,
)

A, B, C = 0, 1, 2
a, b = 0.3, 0.6
# A -> B with a, A stays with 1-a; B -> C with b, B -> A with 1-b; C -> A always.
CHAIN = np.array([[1 - a, a, 0.0], [1 - b, 0.0, b], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_first_passage_matches_closed_form_on_three_agent_chain(k):
    survival, _ = first_passage_within(CHAIN, k)
    # B from A: leaving A is the only way to B, so 1 - (1 - a)^K.
    assert survival[A, B] == pytest.approx(1 - (1 - a) ** k)
    # C from A: first hit at step 2 (A B C), 3 (A A B C), 4 (A A A B C or A B A B C).
    c_from_a = {1: 0.0, 2: a * b, 3: a * b * (2 - a), 4: a * b * (1 + (1 - a) + (1 - a) ** 2 + a * (1 - b))}
    assert survival[A, C] == pytest.approx(c_from_a[k])
    # A returns to A: stay (1-a), or A B A (a(1-b)), or A B C A (ab): certain by K = 3.
    a_from_a = {1: 1 - a, 2: 1 - a + a * (1 - b), 3: 1.0, 4: 1.0}
    assert survival[A, A] == pytest.approx(a_from_a[k])
    # C -> A is certain, so A is reached from C in one step.
    assert survival[C, A] == pytest.approx(1.0)


def _scorer_for(matrix_counts: dict[tuple[str, str], int], **config) -> tuple[TransitionLearner, SurvivalScorer]:
    learner = TransitionLearner()
    for (src, dst), count in matrix_counts.items():
        for _ in range(count):
            learner.observe(dst, parent=src)
    return learner, SurvivalScorer(Predictor(learner), SurvivalConfig(**config))


def test_aggregate_over_sessions_is_probability_that_any_session_calls_the_agent():
    learner, scorer = _scorer_for({("x", "y"): 30, ("y", "z"): 30, ("z", "x"): 30}, horizon=1, new_sessions=0, r_min=0)
    learner.observe("x", session="s1", parent="")
    learner.observe("z", session="s2", parent="")
    table = scorer.refresh()
    chain = scorer.predictor.chain()
    row_x, row_z = chain.matrix[chain.index["x"]], chain.matrix[chain.index["z"]]
    for agent in "xyz":
        j = chain.index[agent]
        assert table.agent(agent) == pytest.approx(1 - (1 - row_x[j]) * (1 - row_z[j]))
    assert table.agent("unknown") == 0.0


def test_ended_session_no_longer_protects_its_next_agent():
    facts = GraphFacts()
    learner = TransitionLearner()
    for _ in range(50):
        learner.observe("y", parent="x")
        learner.observe("w", parent="v")
    learner.observe("x", session="s1", parent="")
    scorer = SurvivalScorer(Predictor(learner, facts), SurvivalConfig(horizon=1, new_sessions=0, r_min=0))
    assert scorer.refresh().agent("y") > 0.9
    facts.end_session("s1")
    assert scorer.refresh().agent("y") < 0.01


def test_declared_graph_rules_out_unreachable_agents():
    facts = GraphFacts()
    learner = TransitionLearner()
    for _ in range(20):
        learner.observe("c", parent="a")  # learned, but the app says a -> b only
    learner.observe("b", parent="a")
    facts.declare_graph(["a", "b", "c"], edges=[("a", "b"), ("b", "c")])
    predictor = Predictor(learner, facts)
    assert predictor.predict("a").agent == "b"
    assert predictor.next_distribution("a") == {"b": pytest.approx(1.0)}
    learner.observe("a", session="s", parent="")
    table = SurvivalScorer(predictor, SurvivalConfig(horizon=1, new_sessions=0, r_min=0)).refresh()
    assert table.agent("c") == 0.0
    assert table.agent("b") == pytest.approx(1.0)


def test_low_predictability_scores_every_agent_alike():
    _, scorer = _scorer_for({(x, y): 10 for x in "abc" for y in "abc"}, r_min=0.2)
    table = scorer.refresh()
    assert table.predictability < 0.05
    assert not table.predictable
    assert {table.agent(x) for x in "abc"} == {1.0}
    assert table.block(["a", "b"]) == 1.0


def test_shared_block_takes_the_best_agent():
    learner, scorer = _scorer_for({("x", "y"): 40, ("y", "x"): 1, ("z", "x"): 40}, horizon=1, new_sessions=0, r_min=0)
    learner.observe("x", session="s", parent="")
    table = scorer.refresh()
    assert table.block(["y", "z"]) == pytest.approx(table.agent("y"))
    assert table.agent("y") > table.agent("z")


def test_hop_variant_normalises_hop_distance():
    learner, scorer = _scorer_for(
        {("a", "b"): 50, ("b", "c"): 50, ("c", "d"): 50, ("d", "a"): 50}, method="hops", tau=0.5, e_max=4,
        new_sessions=0, r_min=0,
    )
    learner.observe("a", session="s", parent="")
    table = scorer.refresh()
    assert table.as_dict() == pytest.approx({"a": 1.0, "b": 0.75, "c": 0.5, "d": 0.25})


def test_hop_survival_counts_new_sessions_from_entry_agents():
    learner = TransitionLearner()
    for _ in range(10):
        learner.observe("a", session=None, parent="")
        learner.observe("b", parent="a")
    chain = Predictor(learner).chain()
    p = hop_survival(chain, [], tau=0.5, e_max=2, entry=True)
    assert p.tolist() == pytest.approx([0.5, 0.0])


def test_block_score_and_heap_key_order_blocks_alike():
    delta, decay = 0.01, 0.5
    blocks = [(0.9, 10.0), (0.2, 30.0), (0.5, 12.0), (0.05, 31.0)]  # (p, t_free)
    now = 40.0
    by_score = sorted(blocks, key=lambda pb: (pb[0] + delta) * math.exp(-decay * (now - pb[1])))
    by_key = sorted(blocks, key=lambda pb: heap_key(pb[0], pb[1], 16, delta=delta, decay=decay))
    assert by_score == by_key
    assert block_score(0.5, 0.0, 16, delta=0.01, decay=1.0) == pytest.approx(0.51 * 1.01 * 16)
