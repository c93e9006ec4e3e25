"""An in-process stand-in for a vLLM server with the agentkv extension, behind ``httpx.MockTransport``.

It renders chat requests with a small template (tools after the system message, like the tiny test
model; optionally a date line, or tools inside the first user message), tokenizes by code point,
keeps a block-granular prefix cache so ``cached_tokens`` is real, and serves ``/tokenize``,
``/v1/completions``, ``/v1/chat/completions``, ``/metrics``, ``/agentkv/v1/stats`` and (``view=True``)
``/agentkv/v1/view``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

BASE = "http://127.0.0.1:9"  # never contacted: the mock transport answers


@dataclass
class Call:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeVLLM:
    block_size: int = 16
    transitions: dict[str, dict[str, float]] = field(default_factory=dict)
    predictability: float = 1.0
    running: int = 0
    waiting: int = 0
    date: str | None = None  # a template that prints today's date (Llama 3 style)
    tools_in_user: bool = False  # a template that renders tools inside the first user message
    tools_first: bool = False  # a template that renders tools before the system text
    tokenize_status: int | None = None  # answer /tokenize with this status instead
    fail: dict[str, int | type[Exception]] = field(default_factory=dict)  # path -> status or exception
    delay: float = 0.0  # seconds before answering a warm-up
    gate: threading.Event | None = None  # warm-ups wait for it
    include_details: bool = True  # --enable-prompt-tokens-details
    agentkv_metrics: bool = True  # /metrics carries agentkv's gauges (a vanilla vLLM's does not)
    view: bool = False  # serves /agentkv/v1/view (an agentkv server does; False: read through /metrics)
    anchors: dict[str, tuple[int, int]] = field(default_factory=dict)  # agent -> (resident, length) blocks
    free_blocks: int = 1000
    calls: list[Call] = field(default_factory=list)
    cache: set[tuple[int, ...]] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    # -- rendering ---------------------------------------------------------------------

    def render(self, body: dict[str, Any]) -> str:
        messages = body["messages"]
        tools = body.get("tools")
        if tools == []:
            raise ValueError("`tools` must not be an empty array")
        text = "<bos>"
        if self.date:
            text += f"Today: {self.date}\n"
        tool_text = "".join(json.dumps(t) + "\n" for t in tools or [])
        if tools and self.tools_first:
            text += f"<tools>{tool_text}<end>"
        rest = messages
        if messages and messages[0]["role"] in ("system", "developer"):
            text += f"<system>{messages[0]['content']}<end>"
            rest = messages[1:]
        if tools and not self.tools_in_user and not self.tools_first:
            text += f"<tools>{tool_text}<end>"
        placed = not self.tools_in_user
        for message in rest:
            content = message.get("content") or ""
            if not placed and message["role"] == "user":
                content, placed = f"<tools>{tool_text}<end>{content}", True
            text += f"<{message['role']}>{content}<end>"
        if tools and not placed:
            raise ValueError("Cannot put tools in the first user message when there's no first user message!")
        if body.get("add_generation_prompt", True):
            text += "<assistant>"
        return text

    def tokens(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            return [ord(c) for c in self.render(body)]
        prompt = body["prompt"]
        return list(prompt) if isinstance(prompt, list) else [ord(c) for c in prompt]

    # -- prefix cache ------------------------------------------------------------------

    def prefill(self, tokens: list[int]) -> int:
        """Serve a prompt: the cached prefix (full blocks) it hits; then cache all its full blocks."""
        bs = self.block_size
        with self.lock:
            hit = 0
            while hit + bs <= len(tokens) and tuple(tokens[: hit + bs]) in self.cache:
                hit += bs
            if hit == len(tokens) and hit:  # vLLM recomputes the last token of a fully cached prompt
                hit -= bs
            for end in range(bs, len(tokens) + 1, bs):
                self.cache.add(tuple(tokens[:end]))
        return hit

    def evict_all(self) -> None:
        with self.lock:
            self.cache.clear()

    def is_cached(self, tokens: list[int] | tuple[int, ...]) -> bool:
        with self.lock:
            return tuple(tokens) in self.cache

    # -- HTTP --------------------------------------------------------------------------

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=self.transport())

    def warmups(self) -> list[Call]:
        return [c for c in self.calls if c.headers.get("x-agentkv-warmup") == "1"]

    def count(self, path: str) -> int:
        return sum(1 for c in self.calls if c.path == path)

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        headers = {k.lower(): v for k, v in request.headers.items()}
        with self.lock:
            self.calls.append(Call(path, headers, body))
        failure = self.fail.get(path)
        if isinstance(failure, type) and issubclass(failure, Exception):
            raise failure("injected failure", request=request) if issubclass(failure, httpx.RequestError) else failure(
                "injected failure"
            )
        if isinstance(failure, int):
            return httpx.Response(failure, json={"error": {"message": "injected", "code": failure}})
        if headers.get("x-agentkv-warmup") == "1":
            if self.gate is not None:
                self.gate.wait(10)
            if self.delay:
                time.sleep(self.delay)
        try:
            return self._route(path, body)
        except ValueError as exc:
            return httpx.Response(400, json={"error": {"message": str(exc), "type": "BadRequestError", "code": 400}})

    def _route(self, path: str, body: Any) -> httpx.Response:
        if path == "/tokenize":
            if self.tokenize_status is not None:
                return httpx.Response(self.tokenize_status, json={"detail": "Not Found"})
            tokens = self.tokens(body)
            return httpx.Response(200, json={"count": len(tokens), "max_model_len": 4096, "tokens": tokens})
        if path in ("/v1/completions", "/v1/chat/completions"):
            tokens = self.tokens(body)
            hit = self.prefill(tokens)
            usage: dict[str, Any] = {"prompt_tokens": len(tokens), "completion_tokens": 1,
                                     "total_tokens": len(tokens) + 1}
            usage["prompt_tokens_details"] = {"cached_tokens": hit} if self.include_details else None
            if body.get("stream"):
                return self._stream(usage)
            if path == "/v1/completions":
                choice: dict[str, Any] = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}
                obj = "text_completion"
            else:
                choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                obj = "chat.completion"
            return httpx.Response(200, json={"id": "r1", "object": obj, "created": 0, "model": body.get("model"),
                                             "choices": [choice], "usage": usage})
        if path == "/metrics":
            text = (
                f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {float(self.running)}\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {float(self.waiting)}\n'
                'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 7.0\n'
            )
            if self.agentkv_metrics:
                text += f"agentkv_kv_free_blocks {float(self.free_blocks)}\n"
                for agent, (resident, length) in self.anchors.items():
                    text += (f'agentkv_anchor_length_blocks{{agent="{agent}"}} {float(length)}\n'
                             f'agentkv_anchor_resident_blocks{{agent="{agent}"}} {float(resident)}\n')
            return httpx.Response(200, text=text)
        if path == "/agentkv/v1/view" and self.view:
            successors = {agent: max(row.items(), key=lambda item: item[1]) for agent, row in self.transitions.items()}
            return httpx.Response(200, json={
                "waiting": self.waiting, "running": self.running, "free_blocks": self.free_blocks,
                "anchors": {agent: list(pair) for agent, pair in self.anchors.items()},
                "block_size": self.block_size, "predictability": self.predictability,
                "next": {agent: list(best) for agent, best in successors.items()}})
        if path == "/agentkv/v1/stats":
            return httpx.Response(200, json={"version": 1, "block_size": self.block_size,
                                             "predictability": self.predictability,
                                             "transitions": self.transitions, "agents": {}})
        return httpx.Response(404, json={"detail": "Not Found"})

    def _stream(self, usage: dict[str, Any]) -> httpx.Response:
        chunk = {"id": "r1", "object": "chat.completion.chunk", "created": 0, "model": "tiny",
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
        data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, content=data.encode(), headers={"content-type": "text/event-stream"})


def render_tokens(fake: FakeVLLM, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                  add_generation_prompt: bool = True) -> list[int]:
    body: dict[str, Any] = {"messages": messages, "add_generation_prompt": add_generation_prompt}
    if tools:
        body["tools"] = tools
    return fake.tokens(body)


def tokenizer_of(fake: FakeVLLM) -> Callable[[dict[str, Any]], list[int]]:
    """A ``tokenize`` callable for :meth:`AnchorBook.resolve` that goes through the fake's /tokenize."""

    def tokenize(payload: dict[str, Any]) -> list[int]:
        with fake.client() as client:
            response = client.post(BASE + "/tokenize", json=payload)
        response.raise_for_status()
        return response.json()["tokens"]

    return tokenize
