"""How much of each policy's hit rate lies within the agents' anchors, and how much beyond them.

Replays a tape under ``lru``, ``agentkv`` and ``belady`` at one capacity and splits every
request's hit tokens at its agent's anchor: the number of leading blocks that two calls of the
agent from different sessions most often share (the mode over consecutive pairs, so that two
sessions that happen to open alike do not stretch it). Hits within the anchor are what keeping
anchors gives; hits beyond it come from a session's own history or from another session whose
prompt went on alike (the same task, a verbatim repeat).

Made for the demo's request trace turned into a tape:

    .venv/bin/python -m agentkv bench bound .build/demo/agentkv-trace.jsonl --skip-sessions warmup- --tape T.jsonl
    .venv/bin/python benchmarks/anchor_split.py T.jsonl 181
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path

import agentkv.bench.replay as replay_module
from agentkv.bench.plan import TapePlan
from agentkv.bench.policies import make_policy
from agentkv.bench.tape.format import Tape, read_tape

POLICIES = ("lru", "agentkv", "belady")


def anchor_tokens(plan: TapePlan) -> dict[str, int]:
    """Per agent, the anchor in tokens: the most common leading run of segments two consecutive
    calls from different sessions share (a tape from a trace has one segment per block)."""
    last: dict[str, tuple[str, list[str]]] = {}
    shared: dict[str, Counter[int]] = defaultdict(Counter)
    sizes: dict[str, list[int]] = {}
    for request in plan.requests:
        keys = [key for key, _ in request.segments]
        previous = last.get(request.agent)
        if previous is not None and previous[0] != request.session:
            common = 0
            for mine, theirs in zip(keys, previous[1], strict=False):
                if mine != theirs:
                    break
                common += 1
            shared[request.agent][common] += 1
        if previous is None or previous[0] != request.session:
            last[request.agent] = (request.session, keys)
            sizes[request.agent] = [n for _, n in request.segments]
    return {agent: sum(sizes[agent][: counts.most_common(1)[0][0]]) for agent, counts in shared.items()}


def hits_per_request(tape: Tape, policy: str, capacity: int) -> dict[int, int]:
    """Hit tokens of every request the replay started, by tape index."""
    hits: dict[int, int] = {}
    start = replay_module.Replay._start

    def counted(self: replay_module.Replay, index: int) -> bool:
        before = self.result.hit_tokens
        started = start(self, index)
        if started:
            hits[index] = self.result.hit_tokens - before
        return started

    replay_module.Replay._start = counted  # type: ignore[method-assign]
    try:
        replay_module.Replay(TapePlan(tape), make_policy(policy), capacity).run()
    finally:
        replay_module.Replay._start = start  # type: ignore[method-assign]
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tape", type=Path)
    parser.add_argument("capacity", type=int, help="KV cache size in blocks")
    args = parser.parse_args()
    tape = read_tape(args.tape)
    plan = TapePlan(tape)
    anchors = anchor_tokens(plan)
    total = sum(sum(n for _, n in request.segments) for request in plan.requests)
    print("anchors (tokens): " + ", ".join(f"{agent} {tokens}" for agent, tokens in sorted(anchors.items())))
    for policy in POLICIES:
        hits = hits_per_request(tape, policy, args.capacity)
        within = sum(min(hit, anchors.get(plan.requests[i].agent, 0)) for i, hit in hits.items())
        beyond = sum(hits.values()) - within
        print(f"{policy:8s} hit {100 * (within + beyond) / total:5.1f}% of prompt tokens: within the anchors "
              f"{100 * within / total:5.1f}%, beyond them {100 * beyond / total:5.1f}%")


if __name__ == "__main__":
    main()
