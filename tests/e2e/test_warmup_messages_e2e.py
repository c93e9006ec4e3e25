"""Warm-up of an agent that calls Anthropic's Messages API (``ChatAnthropic``, the anthropic SDK), on a real server.

The coordinator learns the agent's anchor from its ``client.messages.create`` calls (rendered as
vLLM renders them: the system text as the system message, the tools in chat form), the cache is
filled until that anchor is cold, and the warm-up makes the agent's next call hit all of it.
"""

from __future__ import annotations

import uuid

import pytest

anthropic = pytest.importorskip("anthropic")
httpx2 = pytest.importorskip("httpx2")

import agentkv  # noqa: E402
from agentkv.warmup import WarmupCoordinator  # noqa: E402

from ._util import BLOCK, fill_cache, instructions  # noqa: E402

pytestmark = pytest.mark.server

SEARCH = {"name": "search", "description": "Search the docs.",
          "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}


def test_a_warmed_anchor_of_messages_calls_is_hit(agentkv_server) -> None:
    base = agentkv_server.base_url
    run = uuid.uuid4().hex[:8]
    coder, system = f"coder-{run}", instructions("coder", run, sentences=30)
    with httpx2.Client(trust_env=False, timeout=120) as http, WarmupCoordinator(base) as coordinator:
        client = anthropic.Anthropic(base_url=base, api_key="x", http_client=http, max_retries=0)

        def call(session: str) -> int:
            with agentkv.agent(coder, session=session):
                response = client.messages.create(model="tiny", system=system, max_tokens=1, tools=[SEARCH],
                                                  tool_choice={"type": "none"},
                                                  messages=[{"role": "user", "content": f"the task of {session}"}])
            return response.usage.cache_read_input_tokens or 0

        call(f"{run}-1")
        call(f"{run}-2")  # a second session: the anchor is what the two share
        fill_cache(base, run)
        coordinator.warm(coder)
        assert coordinator.flush(30)
        stats = coordinator.stats()
        hit = call(f"{run}-3")
    [warm] = stats["recent"]
    print(f"\nanchor {warm['anchor_tokens']} tokens ({warm['source']}); warm-up cached_tokens "
          f"{warm['cached_tokens']} (cold); the next call's cache_read_input_tokens {hit}")
    assert warm["agent"] == coder and warm["source"] == "cross-session"
    assert warm["anchor_tokens"] >= 10 * BLOCK  # the system text and the tool
    assert warm["cached_tokens"] < warm["anchor_tokens"]  # the anchor was cold right before the warm-up
    assert hit >= warm["anchor_tokens"]
    assert stats["sent"] == 1 and stats["failed"] == 0 and stats["errors"] == {}
