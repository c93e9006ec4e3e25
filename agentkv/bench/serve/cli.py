"""``agentkv bench serve``: run the benchmark from the command line, write and print the reports."""

from __future__ import annotations

import argparse

from agentkv.bench.serve_args import config_from_args

from .report import bound_lines, comparison_report, confusion_markdown, markdown_table, warmup_lines, write_reports
from .run import run_benchmark

__all__ = ["main"]


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:  # a combination of options the benchmark cannot run
        raise SystemExit(f"agentkv bench serve: {exc}") from None
    result = run_benchmark(config)
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
