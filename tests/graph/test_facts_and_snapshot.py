"""GraphFacts events and learned-state snapshots."""

import json
import logging
import os
import stat

import numpy as np
import pytest

from agentkv.graph import (
    END,
    START,
    GraphFacts,
    LearnerConfig,
    SnapshotError,
    TransitionLearner,
    load_snapshot,
    restore_snapshot,
    save_snapshot,
    snapshot_document,
)
from agentkv.protocol import validate_events


def test_graph_facts_from_langgraph_style_declaration():
    facts = GraphFacts()
    facts.declare_graph(
        [START, "supervisor", "coder", END],
        edges=[(START, "supervisor"), ("coder", "supervisor")],
        conditional_edges=[("supervisor", "coder"), ("supervisor", END)],
    )
    assert set(facts.graph.nodes) == {"supervisor", "coder"}
    assert facts.entry == {"supervisor"}
    assert facts.successors("supervisor") == {"coder"}
    assert facts.successors("unknown") is None
    mask = facts.transition_mask(["supervisor", "coder", "newcomer"])
    assert mask.tolist() == [[False, True, True], [True, False, True], [True, True, True]]
    assert facts.entry_mask(["supervisor", "coder", "newcomer"]).tolist() == [True, False, True]


def test_events_are_idempotent_and_lifecycle_is_tracked():
    facts = GraphFacts()
    events = validate_events(
        {
            "version": 1,
            "events": [
                {"type": "graph", "id": "g1", "nodes": ["a", "b"], "edges": [["a", "b"]]},
                {"type": "session_start", "id": "e1", "session": "s1"},
                {"type": "cancel", "id": "e2", "session": "s1"},
            ],
        }
    )
    assert [facts.apply(e) for e in events] == [True, True, True]
    version = facts.version
    assert [facts.apply(e) for e in events] == [False, False, False]
    assert facts.version == version
    assert facts.is_ended("s1") and facts.ended["s1"] == "cancel"
    facts.start_session("s1")  # a session id reused later is live again
    assert not facts.is_ended("s1")


def test_ended_sessions_are_bounded():
    facts = GraphFacts(max_ended=2)
    for s in ("s1", "s2", "s3"):
        facts.end_session(s)
    assert list(facts.ended) == ["s2", "s3"]


def test_the_sessions_whose_end_changed_are_told_once():
    """What the runtime re-scores after session events: each session whose ``is_ended`` changed,
    an ended one that the cap pushes out included, and only those."""
    facts = GraphFacts(max_ended=3)
    facts.start_session("a")  # never ended: nothing changes
    facts.end_session("a")
    facts.end_session("a", cancelled=True)  # ended already
    facts.end_session("b")
    assert facts.take_ended_changes() == {"a", "b"}
    assert facts.take_ended_changes() == set()
    facts.end_session("c")
    facts.end_session("d")  # forgets "a", which is no longer ended
    assert not facts.is_ended("a") and facts.take_ended_changes() == {"a", "c", "d"}
    facts.start_session("b")  # a call revives it
    facts.declare_graph(["x"])
    assert facts.take_ended_changes() == {"b"}
    for n in range(4):  # more changes than the cap while nobody asked: every session may have changed
        facts.end_session(f"s{n}")
    assert facts.take_ended_changes() is None and facts.take_ended_changes() == set()


def _trained() -> tuple[TransitionLearner, GraphFacts]:
    learner = TransitionLearner()
    for agent in ["a", "b", "c"] * 5:
        learner.observe(agent, session="s")
    facts = GraphFacts()
    facts.declare_graph(["a", "b", "c"], edges=[("a", "b")], conditional_edges=[("b", "c")], entry=["a"])
    return learner, facts


def test_snapshot_round_trip(tmp_path):
    learner, facts = _trained()
    path = tmp_path / "state" / "learned.json"
    save_snapshot(path, learner, facts)
    restored, restored_facts = load_snapshot(path)
    assert restored.agents == learner.agents
    np.testing.assert_allclose(restored.counts(), learner.counts())
    np.testing.assert_allclose(restored.entry_counts(), learner.entry_counts())
    assert restored.accuracy == learner.accuracy
    assert restored_facts.export() == facts.export()
    assert [p.name for p in path.parent.iterdir()] == ["learned.json"]  # no temp files left


def test_a_save_keeps_the_files_mode_and_a_symlink_to_it(tmp_path):
    """mkstemp's temp file made every saved snapshot 0600, and the rename replaced a symlink at the
    snapshot's path with a plain file."""
    learner, facts = _trained()
    path = tmp_path / "learned.json"
    umask = os.umask(0o022)
    try:
        save_snapshot(path, learner, facts)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # as open() makes a file under this umask
    path.chmod(0o640)
    link = tmp_path / "current.json"
    link.symlink_to(path)
    save_snapshot(link, learner, facts)
    assert link.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert load_snapshot(link)[0].agents == learner.agents
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current.json", "learned.json"]  # no temp files left
    path.write_text("{not json")  # refused at start: the file it points to is moved aside, the link kept
    assert restore_snapshot(link) is None and link.is_symlink() and not path.exists()
    save_snapshot(link, learner, facts)
    assert link.is_symlink() and load_snapshot(path)[0].agents == learner.agents


def test_a_snapshot_of_nothing_learned_yet_is_restored(tmp_path):
    """A server that learned nothing saves at shutdown all the same; its next start refused that
    file as corrupt, moved it aside and lost the graph it held."""
    _, facts = _trained()
    path = tmp_path / "learned.json"
    save_snapshot(path, TransitionLearner(), facts)
    restored, restored_facts = load_snapshot(path)
    assert restored.agents == [] and restored_facts.export() == facts.export()


_LEARNER = ('{"format": "agentkv.learned-state", "version": 1, "learner": {"agents": %s, "counts": %s, '
            '"entry": %s, "ends": %s, "dispatches": %s}}')


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "cannot read"),
        ('{"format": "something-else", "version": 1}', "not an agentkv snapshot"),
        ('{"format": "agentkv.learned-state", "version": 99}', "version 99"),
        ('{"format": "agentkv.learned-state", "version": 1, "learner": {"agents": ["a"]}}', "corrupt"),
        (
            '{"format": "agentkv.learned-state", "version": 1, "learner": '
            '{"agents": ["a", "b"], "counts": [[0, -1], [0, 0]], "entry": [0, 0], "ends": [0, 0]}}',
            "non-negative",
        ),
        # each of these crashed the server's start, or its first tagged request, or its stats
        (_LEARNER % ('["a"]', "[[0]]", "[0]", "[0]", "Infinity"), "integers"),
        (_LEARNER % ('["a"]', "[[0]]", "[0]", "[0]", "100000000000000000000"), "integers"),
        (_LEARNER % ('["a"]', "[[0]]", "[0]", "[0]", "1" * 5000), "cannot read"),
        (_LEARNER % ("[1]", "[[0]]", "[0]", "[0]", "0"), "must be a string"),
        (_LEARNER % ('["a b"]', "[[0]]", "[0]", "[0]", "0"), "agent"),
        (_LEARNER % ('["a"]', "[[1e300]]", "[1e300]", "[0]", "0"), "total at most"),
        ("[" * 200_000 + "]" * 200_000, "cannot read"),
    ],
)
def test_bad_snapshots_are_refused_with_a_reason(tmp_path, content, reason):
    path = tmp_path / "learned.json"
    path.write_text(content)
    with pytest.raises(SnapshotError, match=reason):
        load_snapshot(path)


def test_a_refused_snapshot_restores_nothing_and_says_why(tmp_path, caplog):
    path = tmp_path / "learned.json"
    path.write_text(json.dumps({"format": "agentkv.learned-state", "version": 0}))
    with caplog.at_level(logging.WARNING, logger="agentkv.graph"):
        assert restore_snapshot(path, LearnerConfig(max_agents=8)) is None  # the server starts fresh
    assert "refusing snapshot" in caplog.text and "version 0" in caplog.text
    [kept] = tmp_path.glob("learned.json.refused-*")  # set aside, not left for the next save to replace
    assert not path.exists() and json.loads(kept.read_text()) == {"format": "agentkv.learned-state", "version": 0}
    assert str(kept) in caplog.text
    assert restore_snapshot(tmp_path / "missing.json") is None


def test_a_snapshot_path_that_is_no_regular_file_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "learned.json"
    os.mkfifo(fifo)  # reading it would block the server's start until someone writes
    with pytest.raises(SnapshotError, match="not a regular file"):
        load_snapshot(fifo)
    link = tmp_path / "state.json"
    link.symlink_to(fifo)
    assert restore_snapshot(link) is None  # refused: the link is moved aside, never what it points to
    assert stat.S_ISFIFO(fifo.stat().st_mode) and not link.is_symlink()


def test_declaring_the_same_graph_again_leaves_the_graph_version():
    """An app declares its graph at every start: the scores built on the graph, and the snapshot,
    were redone for nothing."""
    facts = GraphFacts()
    facts.declare_graph(["a", "b"], [("a", "b")], [("b", "a")], ["a"])
    version, graph_version = facts.version, facts.graph_version
    facts.declare_graph(["b", "a"], [("a", "b")], [("b", "a")], ["a"])
    assert (facts.version, facts.graph_version) == (version + 1, graph_version)
    facts.declare_graph(["a", "b"], [("b", "a")], [], [])  # b -> a becomes static: a change
    assert facts.graph_version == graph_version + 1


def test_snapshot_larger_than_max_agents_is_refused(tmp_path):
    learner, facts = _trained()
    path = tmp_path / "learned.json"
    save_snapshot(path, learner, facts)
    with pytest.raises(SnapshotError, match="max_agents"):
        load_snapshot(path, LearnerConfig(max_agents=2))


def _full_learner() -> TransitionLearner:
    """At max_agents (4): slot 0's agent the busiest and the most recent, "stale" the one seen least
    recently (but with more evidence than "light", which the others' evidence all exceeds)."""
    learner = TransitionLearner(LearnerConfig(max_agents=4))
    for n, agent in enumerate(["busy"] + ["stale"] * 5 + ["light"] + ["mid"] * 2 + ["busy"] * 10):
        learner.observe(agent, session=f"s{n}", parent="")
    assert learner.agents == ["busy", "stale", "light", "mid"]
    return learner


def _restored_then_new_agent(path, document: dict) -> list[str]:
    path.write_text(json.dumps(document))
    state = restore_snapshot(path, LearnerConfig(max_agents=4))
    assert state is not None
    state.learner.observe("newcomer", session="new", parent="")
    return state.learner.agents


def test_a_restored_learner_recycles_the_agent_seen_least_recently_before_the_save(tmp_path):
    """Restored agents were all stamped as seen at dispatch 0, so the first new agent recycled slot 0:
    here the busiest agent, seen last."""
    learner = _full_learner()
    path = tmp_path / "learned.json"
    save_snapshot(path, learner)
    document = json.loads(path.read_text())
    assert _restored_then_new_agent(path, document) == ["busy", "newcomer", "light", "mid"]
    assert document["learner"]["seen"] == [19, 6, 7, 9]  # the dispatch number of each agent's last sighting
    learner.observe("newcomer", session="new", parent="")
    assert learner.agents == ["busy", "newcomer", "light", "mid"]  # as without the restart


def test_a_snapshot_without_sightings_recycles_the_agent_with_the_least_evidence(tmp_path):
    """An older agentkv's snapshot: its agents rank as seen in the order of their evidence."""
    document = snapshot_document(_full_learner())
    del document["learner"]["seen"]
    assert _restored_then_new_agent(tmp_path / "learned.json", document) == ["busy", "stale", "newcomer", "mid"]
    state = restore_snapshot(tmp_path / "learned.json", LearnerConfig(max_agents=4))
    save_snapshot(tmp_path / "again.json", state.learner)  # what it saves again is valid: sightings <= dispatches
    assert json.loads((tmp_path / "again.json").read_text())["learner"]["seen"] == [3, 2, 0, 1]


@pytest.mark.parametrize("seen", [[19, 6, 7], [19, 6, 7, 9, 1], [20, 6, 7, 9], [-1, 6, 7, 9], [19.0, 6, 7, 9],
                                  [True, 6, 7, 9], "19,6,7,9", None])
def test_bad_sightings_are_refused_with_a_reason(tmp_path, seen):
    document = snapshot_document(_full_learner())
    document["learner"]["seen"] = seen
    path = tmp_path / "learned.json"
    path.write_text(json.dumps(document))
    with pytest.raises(SnapshotError, match="seen must be 4 integers in"):
        load_snapshot(path, LearnerConfig(max_agents=4))
