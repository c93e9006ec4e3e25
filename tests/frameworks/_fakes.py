"""Test doubles: a scripted OpenAI-compatible server behind httpx mock transports, an events server.

Why legacy ``httpx`` clients: openai 3.x (and langchain-openai, autogen-ext) build on ``httpx2``;
they still accept a legacy ``httpx.Client``/``httpx.AsyncClient`` as ``http_client``, and an
``httpx.MockTransport`` on such a client answers in-process, so no socket is opened and no
``httpx2.alias_httpx()`` plugin is needed. Responses are chosen by the request's own
``X-AgentKV-Agent`` header, so a wrong tag also derails the app, not just an assertion.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

TAG_HEADERS = ("x-agentkv-agent", "x-agentkv-session", "x-agentkv-parent", "x-agentkv-step", "x-agentkv-warmup")
BASE_URL = "http://127.0.0.1:9/v1"  # never contacted: the mock transport answers


def cfg(thread: str) -> dict[str, Any]:
    """A LangGraph run config for ``thread``."""
    return {"configurable": {"thread_id": thread}}


def text(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def tool_call(name: str, arguments: dict[str, Any] | None = None, call_id: str = "call_1") -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments or {})}}
        ],
    }


@dataclass
class Seen:
    """One request as the server saw it."""

    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def tag(self) -> tuple[str | None, str | None, str | None, int | None]:
        """(agent, session, parent, step) from the headers."""
        step = self.headers.get("x-agentkv-step")
        return (
            self.headers.get("x-agentkv-agent"),
            self.headers.get("x-agentkv-session"),
            self.headers.get("x-agentkv-parent"),
            None if step is None else int(step),
        )

    @property
    def agent(self) -> str | None:
        return self.headers.get("x-agentkv-agent")

    @property
    def last_text(self) -> str:
        content = self.body.get("messages", [{}])[-1].get("content")
        return content if isinstance(content, str) else json.dumps(content)


@dataclass
class FakeOpenAI:
    """Answers chat completions from per-agent scripts (a queue of assistant messages per agent).

    When an agent's script is empty (or the request is untagged) it answers ``default``.
    """

    scripts: dict[str | None, deque[dict[str, Any]]] = field(default_factory=lambda: defaultdict(deque))
    default: str = "ok"
    requests: list[Seen] = field(default_factory=list)
    delay: float = 0.0

    def script(self, agent: str | None, *messages: dict[str, Any] | str) -> FakeOpenAI:
        for m in messages:
            self.scripts[agent].append(text(m) if isinstance(m, str) else m)
        return self

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        headers = {k.lower(): v for k, v in request.headers.items()}
        seen = Seen(headers, body)
        self.requests.append(seen)
        if self.delay:
            time.sleep(self.delay)
        queue = self.scripts.get(seen.agent)
        message = queue.popleft() if queue else text(self.default)
        model = body.get("model", "m")
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        if body.get("stream"):
            return self._stream(model, message)
        return httpx.Response(
            200,
            json={
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            },
        )

    @staticmethod
    def _stream(model: str, message: dict[str, Any]) -> httpx.Response:
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            delta["tool_calls"] = [dict(tc, index=i) for i, tc in enumerate(message["tool_calls"])]
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model}
        chunks = [
            {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
            {
                **base,
                "choices": [
                    {"index": 0, "delta": {}, "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            },
        ]
        data = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=data.encode(), headers={"content-type": "text/event-stream"})

    # -- clients ---------------------------------------------------------------------

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def http_client(self) -> httpx.Client:
        return httpx.Client(transport=self.transport())

    def async_http_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=self.transport())

    def openai(self) -> Any:
        import openai

        return openai.OpenAI(api_key="sk-test", base_url=BASE_URL, http_client=self.http_client(), max_retries=0)

    def async_openai(self) -> Any:
        import openai

        return openai.AsyncOpenAI(
            api_key="sk-test", base_url=BASE_URL, http_client=self.async_http_client(), max_retries=0
        )

    def chat_openai(self, **kwargs: Any) -> Any:
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(
            model="m",
            api_key="sk-test",
            base_url=BASE_URL,
            http_client=self.http_client(),
            http_async_client=self.async_http_client(),
            max_retries=0,
            **kwargs,
        )

    # -- reading ---------------------------------------------------------------------

    def tags(self) -> list[tuple[str | None, str | None, str | None, int | None]]:
        return [r.tag for r in self.requests]

    def tags_by_text(self) -> dict[str, tuple[str | None, str | None, str | None, int | None]]:
        return {r.last_text: r.tag for r in self.requests}


class EventsServer:
    """A real HTTP server on 127.0.0.1 that records ``POST /agentkv/v1/events`` bodies."""

    def __init__(self, delay: float = 0.0, status: int = 200) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.delay = delay
        self.status = status
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                raw = self.rfile.read(length)
                if outer.delay:
                    time.sleep(outer.delay)
                outer.bodies.append({"path": self.path, "json": json.loads(raw)})
                payload = json.dumps({"accepted": 1, "duplicates": 0}).encode()
                try:
                    self.send_response(outer.status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def events(self) -> list[dict[str, Any]]:
        return [e for b in self.bodies for e in b["json"]["events"]]

    def __enter__(self) -> EventsServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def closed_port_url() -> str:
    """A 127.0.0.1 URL on which nothing listens."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def only(items: Iterable[Any]) -> Any:
    items = list(items)
    assert len(items) == 1, items
    return items[0]


class SilentServer:
    """A real TCP listener on 127.0.0.1 that accepts every connection and never answers (nor reads):
    what a hung server looks like to a client. ``accepted`` counts connections."""

    def __init__(self) -> None:
        import socket

        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._connections: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def accepted(self) -> int:
        return len(self._connections)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._connections.append(connection)  # kept open, never read or written

    def __enter__(self) -> SilentServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()
        for connection in self._connections:
            connection.close()
