"""Clients that misuse the tags, replayed beside LRU, agentkv and Belady (docs/benchmarks.md "Other shapes").

Two replay policies that rewrite what `agentkv` sends: `one-session` tags every request with the session
id "default" and no parent or step (a client that fixed one id for all its conversations);
`unique-agents` names each agent per session (`coder-<session>`: a framework naming agent instances).
Pool capacities 2x and 3x the largest request.

    python benchmarks/tag_misuse.py TAPE...
"""

from __future__ import annotations

import sys
from typing import Any

from agentkv.bench.plan import TapePlan
from agentkv.bench.policies import AgentKV
from agentkv.bench.replay import replay
from agentkv.bench.tape.format import read_tape
from agentkv.protocol import AgentTag


class OneSession(AgentKV):
    """Every request tagged session "default", without parent or step."""

    name = "agentkv-one-session"

    def on_arrival(self, sim: Any, request: Any, record: Any) -> None:
        request.sampling_params.extra_args = AgentTag(record.agent, "default").to_xargs()
        super().on_arrival(sim, request, record)

    def on_finish(self, sim: Any, request: Any, record: Any) -> None:
        self.runtime.answered("default", sim.plan.is_tool_call(record))


class UniqueAgents(AgentKV):
    """Agent names carry their session (``coder-<session>``), parents too."""

    name = "agentkv-unique-agents"

    def on_arrival(self, sim: Any, request: Any, record: Any) -> None:
        parent = record.parent and f"{record.parent}-{record.session}"  # None and "" stay as they are
        request.sampling_params.extra_args = AgentTag(f"{record.agent}-{record.session}", record.session, parent,
                                                      record.step).to_xargs()
        super().on_arrival(sim, request, record)


def main(paths: list[str]) -> None:
    for path in paths:
        plan = TapePlan(read_tape(path))
        for multiplier in (2, 3):
            blocks = multiplier * plan.max_request_blocks + 1
            results = {name: replay(plan, policy, blocks) for name, policy in (
                ("lru", "lru"), ("agentkv", "agentkv"), ("one-session", OneSession()),
                ("unique-agents", UniqueAgents()), ("belady", "belady"))}
            hit = {name: round(r.hit_rate * 100, 1) for name, r in results.items()}
            history = {name: round(r.history_hit_rate * 100, 1) for name, r in results.items()}
            print(path.rsplit("/", 1)[-1], blocks, "hit", hit, "history", history, flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
