"""``agentkv bench serve``: the six-agent LangGraph app end to end on real vLLM servers (docs/benchmarks.md).

A vanilla vLLM and ``agentkv serve`` with the same KV-cache pool serve the same sessions of
``examples/langgraph_supervisor.py`` (through ``agentkv.instrument``), in short alternating
blocks; ``--replicas N`` adds both kinds of replicas behind vllm-router. Measured per streamed
model call on the client (TTFT, turn latency, throughput) and from vLLM's prefix-cache counters
on the server (hit rate). The model calls send ``tool_choice="none"``: the tools are still
rendered into every prompt, and vLLM needs no tool parser.

Modules: ``app`` (the example), ``timing`` (per-call records), ``targets`` (where traffic goes),
``scrape`` (server counters), ``stats`` (result rows), ``load`` (one rate on one target),
``servers`` (process lifecycle), ``replicas`` (the scaled-out setups), ``run`` (the benchmark),
``report`` and ``plots`` (outputs), ``cli``. Configuration and flags: :mod:`agentkv.bench.serve_args`;
paired statistics: :mod:`agentkv.bench.serve_paired`.
"""

from agentkv.bench.serve_args import ServeConfig, add_arguments, config_from_args

from .app import load_example
from .cli import main
from .load import arrival_times, run_rate
from .plots import COLORS, load_pyplot, plot, plot_setups, save_figure
from .replicas import replica_args, start_targets, targets_for
from .report import bound_lines, comparison_report, confusion_markdown, markdown_table, warmup_lines, write_reports
from .run import add_anchor_hits, block_sizes, run_benchmark
from .scrape import prefix_cache_counters
from .servers import running, server_specs, start_servers
from .stats import RateRun, confusion_table, pooled_row, summarize
from .targets import SERVERS, Target, single_targets
from .timing import CallRecord, CallTimer

__all__ = [
    "COLORS",
    "SERVERS",
    "CallRecord",
    "CallTimer",
    "RateRun",
    "ServeConfig",
    "Target",
    "add_anchor_hits",
    "add_arguments",
    "arrival_times",
    "block_sizes",
    "bound_lines",
    "comparison_report",
    "config_from_args",
    "confusion_markdown",
    "confusion_table",
    "load_example",
    "load_pyplot",
    "main",
    "markdown_table",
    "plot",
    "plot_setups",
    "pooled_row",
    "prefix_cache_counters",
    "replica_args",
    "run_benchmark",
    "run_rate",
    "running",
    "save_figure",
    "server_specs",
    "single_targets",
    "start_servers",
    "start_targets",
    "summarize",
    "targets_for",
    "warmup_lines",
    "write_reports",
]
