"""What a session end at every chat turn costs: ``agentkv`` with and without it, beside LRU and Belady.

A LangGraph chat runs one invoke per user message on a checkpointed thread. Before session 10 the
adapter posted ``session_end`` at every invoke's end, which retires the conversation (evicted
first) until the next message revives it. This replays a tape as ``agentkv`` and as ``agentkv``
told ``session_end`` after every request followed by at least ``--turn-gap`` seconds (the answer
went back to the user), e.g. the held-out ``think-time`` tapes (benchmarks/holdout_tapes.py).

    .venv/bin/python benchmarks/chat_session_ends.py TAPE CAPACITY [CAPACITY ...] [--turn-gap 10]
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm.v1.request import Request

from agentkv.bench.plan import TapePlan
from agentkv.bench.policies import AgentKV
from agentkv.bench.replay import replay
from agentkv.bench.simulator import Simulator
from agentkv.bench.tape import TapeRequest, read_tape


class EndEveryTurn(AgentKV):
    """``agentkv`` told ``session_end`` whenever a request's answer goes back to the user."""

    def __init__(self, turn_gap: float) -> None:
        super().__init__()
        self.turn_gap = turn_gap

    def on_finish(self, sim: Simulator, request: Request, record: TapeRequest) -> None:
        super().on_finish(sim, request, record)
        if record.tool_gap >= self.turn_gap:
            self.runtime.apply_events({"version": 1, "events": [
                {"type": "session_end", "id": f"end-{record.id}", "session": record.session}]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tape")
    parser.add_argument("capacities", type=int, nargs="+")
    parser.add_argument("--turn-gap", type=float, default=10.0, help="least tool_gap (s) that ends a chat turn")
    args = parser.parse_args()
    plan = TapePlan(read_tape(args.tape))
    print("| capacity | policy | hit % | history hit % |")
    print("|---:|---|---:|---:|")
    for capacity in args.capacities:
        rows: dict[str, Any] = {name: replay(plan, name, capacity).to_json() for name in ("lru", "agentkv", "belady")}
        rows["agentkv, session_end every turn"] = replay(plan, EndEveryTurn(args.turn_gap), capacity).to_json()
        for name, row in rows.items():
            print(f"| {capacity} | {name} | {100 * row['hit_rate']:.1f} | {100 * row['history_hit_rate']:.1f} |")


if __name__ == "__main__":
    main()
