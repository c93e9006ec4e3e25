"""What the examples (``examples/*.py``) share around their app: the command line, a local tiny-model
``agentkv serve`` when no ``--base-url`` is given, and the server's view of the run at the end.

An example keeps its app, its ``instrument`` call and its report of the sessions; its ``main`` is::

    parser = example_parser(__doc__, sessions=2, turns=6)
    return run_example(parser, run, argv, script=__file__)

where ``run(args, base_url, root)`` runs the sessions (``root``: the agentkv server's root URL, None
for another OpenAI-compatible server) and may end with :func:`print_server_view`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai

from agentkv._arguments import at_least
from agentkv.launcher import exit_on_signals
from agentkv.protocol import STATS_PATH

__all__ = ["agentkv_root", "example_parser", "print_server_view", "run_example", "start_local_server"]

Run = Callable[[argparse.Namespace, str, "str | None"], Awaitable[None]]


def example_parser(doc: str | None, *, sessions: int, turns: int) -> argparse.ArgumentParser:
    """The flags every example takes (the example adds its own): the server, the model, the workload."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="OpenAI-compatible endpoint (default: start a local agentkv server)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sessions", type=at_least(int, 0), default=sessions)
    parser.add_argument("--turns", type=at_least(int, 1), default=turns, help="agent turns per session")
    parser.add_argument("--max-tokens", type=at_least(int, 1), default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blocks", type=at_least(int, 65), default=257,
                        help="local server: --num-gpu-blocks-override (65 and up: 2,048 tokens of context)")
    return parser


def agentkv_root(base_url: str) -> str | None:
    """The server root if ``base_url`` is an agentkv server (it answers ``GET /agentkv/v1/stats``)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        ok = httpx.get(root + STATS_PATH, timeout=5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        ok = False
    return root if ok else None


def start_local_server(blocks: int, build: Path, log_name: str, extra_args: Sequence[str] = ()) -> Any:
    """Build the tiny random model in ``build`` and start ``agentkv serve`` on it (127.0.0.1, a free
    port), its log in ``build/log_name``. Context as long as the blocks hold."""
    from agentkv.testing.tiny_model import MAX_POSITION_EMBEDDINGS, build_tiny_model
    from agentkv.testing.vllm_server import ServerSpec, VLLMServer

    model_dir = build_tiny_model(build / "tiny-model")
    spec = ServerSpec(model_dir=model_dir, num_gpu_blocks=blocks, module="agentkv.serve",
                      max_model_len=min(MAX_POSITION_EMBEDDINGS, (blocks - 1) * 32), extra_args=list(extra_args))
    print(f"starting agentkv serve on the tiny model ({blocks - 1} KV blocks of 32 tokens) ...", flush=True)
    return VLLMServer(spec, log_path=build / log_name).start()


def run_example(parser: argparse.ArgumentParser, run: Run, argv: list[str] | None = None, *, script: str,
                server_args: Sequence[str] = ()) -> int:
    """Parse ``argv``, serve locally unless ``--base-url`` is given, run ``run`` on the server and stop
    the local one (also on SIGTERM or SIGHUP). ``script`` (the example's ``__file__``) places the
    local server's model and log in its checkout's ``.build/``; ``server_args`` go to its command line.
    Returns the exit status: 0, or 1 (one line on stderr) when the server cannot be reached."""
    args = parser.parse_args(argv)
    if args.base_url is not None and not args.base_url.startswith(("http://", "https://")):
        parser.error(f"--base-url needs its scheme, e.g. http://{args.base_url}")
    exit_on_signals()  # a kill or a closed terminal stops the local server too
    server = None
    if args.base_url is None:
        example = Path(script).resolve()
        server = start_local_server(args.blocks, example.parents[1] / ".build", f"{example.stem}-server.log",
                                    server_args)
    base_url = args.base_url or server.base_url + "/v1"
    try:
        root = agentkv_root(base_url)
        print(f"{'agentkv' if root else 'plain OpenAI-compatible'} server at {base_url}; "
              f"{args.sessions} sessions of {args.turns} turns")
        asyncio.run(run(args, base_url, root))
    except (openai.APIConnectionError, httpx.HTTPError) as exc:
        print(f"cannot reach {base_url}: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    return 0


def print_server_view(root: str, agents: Sequence[str]) -> None:
    """What the agentkv server at ``root`` learned (``GET /agentkv/v1/stats``): policy, predictability R,
    top-1 accuracy, the transitions between ``agents`` (P >= 0.05) and each one's prefix-cache hit rate."""
    from agentkv.testing.server_stats import fetch_stats

    stats = fetch_stats(root)  # no older than the run's last requests
    accuracy = stats["top1_accuracy"]
    print(f"\nserver: policy {stats['policy']}, predictability R {stats['predictability']:.3f}, top-1 accuracy "
          f"{'n/a' if accuracy is None else f'{accuracy:.1%}'}, {stats['dispatches']} dispatches learned, "
          f"evictions by kind: {', '.join(f'{kind} {n}' for kind, n in stats['evictions'].items())}")
    print("\n| from \\ to | " + " | ".join(agents) + " |\n|---|" + "---:|" * len(agents))
    for name in agents:
        row = stats["transitions"].get(name, {})
        print(f"| {name} | " + " | ".join(f"{row[t]:.2f}" if row.get(t, 0) >= 0.05 else "" for t in agents) + " |")
    print("\n| agent | prompt tokens | cached | hit rate | anchor blocks |\n|---|---:|---:|---:|---:|")
    total = {"queries": 0, "hits": 0}
    for name in agents:
        a = stats["agents"].get(name, {"queries": 0, "hits": 0})
        total = {k: total[k] + a[k] for k in total}
        print(f"| {name} | {a['queries']} | {a['hits']} | {a['hits'] / max(1, a['queries']):.0%} "
              f"| {a.get('anchor_blocks', 0)} |")
    print(f"| all | {total['queries']} | {total['hits']} | {total['hits'] / max(1, total['queries']):.1%} | |")
