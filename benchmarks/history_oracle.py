"""How much of the LRU→Belady gap is the history model's: agentkv with oracle history rates.

Replays tapes under ``lru``, ``agentkv``, ``belady`` and ``agentkv`` with the next-use rates of
every live session's history (``session_rates``, what the server computes per session and agent)
replaced by what the tape's future says; anchors, untagged blocks and everything else stay the
runtime's own. Oracles:

* ``full``: the true time to the next request of that session and agent (reuse rate 1/t);
* ``whether``: the model's rate where that agent is called again in the session, 0 where it is not;
* ``session``: the model's rate while the session has another request, 0 after its last;
* ``agent-set``: the model's rates under the chain restricted to the agents the session will ever
  call (its team, in ``teams``), renormalised: which agents, not which visit or when.

A diagnostic of the model, not of a policy anyone can run: the future is not known.

    .venv/bin/python benchmarks/history_oracle.py TAPE CAPACITY [CAPACITY ...] [--oracles full,whether]
"""

from __future__ import annotations

import argparse
import bisect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import agentkv.graph._reuse as reuse_module
from agentkv.bench.plan import TapePlan
from agentkv.bench.policies import AgentKV
from agentkv.bench.replay import replay
from agentkv.bench.simulator import Simulator
from agentkv.bench.tape import read_tape
from agentkv.graph._passage import first_passage_steps
from agentkv.graph._predictor import ChainModel
from agentkv.graph._session_rates import rate_after
from agentkv.graph._timing import LiveSessions

ORACLES = ("full", "whether", "session", "agent-set")
model_rates = reuse_module.session_rates


class _Future:
    """What the tape says of each session's future, read at the replay's next request."""

    def __init__(self, plan: TapePlan) -> None:
        self.arrivals = [r.t for r in plan.requests]
        self.calls: dict[tuple[str, str], list[int]] = {}
        self.last: dict[str, int] = {}
        self.agents: dict[str, set[str]] = {}
        for index, r in enumerate(plan.requests):
            self.calls.setdefault((r.session, r.agent), []).append(index)
            self.last[r.session] = index
            self.agents.setdefault(r.session, set()).add(r.agent)

    def next_call(self, session: str, agent: str, now_index: int) -> int | None:
        calls = self.calls.get((session, agent), ())
        k = bisect.bisect_left(calls, now_index)
        return calls[k] if k < len(calls) else None


def _oracle_rates(oracle: str, future: _Future, sim: Simulator) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    def rates(chain: ChainModel, gaps: Any, live: LiveSessions, chain_rows: list[int], *, resolution: float,
              **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
        model, still = model_rates(chain, gaps, live, chain_rows, resolution=resolution, **kwargs)
        index = sim.next_index
        if index >= len(future.arrivals):
            return model, still
        out = np.zeros_like(model) if oracle in ("full", "whether") else model.copy()
        for s, session in enumerate(live.names):
            if oracle == "session":
                if future.last.get(session, -1) < index:
                    out[s] = 0.0
                continue
            if oracle == "agent-set":
                allowed = np.array([a in future.agents.get(session, ()) for a in chain.agents])
                restricted = chain.matrix * allowed[None, :]
                sums = restricted.sum(axis=1, keepdims=True)
                restricted = np.divide(restricted, sums, out=np.zeros_like(restricted), where=sums > 0) \
                    * chain.matrix.sum(axis=1, keepdims=True)
                passage = first_passage_steps(restricted, len(kwargs["passage"]), tolerance=0.0)
                one, _ = model_rates(ChainModel(chain.agents, restricted, chain.entry, chain.index), gaps,
                                     live.select([s]), [chain_rows[s]], resolution=resolution,
                                     **{**kwargs, "passage": passage})
                out[s] = one[0]
                continue
            for a, agent in enumerate(chain.agents):
                call = future.next_call(session, agent, index)
                if call is None:
                    continue
                if oracle == "whether":
                    out[s, a] = model[s, a]
                else:
                    wait = max(future.arrivals[call] - future.arrivals[index], resolution)
                    out[s, a] = float(rate_after(np.array(wait), resolution))
        return out, still

    return rates


class _OracleAgentKV(AgentKV):
    def __init__(self, oracle: str, future: _Future) -> None:
        super().__init__()
        self.oracle, self.future = oracle, future

    def install(self, sim: Simulator) -> None:
        super().install(sim)
        reuse_module.session_rates = _oracle_rates(self.oracle, self.future, sim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tape")
    parser.add_argument("capacities", type=int, nargs="+")
    parser.add_argument("--oracles", default=",".join(ORACLES), help=f"comma-separated, from {', '.join(ORACLES)}")
    args = parser.parse_args()
    oracles = [o for o in args.oracles.split(",") if o]
    if unknown := set(oracles) - set(ORACLES):
        parser.error(f"unknown oracles: {', '.join(sorted(unknown))}")
    plan = TapePlan(read_tape(args.tape))
    future = _Future(plan)
    print("| tape | capacity | policy | hit % | anchor hit % | history hit % | closed |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for capacity in args.capacities:
        rows: dict[str, dict[str, Any]] = {name: replay(plan, name, capacity).to_json()
                                           for name in ("lru", "belady", "agentkv")}
        for oracle in oracles:
            try:
                rows[f"agentkv, {oracle} oracle"] = replay(plan, _OracleAgentKV(oracle, future), capacity).to_json()
            finally:
                reuse_module.session_rates = model_rates
        lru, belady = rows["lru"]["hit_rate"], rows["belady"]["hit_rate"]
        for name, row in rows.items():
            closed = (row["hit_rate"] - lru) / (belady - lru) if belady > lru else float("nan")
            print(f"| {Path(args.tape).stem} | {capacity} | {name} | {100 * row['hit_rate']:.1f} | "
                  f"{100 * row['anchor_hit_rate']:.1f} | {100 * row['history_hit_rate']:.1f} | {closed:.0%} |")


if __name__ == "__main__":
    main()
