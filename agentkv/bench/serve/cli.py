"""``agentkv bench serve``: run the benchmark from the command line, write and print the reports."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from agentkv.bench.serve_args import config_from_args

from .report import (
    JSON_NAME,
    bound_lines,
    comparison_report,
    confusion_markdown,
    markdown_table,
    warmup_lines,
    write_reports,
)
from .run import run_benchmark

__all__ = ["main"]


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:  # a combination of options the benchmark cannot run
        raise SystemExit(f"agentkv bench serve: {exc}") from None
    started = time.time()
    try:
        result = run_benchmark(config)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP (see servers.running): say what is left
        print(f"agentkv bench serve: interrupted; {_left(config.out / JSON_NAME, started)}", file=sys.stderr)
        return 130
    paths = write_reports(result, config.out, args.plot)
    print()
    print(markdown_table(result["rows"]))
    print()
    print("\n".join([*comparison_report(result), *warmup_lines(result), *bound_lines(result)]))
    for row in result["rows"]:
        if row.get("confusion"):
            print("\n" + confusion_markdown(row))
    print("\n" + ", ".join(f"{k}: {v}" for k, v in paths.items()))
    failed = [f"{row['server']} ({row.get('setup', 'single')})" for row in result["rows"] if row["turns"] == 0]
    if failed:  # nothing measured there: the figures above are not a comparison
        print(f"agentkv bench serve: every call failed on {', '.join(failed)} (see the server logs in {config.out})")
        return 1
    return 0


def _left(path: Path, started: float) -> str:
    """Where this run's measured blocks are (a file an earlier run left is not this run's)."""
    try:
        partial = path.stat().st_mtime >= started and json.loads(path.read_text())["complete"] is False
    except (OSError, ValueError, KeyError, TypeError):  # none, or not this benchmark's
        partial = False
    return f"the blocks measured so far are in {path}" if partial else "no block was measured"
