"""Command line: ``agentkv demo``, ``agentkv serve MODEL [vllm args]``, ``agentkv bench micro``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> None:
    from agentkv import demo

    sys.exit(demo.run(args))


def _bench_micro(_: argparse.Namespace) -> None:
    from agentkv.bench import micro

    micro.main()


def _bench_serve(args: argparse.Namespace) -> None:
    from agentkv.bench import serve

    code = serve.main(args)
    if code:  # nothing measured on some target
        sys.exit(code)


def _bench_tape(args: argparse.Namespace) -> None:
    from agentkv.bench import cli

    cli.run_tape(args)


def _bench_replay(args: argparse.Namespace) -> None:
    from agentkv.bench import cli

    cli.run_replay(args)


def _bench_soak(args: argparse.Namespace) -> None:
    from agentkv.bench import soak

    soak.main(args)


def _bench_bound(args: argparse.Namespace) -> None:
    from agentkv.bench import bound

    sys.exit(bound.run(args))


def _serve(args: argparse.Namespace) -> None:
    from agentkv import serve

    serve.main(args.vllm_args)


def _cluster(args: argparse.Namespace) -> None:
    from agentkv import cluster

    cluster.main(args.cluster_args)


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from agentkv.demo import add_arguments

    add_arguments(parser)


def _add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from agentkv.bench.serve_args import add_arguments  # light: no langchain import for --help of others

    add_arguments(parser)


class _Version(argparse.Action):
    """``--version``: computed only when asked for."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the versions of agentkv and vLLM, and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from agentkv._version import version_line

        print(version_line())
        parser.exit()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["serve"]:  # the rest is agentkv.serve's: its own flags and --help, then vLLM's arguments
        from agentkv import serve

        serve.main(args[1:])
        return
    parser = argparse.ArgumentParser(prog="agentkv", description=__doc__)
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="the main demo: the six-agent app on vanilla vLLM vs agentkv serve")
    _add_demo_arguments(demo)
    demo.set_defaults(run=_demo)
    serve = commands.add_parser("serve", help="start vLLM with the agentkv extension: agentkv serve MODEL [vllm args]")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="MODEL and any vLLM arguments")
    serve.set_defaults(run=_serve)
    cluster = commands.add_parser("cluster", help="replicas behind vllm-router: agentkv cluster up|down ...")
    cluster.add_argument("cluster_args", nargs=argparse.REMAINDER, help="up [options] MODEL [vllm args] | down")
    cluster.set_defaults(run=_cluster)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bench.add_parser("micro", help="learning-core microbenchmark").set_defaults(run=_bench_micro)
    from agentkv.bench import cli as bench_cli  # light: vLLM is imported only when a replay runs

    bench_tape = bench.add_parser("tape", help="generate a workload tape (docs/tapes.md)")
    bench_cli.add_tape_arguments(bench_tape)
    bench_tape.set_defaults(run=_bench_tape)
    bench_replay = bench.add_parser("replay", help="replay tapes through vLLM's KV cache manager under each policy")
    bench_cli.add_replay_arguments(bench_replay)
    bench_replay.set_defaults(run=_bench_replay)
    bench_serve = bench.add_parser("serve", help="the six-agent LangGraph app on vanilla vLLM vs agentkv serve")
    _add_bench_serve_arguments(bench_serve)
    bench_serve.set_defaults(run=_bench_serve)
    from agentkv.bench import bound as bench_bound  # light: no vLLM

    bench_bound_parser = bench.add_parser("bound", help="a server's request trace under LRU and Belady: how close "
                                          "its eviction came to the best possible")
    bench_bound.add_arguments(bench_bound_parser)
    bench_bound_parser.set_defaults(run=_bench_bound)
    from agentkv.bench import soak as bench_soak  # light: httpx only

    bench_soak_parser = bench.add_parser("soak", help="mixed valid and hostile traffic against agentkv serve")
    bench_soak.add_arguments(bench_soak_parser)
    bench_soak_parser.set_defaults(run=_bench_soak)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
