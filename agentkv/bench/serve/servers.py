"""The two single servers of ``agentkv bench serve`` and the start/stop of any set of processes."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from agentkv.bench._defaults import SERVER_ENV
from agentkv.bench.serve_args import ServeConfig, build_model
from agentkv.bench.serve_paired import core_pair, pin_env
from agentkv.launcher import ServerProcess, ServerSpec

__all__ = ["TRACE_NAME", "running", "server_specs", "start_servers"]

TRACE_NAME = "agentkv-trace.jsonl"  # the single agentkv server's request trace, in the output folder


def server_specs(config: ServeConfig, model_dir: Path, *, trace: Path | None = None) -> dict[str, ServerSpec]:
    """Both single servers, each engine bound to a core of its own; ``trace``: agentkv's AGENTKV_TRACE."""
    common = {"model_dir": model_dir, "block_size": config.block_size, "num_gpu_blocks": config.blocks,
              "max_model_len": config.max_model_len}
    vanilla_core, agentkv_core = core_pair()
    traced = {} if trace is None else {"AGENTKV_TRACE": str(trace)}
    return {"vanilla": ServerSpec(**common, env=pin_env(vanilla_core)),
            "agentkv": ServerSpec(**common, module="agentkv.serve", env=pin_env(agentkv_core) | traced)}


@contextlib.contextmanager
def start_servers(config: ServeConfig, *, log_dir: Path | None = None) -> Iterator[dict[str, ServerProcess]]:
    """Build the model, start both servers (in parallel), yield {name: ServerProcess}, stop them."""
    model_dir = build_model(config)
    log_dir = log_dir or config.out
    log_dir.mkdir(parents=True, exist_ok=True)
    trace = log_dir / TRACE_NAME
    trace.unlink(missing_ok=True)  # this run's traffic only
    servers = {
        name: ServerProcess(spec, log_path=log_dir / f"{name}-server.log", base_env=SERVER_ENV, isolated=True)
        for name, spec in server_specs(config, model_dir, trace=trace).items()
    }
    with running(list(servers.values())):
        yield servers


@contextlib.contextmanager
def running(processes: Sequence[Any]) -> Iterator[None]:
    """Start every process (objects with ``start()`` and an idempotent ``stop()``) in parallel,
    and stop them all on any exit: errors, Ctrl-C, SIGTERM and SIGHUP (a closed terminal; both
    turned into KeyboardInterrupt)."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, _sigterm) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        errors: list[BaseException] = []

        def start(process: Any) -> None:
            try:
                process.start()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(p,), daemon=True) for p in processes]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():  # join in slices so Ctrl-C is seen
                thread.join(0.5)
        if errors:
            raise errors[0]
        yield
    finally:
        for process in processes:
            process.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
