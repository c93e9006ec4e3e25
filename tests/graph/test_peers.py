"""Merging transition counts across replicas: versioned, idempotent, no echo."""

import json

import numpy as np
import pytest

from agentkv.bench.topologies import sample_dispatches, topology
from agentkv.graph import PeerExport, TransitionLearner


def _as_dict(learner: TransitionLearner) -> dict[tuple[str, str], float]:
    agents, counts = learner.agents, learner.counts()
    return {(agents[i], agents[j]): counts[i, j] for i, j in zip(*np.nonzero(counts), strict=True)}


def _split_trace():
    trace = list(sample_dispatches(topology("selector"), 400, seed=5))
    whole, left, right = TransitionLearner(), TransitionLearner(), TransitionLearner()
    for number, agent in enumerate(trace):
        session = f"s{number // 20}"  # sessions of 20 dispatches, alternating between two replicas
        whole.observe(agent, session=session)
        (left if (number // 20) % 2 == 0 else right).observe(agent, session=session)
    return whole, left, right


def test_merged_replicas_equal_one_model_fed_all_traffic():
    whole, left, right = _split_trace()
    assert left.merge_peer(PeerExport.from_json(json.loads(json.dumps(right.export_counts("r", "e1").to_json()))))
    merged, expected = _as_dict(left), _as_dict(whole)
    assert merged.keys() == expected.keys()
    assert all(merged[k] == pytest.approx(expected[k]) for k in expected)
    assert left.predictability() == pytest.approx(whole.predictability())


def test_merge_is_idempotent_and_ignores_stale_exports():
    _, left, right = _split_trace()
    old = right.export_counts("r", "e1")
    right.observe("coder", session="late")
    new = right.export_counts("r", "e1")
    assert left.merge_peer(new)
    snapshot = _as_dict(left)
    assert not left.merge_peer(new)  # a replay
    assert not left.merge_peer(old)  # older sequence of the same epoch
    assert _as_dict(left) == snapshot
    restarted = TransitionLearner().export_counts("r", "e2")  # the peer restarted: new epoch wins
    assert left.merge_peer(restarted)
    assert left.peers.replicas() == {"r": 0}


def test_exports_carry_own_counts_only():
    _, left, right = _split_trace()
    own_right = _as_dict(right)
    right.merge_peer(left.export_counts("l", "e"))
    left.merge_peer(right.export_counts("r", "e"))  # right's export must not echo left's counts back
    echo_free = TransitionLearner()
    echo_free.merge_peer(right.export_counts("r", "e"))
    assert _as_dict(echo_free) == pytest.approx(own_right)


@pytest.mark.parametrize(
    "document",
    [
        {"format": "other"},
        {"format": "agentkv.transition-counts", "version": 1, "replica": "r", "epoch": "e", "sequence": 1,
         "agents": ["a", "a"], "counts": [[0, 0], [0, 0]], "entry": [0, 0], "ends": [0, 0]},
        {"format": "agentkv.transition-counts", "version": 1, "replica": "r", "epoch": "e", "sequence": 1,
         "agents": ["a"], "counts": [[-1]], "entry": [0], "ends": [0]},
        {"format": "agentkv.transition-counts", "version": 1, "replica": "r", "epoch": "e", "sequence": 1,
         "agents": ["a", "b"], "counts": [[1]], "entry": [0], "ends": [0]},
    ],
)
def test_bad_exports_are_refused(document):
    with pytest.raises(ValueError):
        PeerExport.from_json(document)


def test_all_peers_together_are_scaled_to_the_bound_keeping_their_shares():
    from agentkv.graph import PEER_WEIGHT_FLOOR
    from agentkv.graph._peers import PeerCounts

    def export(replica: str, counts: list[list[float]]) -> PeerExport:
        return PeerExport(replica, "e", 1, ("a", "b"), np.array(counts), np.zeros(2), np.zeros(2), np.zeros(2))

    peers = PeerCounts(peer_weight=2.0)
    assert peers.merge(export("r1", [[0.0, 300.0], [0.0, 0.0]]))
    assert peers.merge(export("r2", [[0.0, 0.0], [100.0, 0.0]]))
    counts = peers.aligned(["a", "b"], own_weight=150.0)[0]  # 2 x 150 for both together, their shares (3:1) kept
    assert counts.tolist() == [pytest.approx([0.0, 225.0]), pytest.approx([75.0, 0.0])]
    assert peers.aligned(["a", "b"], own_weight=0.0)[0].sum() == pytest.approx(2.0 * PEER_WEIGHT_FLOOR)
    assert peers.aligned(["a", "b"], own_weight=1000.0)[0].tolist() == [[0.0, 300.0], [100.0, 0.0]]  # as sent
    assert PeerCounts().peer_weight == float("inf")  # a learner alone merges its peers unscaled
