"""API-server side: ``--middleware server_patch.middleware.AgentKVMiddleware``.

A pure ASGI middleware that (1) turns the agentkv request headers into ``vllm_xargs``
in the JSON body, so the tag reaches the EngineCore as ``sampling_params.extra_args``;
(2) validates tags as docs/protocol.md says (lenient by default, 400 with
``AGENTKV_STRICT=1``); (3) serves ``GET /agentkv/v1/stats`` and
``POST /agentkv/v1/events`` (and ``GET /agentkv/v1/view``, the warm-up coordinator's read) by
asking the EngineCore over the control channel;
(4) appends agentkv's counters to vLLM's Prometheus ``/metrics``; (5) tells the engine
whether a request's answer was a tool call (_answers.py; an untagged one by its response id); (6) serves
``GET /agentkv/v1/state`` / ``POST /agentkv/v1/merge`` and, with ``AGENTKV_PEERS``, pulls
the other replicas' learned counts every ``AGENTKV_SYNC_INTERVAL`` seconds.

Every ``/agentkv/*`` route requires vLLM's API key when one is configured (checked before
anything else, see _guard.py), and every body it parses is bounded in size and depth.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from agentkv.protocol import (
    EVENTS_PATH,
    HEADER_VLLM_SESSION,
    MERGE_PATH,
    STATE_PATH,
    STATS_PATH,
    VIEW_PATH,
    XARG_AGENT,
    MalformedCounter,
    ProtocolError,
    names_a_session,
    parse_header_list,
    parse_xargs,
    validate_id,
)
from agentkv.settings import env_number, env_switch, env_text

from ._answers import AnswerWatch
from ._config import recognition_on
from ._control import ControlUnavailable, ask, ask_blocking, control_endpoint, remove_socket_file
from ._guard import ApiKeyGuard, BodyError, parse_json
from ._logging import configure_logging
from ._metrics import render_metrics

__all__ = ["AgentKVMiddleware"]

logger = logging.getLogger("agentkv.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

RECOGNIZED_PATH = "/agentkv/v1/recognized"  # recent recognitions: [request id, agent, session]
# vLLM passes each one's vllm_xargs to the engine (Anthropic's messages are served as chat completions)
_TAGGED_PATHS = frozenset({"/v1/chat/completions", "/v1/chat/completions/batch", "/v1/completions", "/v1/responses",
                           "/v1/messages"})
_AGENTKV_PREFIX = "/agentkv/"
_XARG_PREFIX = "agentkv_"
# a Responses API request run in the background is answered "queued" at once: its silence tells nothing
_BACKGROUND = re.compile(rb'"background"\s*:\s*true')
_MAX_BODY = {"events": 1 << 20, "merge": 4 << 20}  # a 256-agent counts document is ~1.5 MB
_MAX_AGENTKV_DEPTH = 16  # agentkv's own documents nest at most 4 deep
_PEER_DEADLINE = 10.0  # seconds for one peer's whole state document (httpx's timeout is per read)
_MAX_REQUEST_DEPTH = 128  # completion bodies re-encoded here (JSON schemas nest, but not this deep)


def _route(scope: Scope) -> str:
    """The request's path as vLLM routes it: without the app's ``--root-path`` prefix."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


async def _pull_state(client: httpx.AsyncClient, peer: str) -> bytes:
    """A peer's state document, read no further than the merge limit."""
    async with client.stream("GET", peer + STATE_PATH) as response:
        response.raise_for_status()
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > _MAX_BODY["merge"]:
                raise ValueError(f"state document larger than {_MAX_BODY['merge']} bytes")
    return bytes(body)


def _vllm_session(pairs: list[tuple[str, str]], document: dict[str, Any], xargs: dict[str, Any] | None,
                  agent: str) -> str | None:
    """The session id vLLM gives the request (its body's ``session_id``, else ``X-Session-ID``, else
    ``vllm_xargs``' ``session_id``: ``GenerateBaseServing._get_session_id``), if agentkv's ids admit it
    and it is not ``agent``'s routing key (``names_a_session``)."""
    header = next((value for name, value in pairs if name.lower() == HEADER_VLLM_SESSION.lower()), None)
    for value in (document.get("session_id"), header, (xargs or {}).get("session_id")):
        if isinstance(value, str) and value:
            try:
                session = validate_id(value, "session")
            except ProtocolError:
                return None  # the engine ignores it too (and counts it)
            return session if names_a_session(session, agent) else None
    return None


class AgentKVMiddleware:
    """Invariants: a request without agentkv metadata passes through byte for byte (its response
    is only read); with an API key configured, no ``/agentkv/*`` request is acted on (or its body
    read) without it."""

    def __init__(self, app: ASGIApp) -> None:
        configure_logging()
        self.app = app
        self.strict = env_switch(os.environ, "AGENTKV_STRICT", False)
        self.recognize = recognition_on()
        self.endpoint = control_endpoint(os.getpid())
        self.timeout = 5.0  # seconds to wait for the engine's answer before a 503
        self.malformed = MalformedCounter(logger)
        peers = env_text(os.environ, "AGENTKV_PEERS")  # base URLs, each scheme://host[:port]
        self.peers = peers.split(",") if peers else []
        self.sync_interval = env_number(os.environ, "AGENTKV_SYNC_INTERVAL", 5.0)
        self.peer_key = env_text(os.environ, "AGENTKV_PEER_API_KEY")  # else this server's own key
        self.sync_failures: Counter[str] = Counter()  # per peer; the first failure is logged
        self._sync_task: asyncio.Task[None] | None = None
        self._guard: ApiKeyGuard | None = None
        self.answer_failures = 0  # answers the engine could not be told (the first is logged)
        self._telling: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, self._on_startup(scope, receive), send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._guard is None:  # vLLM's arguments are on the app once it serves
            self._guard = ApiKeyGuard.for_scope(scope)
        if self.peers and self._sync_task is None:
            self._sync_task = asyncio.get_running_loop().create_task(self._sync_forever())
        path, method = _route(scope), scope["method"]
        authorized = method == "OPTIONS" or self._guard.allows(scope)  # vLLM lets preflights through too
        if path.startswith(_AGENTKV_PREFIX) and not authorized:
            await _json(send, 401, {"error": "Unauthorized"})  # vLLM's own answer on /v1
        elif path in _TAGGED_PATHS and method == "POST" and not authorized:
            await self.app(scope, receive, send)  # vLLM answers 401 before reading anything
        elif path == STATS_PATH and method == "GET":
            await self._stats(send)
        elif path == STATE_PATH and method == "GET":
            await self._relay(send, {"op": "state"})
        elif path == RECOGNIZED_PATH and method == "GET":
            await self._relay(send, {"op": "recognized"})
        elif path == VIEW_PATH and method == "GET":
            await self._relay(send, {"op": "view"})
        elif path == MERGE_PATH and method == "POST":
            await self._relay_body(receive, send, "merge")
        elif path == EVENTS_PATH and method == "POST":
            await self._relay_body(receive, send, "events")
        elif path in _TAGGED_PATHS and method == "POST":
            await self._tagged(scope, receive, send)
        elif path.rstrip("/") == "/metrics" and method == "GET":
            await self._metrics(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _tagged(self, scope: Scope, receive: Receive, send: Send) -> None:
        pairs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        header_result = parse_header_list(pairs)
        has_agentkv_headers = header_result.tag is not None or bool(header_result.errors)
        body = await _read_body(receive)
        if not has_agentkv_headers and _XARG_PREFIX.encode() not in body:
            if self.recognize:  # the engine may recognize its session: tell it how this one was answered
                offered = b'"tools"' in body and _BACKGROUND.search(body) is None
                send = self._watching(send, AnswerWatch(None, offered, path=_route(scope)))
            await self.app(scope, _replay(body, receive), send)  # nothing of agentkv's: byte for byte
            return
        try:
            document = parse_json(body, what="request", max_depth=_MAX_REQUEST_DEPTH) if body else None
        except BodyError as exc:
            if has_agentkv_headers:  # the tag cannot be attached to a body that cannot be re-encoded
                await _error(send, 400, str(exc))
            else:  # not ours to judge: vLLM answers it itself
                await self.app(scope, _replay(body, receive), send)
            return
        if not isinstance(document, dict):
            await self.app(scope, _replay(body, receive), send)
            return
        xargs = document.get("vllm_xargs")
        xargs = xargs if isinstance(xargs, dict) else None
        body_result = parse_xargs(xargs)
        if self.strict and (body_result.errors or header_result.errors):
            await _error(send, 400, str((body_result.errors or header_result.errors)[0]))
            return
        self.malformed.record(body_result.errors + header_result.errors)
        rewritten: dict[str, Any] | None = None
        if body_result.errors and xargs is not None:
            # served untagged, as in strict mode's sense of valid (vLLM would coerce true to 1)
            rewritten = {k: v for k, v in xargs.items() if not k.startswith(_XARG_PREFIX)}
        elif header_result.tag is not None and not (xargs is not None and XARG_AGENT in xargs):
            # The body form wins when both are present (docs/protocol.md §1.2).
            rewritten = {**(xargs or {}), **header_result.tag.to_xargs()}
        if rewritten is not None:
            document["vllm_xargs"] = rewritten
            body = json.dumps(document).encode()
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"] + [
                (b"content-length", str(len(body)).encode())
            ]
        # the tag the engine reads: none when the body's was malformed (its keys are dropped)
        tag = None if body_result.errors else body_result.tag or header_result.tag
        # a warm-up's one-token answer says nothing of its agent's session: never told; without a
        # session the engine may recognize one: told, as an untagged answer, by response id
        if tag is None:
            watched, session = self.recognize, None
        else:  # a tag naming its agent alone: the engine takes vLLM's session id, if any, as its session
            session = tag.session or _vllm_session(pairs, document, xargs, tag.agent)
            watched = not tag.warmup and (session is not None or self.recognize)
        if watched:
            tools = document.get("tools")
            offered = isinstance(tools, list) and bool(tools) and document.get("background") is not True
            send = self._watching(send, AnswerWatch(session, offered, path=_route(scope)))
        await self.app(scope, _replay(body, receive), send)

    def _watching(self, send: Send, watch: AnswerWatch) -> Send:
        """``send`` that also shows the response to ``watch`` and, once it is complete, tells
        the engine in the background (never delaying or failing the user's response)."""

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                watch.started(int(message["status"]))
            elif message["type"] == "http.response.body":
                watch.chunk(message.get("body", b""))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                verdict, about = watch.verdict(), watch.about()
                if verdict is not None and about is not None:
                    task = asyncio.get_running_loop().create_task(self._tell_answer(about, verdict))
                    self._telling.add(task)
                    task.add_done_callback(self._telling.discard)

        return watched

    async def _tell_answer(self, about: dict[str, str], tool_call: bool) -> None:
        try:
            reply = await ask(self.endpoint, {"op": "answered", **about, "tool_call": tool_call}, self.timeout)
            if "error" in reply:
                raise ValueError(reply["error"])
        except (ControlUnavailable, ValueError) as exc:
            if not self.answer_failures:
                logger.warning("agentkv: could not tell the engine how a request was answered (%s); "
                               "further failures are only counted", exc)
            self.answer_failures += 1

    async def _fetch_stats(self) -> dict[str, Any]:
        stats = await ask(self.endpoint, {"op": "stats"}, self.timeout)
        if "error" in stats:  # the engine failed to build them (logged there): no document to serve
            raise ControlUnavailable(f"the engine could not report its stats ({stats['error']})")
        merged = dict(stats.get("malformed_metadata", {}))
        for field, count in self.malformed.by_field.items():
            merged[field] = merged.get(field, 0) + count
        stats["malformed_metadata"] = merged
        stats["peer_sync_failures"] = dict(self.sync_failures)
        return stats

    async def _stats(self, send: Send) -> None:
        try:
            stats = await self._fetch_stats()
        except ControlUnavailable as exc:
            await _error(send, 503, str(exc))
            return
        await _json(send, 200, stats)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's exposition, then agentkv's families (nothing extra if the engine is mute)."""
        try:
            extra = render_metrics(await self._fetch_stats(), self.strict)
        except ControlUnavailable:
            extra = b""
        scope = dict(scope)  # ask for an uncompressed body so it can be extended
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"accept-encoding"]
        start: Message | None = None
        chunks: list[bytes] = []

        async def buffered(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            assert start is not None
            body = b"".join(chunks) + (extra if start["status"] == 200 else b"")
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, buffered)

    async def _relay(self, send: Send, request: dict[str, Any]) -> None:
        try:
            reply = await ask(self.endpoint, request, self.timeout)
        except ControlUnavailable as exc:
            await _error(send, 503, str(exc))
            return
        if "error" in reply:
            await _error(send, int(reply.get("status", 400)), reply["error"])
        else:
            await _json(send, 200, reply)

    async def _sync_forever(self) -> None:
        """Pull every peer's own counts and merge them into this replica's engine, each peer in a loop
        of its own: one slow or endless peer delays none of the others, nor itself past ``_PEER_DEADLINE``."""
        key = self.peer_key or next(iter(self._guard.tokens if self._guard else ()), "")
        headers = {"Authorization": f"Bearer {key}"} if key else None
        async with httpx.AsyncClient(timeout=2.0, trust_env=False, headers=headers) as client:
            await asyncio.gather(*(self._sync_peer(client, peer) for peer in self.peers))

    async def _sync_peer(self, client: httpx.AsyncClient, peer: str) -> None:
        while True:
            await self._sync_once(client, peer)
            await asyncio.sleep(self.sync_interval)

    async def _sync_once(self, client: httpx.AsyncClient, peer: str) -> None:
        try:
            content = await asyncio.wait_for(_pull_state(client, peer), _PEER_DEADLINE)
            payload = parse_json(content, what="state", max_depth=_MAX_AGENTKV_DEPTH)
            reply = await ask(self.endpoint, {"op": "merge", "payload": payload}, self.timeout)
            if "error" in reply:
                raise ValueError(reply["error"])
        except Exception as exc:  # any peer's failure (a bad URL, a stall too) is counted; the others go on
            if not self.sync_failures[peer]:
                logger.warning("agentkv: cannot merge learned counts from %s (%r); retrying, "
                               "further failures are only counted", peer, exc)
            self.sync_failures[peer] += 1

    async def _relay_body(self, receive: Receive, send: Send, op: str) -> None:
        """Relay a JSON request body to the engine as ``{"op": op, "payload": body}``."""
        body = await _read_body(receive, limit=_MAX_BODY[op])
        if body is None:
            await _error(send, 413, f"{op} body larger than {_MAX_BODY[op]} bytes")
            return
        try:
            payload = parse_json(body, what=op, max_depth=_MAX_AGENTKV_DEPTH)
        except BodyError as exc:
            await _error(send, 400, str(exc))
            return
        await self._relay(send, {"op": op, "payload": payload})

    # -- saving the learned state before vLLM stops the engine ------------------------

    def _on_startup(self, scope: Scope, receive: Receive) -> Receive:
        """A lifespan receive() that wraps the engine client's shutdown once the app starts."""

        async def observed() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._save_before_engine_shutdown(scope)
            return message

        return observed

    def _save_before_engine_shutdown(self, scope: Scope) -> None:
        """Ask the EngineCore to save before vLLM shuts it down, whatever stops the server.

        On SIGINT/SIGTERM vLLM calls ``engine_client.shutdown`` first, and its process manager
        kills the EngineCore right after its SIGTERM, too early for a save there. An instance
        wrapper (as for the KV cache manager) puts the save first; the EngineCore's periodic
        save (AGENTKV_SNAPSHOT_INTERVAL) covers any way around it. Once the engine is down the
        wrapper deletes the control socket's file, which the killed EngineCore leaves in /tmp.
        """
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is None:
            return
        asked = threading.Event()

        @functools.wraps(shutdown)
        def saving_shutdown(*args: Any, **kwargs: Any) -> Any:
            if not asked.is_set():  # once: afterwards the engine is gone and would only time out
                asked.set()
                try:
                    if ask_blocking(self.endpoint, {"op": "save"}, self.timeout).get("saved"):
                        logger.info("agentkv: learned state saved before shutdown")
                except ControlUnavailable as exc:
                    logger.warning("agentkv: could not save learned state at shutdown: %s", exc)
            try:
                return shutdown(*args, **kwargs)
            finally:  # the EngineCore, killed before its own clean-up, cannot delete it
                remove_socket_file(self.endpoint)

        engine.shutdown = saving_shutdown


async def _read_body(receive: Receive, limit: int | None = None) -> Any:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that yields ``body`` once, then defers to the real one (disconnects)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _json(send: Send, status: int, payload: object) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _error(send: Send, status: int, message: str) -> None:
    kind = {400: "BadRequestError", 413: "BadRequestError", 503: "ServiceUnavailableError"}.get(status, "Error")
    await _json(send, status, {"error": {"message": message, "type": kind, "code": status}})
