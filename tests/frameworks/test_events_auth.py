"""The event sink authenticates like an OpenAI client of a vLLM started with ``--api-key``."""

from __future__ import annotations

import httpx
import pytest

from agentkv.frameworks._events import EventSink, session_event


def _sink_seeing(seen: list[str | None], **kwargs: object) -> EventSink:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Authorization"))
        return httpx.Response(200, json={"accepted": 1, "duplicates": 0})

    return EventSink("http://127.0.0.1:9", transport=httpx.MockTransport(answer), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("env", "argument", "expected"), [
    ("from-env", None, "Bearer from-env"),
    ("from-env", "explicit", "Bearer explicit"),
    (None, None, None),
    ("from-env", "", None),
])
def test_the_key_comes_from_the_argument_or_vllm_api_key(monkeypatch, env, argument, expected):
    if env is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", env)
    seen: list[str | None] = []
    sink = _sink_seeing(seen, api_key=argument)
    sink.post([session_event("session_end", "s1")])
    sink.close(timeout=5)
    assert seen == [expected] and sink.sent == 1
