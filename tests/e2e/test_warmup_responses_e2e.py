"""Warm-up of an agent that calls the Responses API (the OpenAI Agents SDK's default), on a real server.

The coordinator learns the agent's anchor from its ``client.responses.create`` calls (rendered as
vLLM renders them: instructions as the system message, the function tools in chat form), the cache
is filled until that anchor is cold, and the warm-up makes the agent's next call hit all of it.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from openai import OpenAI

import agentkv
from agentkv.warmup import WarmupCoordinator

from ._util import BLOCK, fill_cache, instructions

pytestmark = pytest.mark.server

SEARCH = {"type": "function", "name": "search", "description": "Search the docs.",
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}


def test_a_warmed_anchor_of_responses_calls_is_hit(agentkv_server) -> None:
    base = agentkv_server.base_url
    run = uuid.uuid4().hex[:8]
    coder, system = f"coder-{run}", instructions("coder", run, sentences=30)
    with httpx.Client(trust_env=False, timeout=120) as http, WarmupCoordinator(base) as coordinator:
        client = OpenAI(base_url=base + "/v1", api_key="x", http_client=http)

        def call(session: str) -> int:
            with agentkv.agent(coder, session=session):
                response = client.responses.create(model="tiny", instructions=system, input=f"the task of {session}",
                                                   tools=[SEARCH], tool_choice="none", max_output_tokens=1)
            assert response.usage is not None
            return response.usage.input_tokens_details.cached_tokens

        call(f"{run}-1")
        call(f"{run}-2")  # a second session: the anchor is what the two share
        fill_cache(base, run)
        coordinator.warm(coder)
        assert coordinator.flush(30)
        stats = coordinator.stats()
        hit = call(f"{run}-3")
    [warm] = stats["recent"]
    print(f"\nanchor {warm['anchor_tokens']} tokens ({warm['source']}); warm-up cached_tokens "
          f"{warm['cached_tokens']} (cold); the next call's cached_tokens {hit}")
    assert warm["agent"] == coder and warm["source"] == "cross-session"
    assert warm["anchor_tokens"] >= 10 * BLOCK  # the instructions and the tool
    assert warm["cached_tokens"] < warm["anchor_tokens"]  # the anchor was cold right before the warm-up
    assert hit >= warm["anchor_tokens"]
    assert stats["sent"] == 1 and stats["failed"] == 0 and stats["errors"] == {}
