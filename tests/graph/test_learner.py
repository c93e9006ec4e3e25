"""TransitionLearner: counts, lineage, predictability, accuracy, forgetting, bounds."""

import json

import numpy as np
import pytest

from agentkv.bench.topologies import AGENTS, sample_dispatches, stationary, topology
from agentkv.graph import LearnerConfig, PeerExport, Predictor, TransitionLearner, load_snapshot, save_snapshot
from agentkv.graph._expired import MAX_EXPIRED


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


# (half-life, calls while s is away, tolerance): at 3.0 the counts are rescaled once while s is away; at
# 0.01 every five calls, and an end counted 2 ** 200 times heavier rounds the real one at b away (the clamp)
@pytest.mark.parametrize(("half_life", "calls", "tolerance"), [(None, 10, 0.0), (3.0, 1600, 0.0), (0.01, 10, 1e-12)])
def test_a_session_back_after_the_ttl_continues_its_lineage_and_its_end_is_taken_back(half_life, calls, tolerance):
    def run(ttl: float) -> tuple[TransitionLearner, float]:
        now = [0.0]
        learner = TransitionLearner(LearnerConfig(session_ttl=ttl, half_life=half_life), clock=lambda: now[0])
        for agent in ("a", "b"):
            learner.observe(agent, session="done")
        learner.end_session("done")  # b ended a session for real
        learner.observe("a", session="s")
        learner.observe("b", session="s")
        now[0] = 100.0
        for _ in range(calls):  # the first call expires s (a human in the loop, a long batch tool)
            learner.observe("x", session="other")
        away = learner.end_counts()[1]
        learner.observe("c", session="s")  # parent None: after the session's last agent, b
        return learner, away

    (slow, away), (never_idle, away_never_idle) = run(ttl=10.0), run(ttl=1000.0)
    assert away > away_never_idle  # the expiry counted an end at b ...
    assert _counts(slow)[("b", "c")] > 0 and slow.entry_counts()[slow.agents.index("c")] == 0
    for read in ("counts", "entry_counts", "end_counts"):  # ... taken back exactly when s came back
        assert getattr(slow, read)() == pytest.approx(getattr(never_idle, read)(), rel=1e-9, abs=tolerance)
    assert slow.accuracy == never_idle.accuracy and slow.session_agents() == never_idle.session_agents()


@pytest.mark.parametrize("expired_first", [False, True])
def test_an_explicit_end_stays_final_and_a_first_dispatch_starts_anew(expired_first):
    now = [0.0]
    learner = TransitionLearner(LearnerConfig(session_ttl=10), clock=lambda: now[0])
    for session in ("s", "t"):
        learner.observe("a", session=session)
        learner.observe("b", session=session)
    if expired_first:
        now[0] = 100.0
        learner.observe("x", session="other")  # expires s and t
    learner.end_session("s")  # a session_end event (it confirms an expiry: no second end)
    version = learner.version
    now[0] = 200.0
    learner.observe("c", session="s")
    learner.observe("c", session="t", parent="")  # a first dispatch: t, expired, did end
    assert learner.version > version
    assert ("b", "c") not in _counts(learner)
    agents = learner.agents
    assert learner.entry_counts()[agents.index("c")] == 2.0
    assert learner.end_counts()[agents.index("b")] == 2.0


def test_the_expired_sessions_remembered_are_bounded():
    now = [0.0]
    learner = TransitionLearner(LearnerConfig(session_ttl=10), clock=lambda: now[0])
    for i in range(MAX_EXPIRED + 1):
        learner.observe("a", session=f"s{i}")
    now[0] = 100.0
    learner.observe("b", session="other")  # expires all of them; s0, the first, is forgotten
    learner.observe("b", session="s0")
    learner.observe("b", session="s1")
    assert _counts(learner) == {("a", "b"): 1.0}
    assert learner.entry_counts().tolist() == [MAX_EXPIRED + 1, 2.0]
    assert learner.end_counts().tolist() == [MAX_EXPIRED, 0.0]


def test_an_expired_session_whose_agent_slot_was_recycled_starts_anew():
    now = [0.0]
    learner = TransitionLearner(LearnerConfig(session_ttl=10, max_agents=2), clock=lambda: now[0])
    learner.observe("a", session="s")
    now[0] = 100.0
    learner.observe("b", session="other")  # expires s
    learner.observe("c", session="t")  # takes a's slot, and its end count
    learner.observe("c", session="s")  # s's last agent is gone: not c -> c
    assert _counts(learner) == {}
    assert learner.entry_counts().tolist() == [2.0, 1.0] and learner.end_counts().tolist() == [0.0, 0.0]


def test_accuracy_is_none_before_any_prediction():
    learner = TransitionLearner()
    learner.observe("a", session="s")
    assert learner.accuracy is None and learner.recent_accuracy is None


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        LearnerConfig(epsilon=0)
    with pytest.raises(ValueError):
        LearnerConfig(half_life=-1)
    with pytest.raises(ValueError, match=r"0\.01"):  # 2 ** (-1 / 1e-4) is 0.0: the first call divided by zero
        LearnerConfig(half_life=1e-4)
    with pytest.raises(ValueError):
        LearnerConfig(max_agents=1)


# -- interposed calls (an AutoGen selector between speaker turns) ----------------------

SPEAKERS = [("planner", 1), ("coder", 2), ("reviewer", 3), ("coder", 4), ("reviewer", 5)]


def _selector_run(learner: TransitionLearner, session: str = "s", *, selector: bool = True) -> None:
    """Speakers each name the previous speaker; a selector call (parent: last speaker, its step) precedes each turn."""
    previous = ""
    for speaker, step in SPEAKERS:
        if selector and previous:
            learner.observe("selector", session=session, parent=previous, step=step - 1)
        learner.observe(speaker, session=session, parent=previous, step=step)
        previous = speaker


def test_interposed_selector_is_taken_out_of_the_chain_exactly():
    learner, speakers_only = TransitionLearner(), TransitionLearner()
    _selector_run(learner)
    _selector_run(speakers_only, selector=False)
    assert _counts(learner) == {("planner", "coder"): 1, ("coder", "reviewer"): 2, ("reviewer", "coder"): 1}
    assert _counts(learner) == _counts(speakers_only)
    rate = dict(zip(learner.agents, learner.interposed_rate().tolist(), strict=True))
    assert rate == {"planner": 0.0, "selector": 1.0, "coder": 0.0, "reviewer": 0.0}
    assert learner.interposed_counts().tolist() == [0.0, 4.0, 0.0, 0.0]
    # the selector call predicted (and missed) after coder is not scored: 1 hit in 4 speaker predictions
    assert (learner._correct, learner._predictions) == (1, 4) == (speakers_only._correct, speakers_only._predictions)
    assert learner.recent_accuracy == 0.25
    assert learner.predictability() == speakers_only.predictability() == 1.0  # each speaker has one successor
    assert Predictor(learner).predict("coder").agent == "reviewer"
    assert learner.current_agent("s") == "reviewer" and learner.dispatches == 9
    best = {a: None if b < 0 else learner.agents[b] for a, b in zip(learner.agents, learner._best, strict=True)}
    assert best == {"planner": "coder", "selector": None, "coder": "reviewer", "reviewer": "coder"}


def test_plain_dispatches_with_explicit_parents_learn_as_without_them():
    explicit, derived = TransitionLearner(), TransitionLearner()
    _selector_run(explicit, selector=False)
    for speaker, step in SPEAKERS:
        derived.observe(speaker, session="s", step=step)
    assert _counts(explicit) == _counts(derived)
    assert explicit.interposed_counts().tolist() == [0.0, 0.0, 0.0]
    assert (explicit._correct, explicit._predictions) == (derived._correct, derived._predictions)


def test_interposed_counts_decay_like_the_transitions_they_sat_in():
    config = LearnerConfig(half_life=2)  # every learned call, interposed ones too, ages the counts
    learner = TransitionLearner(config)
    learner.observe("a", session="s", parent="", step=1)  # call 1
    learner.observe("x", session="s", parent="a", step=1)  # call 2, interposed
    learner.observe("b", session="s", parent="a", step=2)  # call 3
    learner.observe("x", session="s", parent="b", step=2)  # call 4, interposed
    learner.observe("a", session="s", parent="b", step=3)  # call 5
    # a count learned at call k weighs 0.5 ** ((5 - k) / 2) after call 5
    assert _counts(learner) == {("a", "b"): pytest.approx(0.5), ("b", "a"): pytest.approx(1.0)}
    assert learner.entry_counts().tolist() == pytest.approx([0.25, 0.0, 0.0])
    assert learner.interposed_counts().tolist() == pytest.approx([0.0, 1.5, 0.0])  # calls 3 and 5
    assert learner.interposed_rate().tolist() == pytest.approx([0.0, 1.0, 0.0])
    assert (learner._correct, learner._predictions) == (0, 2)


def test_taking_back_is_exact_across_rescaling_and_other_sessions():
    learner = TransitionLearner(LearnerConfig(half_life=0.01))  # the weight is rescaled every few calls
    learner.observe("a", session="s", parent="")
    learner.observe("x", session="s", parent="a")
    for _ in range(10):  # another session's calls age (and rescale) the counts meanwhile
        learner.observe("c", session="t", parent="")
    learner.observe("b", session="s", parent="a")
    assert learner.counts()[0, 1] == 0.0  # a -> x taken back exactly
    assert _counts(learner) == {("a", "b"): pytest.approx(1.0)}
    assert learner.interposed_counts().tolist() == pytest.approx([0.0, 1.0, 0.0, 0.0])


def test_taking_back_restores_the_rows_best_and_the_recent_window():
    learner = TransitionLearner(LearnerConfig(accuracy_window=3))
    for session, second in (("s1", "x"), ("s2", "b"), ("s3", "b"), ("s4", "x"), ("s5", "x")):
        learner.observe("a", session=session, parent="")
        learner.observe(second, session=session, parent="a")
    assert Predictor(learner).predict("a").agent == "x"  # 3 to 2, for a moment ...
    assert list(learner._recent) == [(6, False), (8, False), (10, False)]
    learner.observe("c", session="s5", parent="a")  # ... until s5's x is found interposed
    assert _counts(learner) == {("a", "x"): 2, ("a", "b"): 2, ("a", "c"): 1}
    assert learner._best[0] == learner.agents.index("b")  # b overtook x before s5, as if s5's x never ran
    assert list(learner._recent) == [(6, False), (8, False), (11, False)]  # x's prediction (10) left the window
    assert (learner._correct, learner._predictions) == (0, 5)


def test_repeated_interposed_calls_each_count():
    learner = TransitionLearner()
    learner.observe("a", session="s", parent="")
    learner.observe("x", session="s", parent="a")
    learner.observe("x", session="s", parent="a")  # the selector asked again (no step: each request counts)
    learner.observe("b", session="s", parent="a")
    assert _counts(learner) == {("a", "b"): 1}
    assert learner.interposed_counts().tolist() == [0.0, 2.0, 0.0]
    assert learner.interposed_rate().tolist() == [0.0, 2.0, 0.0]


def test_siblings_of_one_step_and_unrelated_parents_are_not_interposed():
    learner = TransitionLearner()
    learner.observe("plan", session="s", parent="", step=1)
    learner.observe("left", session="s", parent="plan", step=2)  # parallel branches of one superstep
    learner.observe("right", session="s", parent="plan", step=2)
    learner.observe("worker", session="s", parent="left", step=3)  # right's call came from plan, not left
    learner.observe("solo", session="s", parent="")
    learner.observe("d", session="s", parent="worker")  # solo's call was an entry: nothing to take back
    assert _counts(learner) == {("plan", "left"): 1, ("plan", "right"): 1, ("left", "worker"): 1, ("worker", "d"): 1}
    assert learner.interposed_counts().sum() == 0.0


def test_interposed_counts_survive_export_import_and_merge_with_peers(tmp_path):
    learner = TransitionLearner()
    _selector_run(learner)
    save_snapshot(tmp_path / "state.json", learner)
    assert load_snapshot(tmp_path / "state.json")[0].interposed_counts().tolist() == [0.0, 4.0, 0.0, 0.0]
    state = json.loads(json.dumps(learner.export_state()))
    assert state["interposed"] == [0.0, 4.0, 0.0, 0.0]
    restored = TransitionLearner()
    restored.import_state(state)
    assert restored.interposed_counts().tolist() == [0.0, 4.0, 0.0, 0.0]
    assert restored.interposed_rate().tolist() == learner.interposed_rate().tolist()
    del state["interposed"]  # written before interposed calls were learned
    older = TransitionLearner()
    older.import_state(state)
    assert older.interposed_counts().tolist() == [0.0, 0.0, 0.0, 0.0]
    state["interposed"] = [0.0, -1.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        older.import_state(state)

    other = TransitionLearner()
    _selector_run(other, "t")
    document = json.loads(json.dumps(other.export_counts("r", "e").to_json()))
    assert learner.merge_peer(PeerExport.from_json(document))
    assert learner.interposed_counts().tolist() == [0.0, 8.0, 0.0, 0.0]
    assert learner.interposed_rate().tolist() == [0.0, 1.0, 0.0, 0.0]
    del document["interposed"], document["sequence"]
    document["sequence"] = 99  # an older replica's document, without interposed counts
    assert learner.merge_peer(PeerExport.from_json(document))
    assert learner.interposed_counts().tolist() == [0.0, 4.0, 0.0, 0.0]


def test_a_peers_agents_take_free_slots_only_never_a_local_agents():
    """A peer's agents each take a free slot of their own (interning them one after the other used
    to give every one the same slot); once the table is full, the rest take none: a merge used to
    evict the agents this replica serves (one peer of 256 names emptied it)."""
    learner = TransitionLearner(LearnerConfig(max_agents=8), clock=lambda: 0.0)
    for i in range(6):
        learner.observe(f"local{i}", session=f"s{i}", parent="", now=0.0)
    peers = tuple(f"peer{i}" for i in range(4))
    counts = np.ones((4, 4))
    assert learner.merge_peer(PeerExport("r2", "e1", 1, peers, counts, np.ones(4), np.zeros(4), np.zeros(4)))
    assert learner.agents == [*(f"local{i}" for i in range(6)), "peer0", "peer1"]
    assert learner.counts().sum() == pytest.approx(4.0)  # the peer's counts among the agents known here


def test_an_agent_with_nothing_learned_is_not_exported():
    # a name in a slot with no counts would come back from every peer as new, again and again
    learner = TransitionLearner(LearnerConfig(max_agents=8), clock=lambda: 0.0)
    learner.observe("a", session="s", parent="", now=0.0)
    learner.observe("b", session="s", now=0.0)
    peer = PeerExport("r2", "e1", 1, ("z",), np.zeros((1, 1)), np.zeros(1), np.zeros(1), np.zeros(1))
    assert learner.merge_peer(peer) and "z" in learner.agents
    assert learner.export_counts("r1", "e1").agents == ("a", "b")


def test_replicas_merging_each_other_see_nothing_new_without_traffic():
    # each merge changed the exporting version: A and B merged each other at every pull, for ever
    a, b = (TransitionLearner(LearnerConfig(max_agents=8), clock=lambda: 0.0) for _ in range(2))
    a.observe("p", session="s", parent="", now=0.0)
    a.observe("q", session="s", now=0.0)
    b.observe("q", session="t", parent="", now=0.0)
    b.observe("p", session="t", now=0.0)
    merged = []
    for _ in range(3):
        merged.append((b.merge_peer(a.export_counts("a", "e")), a.merge_peer(b.export_counts("b", "e"))))
    assert merged == [(True, True), (False, False), (False, False)]
    a.observe("p", session="s2", parent="", now=0.0)  # new traffic: new counts to share
    assert b.merge_peer(a.export_counts("a", "e"))
