"""A real vLLM server on CPU reports prefix-cache hits through the OpenAI SDK."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from agentkv.testing.vllm_server import VLLMServer

BLOCK_SIZE = 32


def _system_prompt(n_words: int = 580) -> str:
    rng = random.Random(1234)
    words = "agent tool cache block prefix plan search answer memory session user model".split()
    return "You are a careful planning agent. " + " ".join(rng.choice(words) for _ in range(n_words))


@pytest.mark.server
def test_second_request_hits_the_shared_prefix(vanilla_server: VLLMServer) -> None:
    assert vanilla_server.base_url.startswith("http://127.0.0.1:")
    client = openai.OpenAI(
        base_url=vanilla_server.base_url + "/v1",
        api_key="x",
        http_client=httpx.Client(trust_env=False),  # loopback only, never a proxy
    )
    system = _system_prompt()

    def ask(question: str) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model="tiny",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=1,
            temperature=0.0,
        )

    first = ask("What is the first step?")
    second = ask("And what comes after that?")

    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens >= 550, first.usage
    first_cached = first.usage.prompt_tokens_details.cached_tokens or 0
    second_cached = second.usage.prompt_tokens_details.cached_tokens or 0
    print(f"prompt_tokens={first.usage.prompt_tokens}/{second.usage.prompt_tokens} "
          f"cached_tokens={first_cached}/{second_cached} startup={vanilla_server.startup_seconds:.1f}s")
    assert first_cached < BLOCK_SIZE * 2
    assert second_cached >= 512
    assert second_cached % BLOCK_SIZE == 0
    assert second_cached <= second.usage.prompt_tokens
