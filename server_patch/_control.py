"""The control channel between vLLM's API-server process and its EngineCore process.

The learned state lives in the EngineCore (where eviction happens); the HTTP endpoints
live in the API server. A ZMQ REQ/REP pair over an ipc socket joins them: the EngineCore
serves requests from a daemon thread, the middleware asks with a timeout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

__all__ = ["ControlServer", "ControlUnavailable", "ask", "ask_blocking", "control_endpoint", "remove_socket_file"]

logger = logging.getLogger("agentkv.server")

Handler = Callable[[dict[str, Any]], dict[str, Any]]
_MAX_LOGGED_KINDS = 16
_PROBE_TIMEOUT = 1.0  # s: how long a socket file's owner has to answer before the file counts as stale


class ControlUnavailable(RuntimeError):
    """The EngineCore side did not answer."""


def control_endpoint(api_server_pid: int) -> str:
    """AGENTKV_CONTROL if set, else an ipc socket named after the API-server process.

    The EngineCore passes its parent's pid, the API server its own; set AGENTKV_CONTROL
    explicitly when vLLM runs several API-server processes.
    """
    return os.environ.get("AGENTKV_CONTROL") or f"ipc://{tempfile.gettempdir()}/agentkv-{api_server_pid}.ipc"


class ControlServer:
    """Answers control requests in a daemon thread; ``handler`` must be thread-safe."""

    def __init__(self, endpoint: str, handler: Handler) -> None:
        self.endpoint = endpoint
        self._handler = handler
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.failures: Counter[str] = Counter()  # by exception type
        self._thread = threading.Thread(target=self._serve, name="agentkv-control", daemon=True)
        self._thread.start()
        self._ready.wait(5)
        if self._error is not None:
            raise self._error

    def _serve(self) -> None:
        context = zmq.Context.instance()
        if _answered(self.endpoint):
            # binding an ipc path takes it over silently: the engine there would never hear again
            self._error = RuntimeError(
                f"agentkv: another engine already answers on the control socket {self.endpoint}. agentkv runs "
                "one engine per API server: with --data-parallel-size > 1 run one `agentkv serve` per "
                "data-parallel rank behind a router (docs/scale-out.md), or give each engine its own "
                "AGENTKV_CONTROL")
            self._ready.set()
            return
        socket = context.socket(zmq.REP)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._error = RuntimeError(f"agentkv: cannot bind control socket {self.endpoint}: {exc}")
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(200):
                    continue
                raw = socket.recv()
                try:
                    reply = json.dumps(self._handler(json.loads(raw))).encode()
                except Exception as exc:  # the channel must survive any bad request (or reply)
                    self._report(exc)
                    reply = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
                socket.send(reply)
        finally:
            socket.close()
            remove_socket_file(self.endpoint)  # libzmq leaves it: one stale file per server run otherwise

    def _report(self, exc: Exception) -> None:
        """A traceback for the first failure of each kind, then only a count (no log flood)."""
        kind = type(exc).__name__
        self.failures[kind] += 1
        if self.failures[kind] == 1 and len(self.failures) <= _MAX_LOGGED_KINDS:
            logger.exception("agentkv: control request failed; further %s failures are only counted", kind)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


def remove_socket_file(endpoint: str) -> None:
    """Delete an ipc endpoint's socket file (libzmq leaves it when the bound socket closes)."""
    if endpoint.startswith("ipc://"):
        with contextlib.suppress(OSError):
            os.unlink(endpoint.removeprefix("ipc://"))


def _answered(endpoint: str) -> bool:
    """Whether something answers on ``endpoint``, an ipc socket whose file exists (a file left by
    a process that is gone does not answer)."""
    if not endpoint.startswith("ipc://") or not os.path.exists(endpoint.removeprefix("ipc://")):
        return False
    try:
        ask_blocking(endpoint, {"op": "probe"}, timeout=_PROBE_TIMEOUT)
    except ControlUnavailable:
        return False
    return True


async def ask(endpoint: str, request: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """Send one request and wait for the reply; a fresh socket per call keeps REQ/REP simple."""
    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(endpoint)
        await socket.send(json.dumps(request).encode())
        if not await socket.poll(int(timeout * 1000)):
            raise ControlUnavailable(f"the engine did not answer on {endpoint} within {timeout:.0f} s")
        return json.loads(await socket.recv())
    finally:
        socket.close()


def ask_blocking(endpoint: str, request: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """``ask`` for threads without an event loop (vLLM runs its engine shutdown in an executor)."""
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(endpoint)
        socket.send(json.dumps(request).encode())
        if not socket.poll(int(timeout * 1000)):
            raise ControlUnavailable(f"the engine did not answer on {endpoint} within {timeout:.0f} s")
        return json.loads(socket.recv())
    finally:
        socket.close()
