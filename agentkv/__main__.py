"""Command line: ``agentkv demo``, ``agentkv serve MODEL [vllm args]``, ``agentkv bench micro``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _demo(_: argparse.Namespace) -> None:
    from agentkv.bench import micro
    from agentkv.bench.topologies import TOPOLOGIES, sample_dispatches, topology
    from agentkv.graph import Predictor, SurvivalConfig, SurvivalScorer, TransitionLearner

    print("agentkv demo: the learning core on the paper's four six-agent topologies (1,000 dispatches each)\n")
    print(
        "| topology | target R | learned R | online top-1 | top-1 over last 50 | next after 'coder' "
        "| survival (K=4) |"
    )
    print("|---|---:|---:|---:|---:|---|---|")
    for name in TOPOLOGIES:
        topo = topology(name)
        learner = TransitionLearner()
        for agent in sample_dispatches(topo, 1000, seed=0):
            learner.observe(agent, session="demo")
        predictor = Predictor(learner)
        table = SurvivalScorer(predictor, SurvivalConfig(horizon=4, new_sessions=0)).refresh()
        guess = predictor.predict("coder")
        survival = ", ".join(f"{a[:3]} {p:.2f}" for a, p in table.as_dict().items())
        print(
            f"| {name} | {topo.target_r:.2f} | {learner.predictability():.2f} | {learner.accuracy:.2f} | "
            f"{learner.recent_accuracy:.2f} | {guess.agent} ({guess.probability:.2f}) | "
            f"{survival if table.predictable else 'all alike (R < R_min): LRU'} |"
        )
    print()
    micro.main()


def _bench_micro(_: argparse.Namespace) -> None:
    from agentkv.bench import micro

    micro.main()


def _serve(args: argparse.Namespace) -> None:
    from agentkv import serve

    serve.main(args.vllm_args)


def _cluster(args: argparse.Namespace) -> None:
    from agentkv import cluster

    cluster.main(args.cluster_args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="agentkv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run the main demo").set_defaults(run=_demo)
    serve = commands.add_parser("serve", help="start vLLM with the agentkv extension: agentkv serve MODEL [vllm args]")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="MODEL and any vLLM arguments")
    serve.set_defaults(run=_serve)
    cluster = commands.add_parser("cluster", help="replicas behind vllm-router: agentkv cluster up|down ...")
    cluster.add_argument("cluster_args", nargs=argparse.REMAINDER, help="up [options] MODEL [vllm args] | down")
    cluster.set_defaults(run=_cluster)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bench.add_parser("micro", help="learning-core microbenchmark").set_defaults(run=_bench_micro)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
