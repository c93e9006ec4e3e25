"""Does learning per replica lose accuracy? Local, merged and global transition models.

Sessions of the paper's six-agent topologies are dispatched to R replicas by a routing
key: per session (``consistent_hash`` on ``X-Session-ID``) or per agent (anchors kept
together). Each replica's TransitionLearner sees only the requests routed to it (with
their parent header, as the server does). The next agent after a dispatch of agent p is
predicted by the replica that served p: that prediction drives its eviction and warm-up.
Reported: online top-1 accuracy (predict, then learn) of local models, of local models
that merge their peers' counts every ``sync_every`` dispatches, and of one model fed all
traffic.

    python -m agentkv.bench.replicas [--replicas 2] [--sessions 200] [--sync-every 20]
"""

from __future__ import annotations

import argparse
import zlib
from collections.abc import Iterator

import numpy as np

from agentkv._arguments import at_least
from agentkv.bench.topologies import AGENTS, TOPOLOGIES, Topology, topology
from agentkv.graph import Predictor, TransitionLearner

__all__ = ["accuracy", "main"]


def _sessions(topo: Topology, sessions: int, length: int, seed: int) -> Iterator[tuple[str, str, str]]:
    """(session, parent, agent) dispatches; sessions interleave round-robin, as concurrent ones do."""
    rng = np.random.default_rng(seed)
    walks = []
    for s in range(sessions):
        current = int(rng.choice(len(AGENTS), p=topo.entry))
        walk = [AGENTS[current]]
        for _ in range(length - 1):
            current = int(rng.choice(len(AGENTS), p=topo.matrix[current]))
            walk.append(AGENTS[current])
        walks.append((f"s{s}", walk))
    for step in range(length):
        for session, walk in walks:
            yield session, "" if step == 0 else walk[step - 1], walk[step]


def _route(key: str, replicas: int) -> int:
    return zlib.crc32(key.encode()) % replicas


def accuracy(name: str, *, replicas: int, key: str, sessions: int, length: int, sync_every: int,
             seed: int) -> dict[str, float]:
    """Online top-1 accuracy of the local, merged and global models on one topology."""
    topo = topology(name)
    local = [TransitionLearner() for _ in range(replicas)]
    merged = [TransitionLearner() for _ in range(replicas)]
    whole = TransitionLearner()
    hits = {"local": 0, "merged": 0, "global": 0}
    served_by: dict[tuple[str, str], int] = {}  # (session, agent) -> replica of its latest dispatch
    total = 0
    for number, (session, parent, agent) in enumerate(_sessions(topo, sessions, length, seed)):
        replica = _route(session if key == "session" else agent, replicas)
        if parent:
            predictor_replica = served_by[(session, parent)]
            total += 1
            for label, models in (("local", local), ("merged", merged), ("global", [whole])):
                model = models[0] if label == "global" else models[predictor_replica]
                guess = Predictor(model).predict(parent)
                hits[label] += guess is not None and guess.agent == agent
        for model in (local[replica], merged[replica], whole):
            model.observe(agent, session=session, parent=parent)
        served_by[(session, agent)] = replica
        if (number + 1) % sync_every == 0:
            exports = [m.export_counts(f"r{i}", "epoch") for i, m in enumerate(merged)]
            for i, model in enumerate(merged):
                for j, export in enumerate(exports):
                    if i != j:
                        model.merge_peer(export)
    return {label: count / total for label, count in hits.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=at_least(int, 1), default=2)
    parser.add_argument("--sessions", type=at_least(int, 1), default=60)
    parser.add_argument("--length", type=at_least(int, 2), default=12, help="dispatches per session")
    parser.add_argument("--sync-every", type=at_least(int, 1), default=20, help="dispatches between merges")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"online top-1 next-agent accuracy, {args.replicas} replicas, {args.sessions} sessions x "
          f"{args.length} dispatches, merge every {args.sync_every} dispatches (seed {args.seed})")
    print("| topology | routing key | local only | local + merged peers | one global model |")
    print("|---|---|---:|---:|---:|")
    for name in TOPOLOGIES:
        for key in ("session", "agent"):
            result = accuracy(name, replicas=args.replicas, key=key, sessions=args.sessions, length=args.length,
                              sync_every=args.sync_every, seed=args.seed)
            print(f"| {name} | {key} | {result['local']:.3f} | {result['merged']:.3f} | {result['global']:.3f} |")


if __name__ == "__main__":
    main()
