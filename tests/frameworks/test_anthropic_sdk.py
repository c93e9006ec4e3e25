"""The anthropic SDK (what ChatAnthropic and AutoGen's Anthropic client call) is tagged like the openai SDK."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest

anthropic = pytest.importorskip("anthropic")
httpx2 = pytest.importorskip("httpx2")  # the anthropic SDK refuses a legacy httpx client

import agentkv  # noqa: E402
import agentkv.client  # noqa: E402
from agentkv.client import TaggedResponse, install, usage_of  # noqa: E402

BASE_URL = "http://127.0.0.1:9"  # never contacted: the mock transport answers
USAGE = {"input_tokens": 5, "output_tokens": 1, "cache_read_input_tokens": 7, "cache_creation_input_tokens": 2}


class FakeMessages:
    """Answers ``POST /v1/messages`` (plain or streamed) and keeps every request's headers."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []

    def handle(self, request: Any) -> Any:
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                   "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn", "stop_sequence": None,
                   "usage": USAGE}
        if not json.loads(request.content).get("stream"):
            return httpx2.Response(200, json=message)
        events = [("message_start", {"type": "message_start", "message": {**message, "content": []}}),
                  ("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}}),
                  ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": {"type": "text_delta", "text": "ok"}}),
                  ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                  ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                     "usage": {"output_tokens": 1}}),
                  ("message_stop", {"type": "message_stop"})]
        body = "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events)
        return httpx2.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})

    def client(self) -> Any:
        http = httpx2.Client(transport=httpx2.MockTransport(self.handle))
        return anthropic.Anthropic(api_key="x", base_url=BASE_URL, http_client=http, max_retries=0)

    def async_client(self) -> Any:
        http = httpx2.AsyncClient(transport=httpx2.MockTransport(self.handle))
        return anthropic.AsyncAnthropic(api_key="x", base_url=BASE_URL, http_client=http, max_retries=0)

    def tags(self) -> list[tuple[str | None, ...]]:
        keys = ("x-agentkv-agent", "x-agentkv-session", "x-agentkv-parent", "x-agentkv-step", "x-session-id")
        return [tuple(h.get(k) for k in keys) for h in self.headers]


def _ask(client: Any, **kwargs: Any) -> Any:
    return client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}], **kwargs)


def test_install_wraps_the_anthropic_clients_too():
    from anthropic import _base_client

    assert install()
    for cls in (_base_client.SyncAPIClient, _base_client.AsyncAPIClient):
        for method in ("_prepare_options", "_process_response"):
            hook = getattr(cls, method)
            assert getattr(hook, "__agentkv_wrapped__", None) is not None, (cls, method)
            assert getattr(hook.__agentkv_wrapped__, "__agentkv_wrapped__", None) is None  # wrapped once
    assert asyncio.iscoroutinefunction(_base_client.AsyncAPIClient._prepare_options)


def test_anthropic_is_patched_once_the_app_imports_it_and_never_imported_by_agentkv():
    """Its import takes ~1 s: an app that only uses openai must not pay it. Imported after the
    first tag scope, it is patched at the next one. (A fresh interpreter: this one imported it.)"""
    code = """if True:
        import sys
        import agentkv
        with agentkv.agent("planner", session="s"):
            pass
        assert "anthropic" not in sys.modules
        from anthropic import _base_client
        assert not hasattr(_base_client.SyncAPIClient._prepare_options, "__agentkv_wrapped__")
        with agentkv.agent("coder", session="s"):
            assert hasattr(_base_client.SyncAPIClient._prepare_options, "__agentkv_wrapped__")
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_messages_are_tagged_plain_streamed_and_async():
    server = FakeMessages()
    client = server.client()
    _ask(client)  # untagged: no agentkv header at all
    with agentkv.agent("planner", session="s-anthropic"):
        assert _ask(client).content[0].text == "ok"
    with agentkv.agent("coder", session="s-anthropic"):
        with client.messages.stream(model="m", max_tokens=5, messages=[{"role": "user", "content": "go"}]) as stream:
            assert stream.get_final_text() == "ok"

    async def ask_async() -> None:
        with agentkv.agent("reviewer", session="s-anthropic"):
            await server.async_client().messages.create(model="m", max_tokens=5,
                                                        messages=[{"role": "user", "content": "check"}])

    asyncio.run(ask_async())
    assert server.tags() == [
        (None, None, None, None, None),
        ("planner", "s-anthropic", "", "1", "s-anthropic"),
        ("coder", "s-anthropic", "planner", "2", "s-anthropic"),
        ("reviewer", "s-anthropic", "coder", "3", "s-anthropic"),
    ]


def test_explicit_headers_win():
    server = FakeMessages()
    with agentkv.agent("planner", session="s-explicit") as tag:
        assert tag is not None
        _ask(server.client(), extra_headers={"X-AgentKV-Agent": "mine", "X-AgentKV-Session": "own"})
    assert server.tags() == [("mine", "own", None, None, None)]


def test_the_response_listener_reads_the_messages_usage():
    seen: list[TaggedResponse] = []
    unsubscribe = agentkv.client.on_response(seen.append)
    try:
        with agentkv.agent("planner", session="s-usage"):
            _ask(FakeMessages().client())
    finally:
        unsubscribe()
    assert [(r.tag.agent, r.url, r.prompt_tokens, r.cached_tokens, r.streamed) for r in seen] == [
        ("planner", "/v1/messages", 5 + 7 + 2, 7, False)]


@pytest.mark.parametrize(("usage", "expected"), [
    ({"input_tokens": 5, "output_tokens": 1}, (5, None)),  # vLLM without --enable-prompt-tokens-details
    ({"input_tokens": 5, "cache_read_input_tokens": 7}, (12, 7)),
    ({"input_tokens": 5, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 3}, (8, 0)),
    ({"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}}, (9, 4)),  # a Responses API usage
    ({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}, (9, 4)),
    ({"input_tokens": True, "cache_read_input_tokens": "7"}, (None, None)),
])
def test_usage_of_each_api(usage, expected):
    assert usage_of({"usage": usage}) == expected
