"""``agentkv bench tape`` and ``agentkv bench replay`` (argument parsing only imports vLLM lazily)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from agentkv._arguments import at_least, list_of, names_from

from ._defaults import (
    DEFAULT_MARGIN,
    DEFAULT_MULTIPLIERS,
    DEFAULT_POLICIES,
    POLICY_NAMES,
    TOPOLOGY_NAMES,
    WORKLOAD_NAMES,
)

__all__ = ["add_replay_arguments", "add_tape_arguments", "run_replay", "run_tape"]

DEFAULT_OUT = Path(".build/bench-replay")


def _workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=at_least(int, 1), default=None,
                        help="sessions per tape (default: the workload's, 40 for the topologies)")
    parser.add_argument("--rate", type=at_least(float, 0.0, strict=True), default=None,
                        help="Poisson session arrivals per second (default: the workload's, 0.05 for the topologies)")
    parser.add_argument("--seed", type=int, default=0,
                        help="workload seed: draws the sessions and the zoo's parameters (default 0)")
    parser.add_argument("--tool-loop", action="store_true",
                        help="after a tool call the same agent is called again (same dispatch step; "
                             "heavy-tools always loops)")


def _config(args: argparse.Namespace, workload: str):  # -> WorkloadConfig
    from .tape import WorkloadConfig

    return WorkloadConfig.named(workload, sessions=args.sessions, rate=args.rate, seed=args.seed,
                                tool_loop=args.tool_loop)


def add_tape_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--workload", choices=WORKLOAD_NAMES, default=None,
                       help="workload: a six-agent topology or a zoo workload (docs/tapes.md; default selector)")
    which.add_argument("--topology", choices=TOPOLOGY_NAMES, default=None, help="a six-agent topology (= --workload)")
    _workload_arguments(parser)
    parser.add_argument("-o", "--output", required=True, help="tape file to write (JSONL, docs/tapes.md)")


def run_tape(args: argparse.Namespace) -> None:
    from .tape import generate, write_tape

    tape = generate(_config(args, args.workload or args.topology or "selector"))
    write_tape(tape, args.output)
    summary = tape.header["summary"]
    target = tape.header["target_predictability"]
    print(f"wrote {args.output}: {summary['sessions']} sessions, {summary['requests']} requests, "
          f"anchors {100 * summary['anchor_share']:.1f}% of prompt tokens, R {summary['predictability']:.2f}"
          + ("" if target is None else f" (target {target:.2f})")
          + (f", {summary['abandoned_sessions']} sessions abandoned" if summary["abandoned_sessions"] else ""),
          file=sys.stderr)


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("tapes", nargs="*", help="tape files; none: generate one tape per workload (options below)")
    _workload_arguments(parser)
    parser.add_argument("--workloads", "--topologies", dest="workloads", type=names_from(WORKLOAD_NAMES, "workloads"),
                        default=list(WORKLOAD_NAMES),
                        help="workloads of the generated tapes, comma-separated (without TAPE arguments; "
                             f"default all: {','.join(WORKLOAD_NAMES)})")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help=f"comma-separated, from {', '.join(POLICY_NAMES)} (lru and belady always run: "
                             "the report is relative to them)")
    parser.add_argument("--capacities", type=list_of(at_least(int, 1)), default=None,
                        help="KV cache sizes in blocks (comma-separated); default: --multipliers")
    parser.add_argument("--multipliers", type=list_of(at_least(float, 1.0)),  # below 1 no request fits
                        default=list(DEFAULT_MULTIPLIERS),
                        help="candidate capacities as multiples of each tape's largest request "
                             f"(default {','.join(map(str, DEFAULT_MULTIPLIERS))})")
    parser.add_argument("--margin", type=at_least(float, -math.inf), default=DEFAULT_MARGIN,
                        help="preflight: keep capacities where belady - lru >= this many points (default 15)")
    parser.add_argument("--no-preflight", action="store_true", help="keep every capacity")
    parser.add_argument("--skip-dropped", action="store_true",
                        help="do not run the other policies on capacities the preflight dropped")
    parser.add_argument("--ttl", type=at_least(float, 0.0), default=None,
                        help="ttl policy pin in seconds (default 0.3, Continuum's setting)")
    parser.add_argument("--jobs", type=at_least(int, 1), default=2, help="worker processes (default 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"directory for replay.json / replay.md / replay.png and generated tapes ({DEFAULT_OUT})")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default OUT/replay.png)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run_replay(args: argparse.Namespace) -> None:
    from .policies import POLICIES
    from .replay import CapacityError
    from .report import markdown, plot
    from .sweep import sweep
    from .tape import TapeError, generate, write_tape

    policies = list(dict.fromkeys(p.strip() for p in args.policies.split(",") if p.strip()))  # each once
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise SystemExit(f"agentkv bench replay: error: --out {out} is a file, not a directory")
    out.mkdir(parents=True, exist_ok=True)
    paths = list(args.tapes)
    if not paths:
        for workload in args.workloads:
            tape = generate(_config(args, workload))
            path = out / "tapes" / f"{tape.name}.jsonl"
            write_tape(tape, path)
            paths.append(str(path))
    started = time.perf_counter()
    try:
        report = sweep(paths, policies=policies, capacities=args.capacities, multipliers=args.multipliers,
                       margin=args.margin, preflight=not args.no_preflight, skip_dropped=args.skip_dropped,
                       ttl=args.ttl, jobs=args.jobs, progress=not args.quiet)
    except (TapeError, CapacityError) as exc:  # a tape outside the format, or one the engine cannot hold
        raise SystemExit(f"agentkv bench replay: {exc}") from None
    report["command"] = "agentkv bench replay " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "replay"]
                                                           else sys.argv[1:])
    report["wall_s"] = round(time.perf_counter() - started, 1)
    text = markdown(report)
    (out / "replay.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "replay.md").write_text(text)
    plot_path = args.plot or out / "replay.png"
    plot(report, plot_path)
    print(text)
    print(f"wrote {out / 'replay.json'}, {out / 'replay.md'}, {plot_path} in {report['wall_s']} s", file=sys.stderr)
