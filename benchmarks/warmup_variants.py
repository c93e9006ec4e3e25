"""What other warm-up gates would buy: hit rate against the prompt tokens computed, in the replay.

Runs ``agentkv bench replay`` on TAPES with ``lru``, ``agentkv+warmup`` (the shipped gate:
the most likely next agent, no probability floor), ``belady`` and these variants of it:

* ``floor-P``: the shipped gate with ``WarmupPolicy(min_probability=P/100)``;
* ``second-P``: the shipped warm-up, plus one of the second most likely next agent when its
  P(next) >= P/100 (through the same gate, rate limit included).

then prints, per policy, the mean share of the LRU→Belady gap closed (token hit rate, every
capacity replayed) and, summed over every replay, the prompt tokens computed in the foreground
(what a user waits for), by warm-ups (in the background), and the warm-ups' useful share. A hit
rate bought with warm-ups is not free: they take engine time and cache room when they miss.

    .venv/bin/python benchmarks/warmup_variants.py TAPE [TAPE ...] [--variants floor-30,second-10]
        [--out .build/warmup-variants] [replay flags, e.g. --no-preflight --jobs 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from agentkv.__main__ import main as agentkv_main
from agentkv.bench import policies
from agentkv.bench.policies import AgentKV
from agentkv.bench.simulator import Simulator
from agentkv.graph import Prediction
from agentkv.warmup import WarmupPolicy


class SecondCandidate(AgentKV):
    """``agentkv+warmup`` that also warms the second most likely next agent when P >= ``floor``."""

    def __init__(self, floor: float) -> None:
        super().__init__(facts=True, warmup=True)
        self.floor = floor

    def _warm(self, sim: Simulator, agent: str) -> str:
        reason = super()._warm(sim, agent)
        ranked = sorted(self.runtime.predictor.next_distribution(agent).items(), key=lambda item: -item[1])
        if len(ranked) > 1 and ranked[1][1] >= self.floor:
            self._warm_to(sim, agent, Prediction(*ranked[1]))
        return reason


def _variant(name: str) -> policies.Policy:
    kind, _, percent = name.partition("-")
    floor = int(percent) / 100
    if kind == "floor":
        return AgentKV(facts=True, warmup=True, warmup_policy=WarmupPolicy(min_probability=floor))
    return SecondCandidate(floor)


def summarize(report: dict) -> list[str]:
    cells = {(r["tape"], r["capacity"], r["policy"]): r for r in report["results"]}
    lines = ["| policy | gap closed (mean over tapes) | foreground computed | warm-up computed | "
             "warm-ups sent | useful |", "|---|---:|---:|---:|---:|---:|"]
    for policy in [p for p in report["policies"] if p not in ("lru", "belady")]:
        closed: dict[str, list[float]] = defaultdict(list)
        totals: dict[str, float] = defaultdict(float)
        for (tape, capacity, name), row in cells.items():
            if name != policy:
                continue
            low, high = cells[tape, capacity, "lru"]["hit_rate"], cells[tape, capacity, "belady"]["hit_rate"]
            closed[tape].append((row["hit_rate"] - low) / (high - low) if high > low else 0.0)
            totals["foreground"] += row["prefill_tokens"]
            totals["warmup"] += row["warmup_tokens"]
            outcomes = row["policy_stats"].get("warmup_outcomes") or {}
            totals["sent"] += outcomes.get("sent", 0)
            totals["useful"] += outcomes.get("useful", 0)
        mean = sum(sum(v) / len(v) for v in closed.values()) / len(closed)
        useful = f"{100 * totals['useful'] / totals['sent']:.0f}%" if totals["sent"] else "-"
        lines.append(f"| {policy} | {100 * mean:.1f}% | {totals['foreground'] / 1e6:.2f}M | "
                     f"{totals['warmup'] / 1e6:.2f}M | {int(totals['sent'])} | {useful} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tapes", nargs="+")
    parser.add_argument("--variants", default="floor-30,floor-50,second-10,second-30")
    parser.add_argument("--out", default=".build/warmup-variants")
    args, replay_flags = parser.parse_known_args()
    variants = args.variants.split(",")
    for name in variants:
        policies.POLICIES[name] = lambda name=name: _variant(name)  # forked replay workers inherit it
    agentkv_main(["bench", "replay", *args.tapes, "--policies", ",".join(["lru", "agentkv+warmup", *variants,
                  "belady"]), "--out", args.out, "--quiet", *replay_flags])
    print("\n".join(summarize(json.loads((Path(args.out) / "replay.json").read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
