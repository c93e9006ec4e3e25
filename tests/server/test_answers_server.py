"""A real ``agentkv serve`` with vLLM's tool parser learns which tagged answers called a tool."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentkv.protocol import STATS_MAX_AGE, STATS_PATH
from agentkv.testing.server_stats import wait_for
from agentkv.testing.vllm_server import ServerSpec, VLLMServer

pytestmark = pytest.mark.server

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"]}}}]
NAMED = {"type": "function", "function": {"name": "search"}}


@pytest.fixture(scope="module")
def tool_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    spec = ServerSpec(model_dir=tiny_model_dir, num_gpu_blocks=81, module="agentkv.serve",
                      extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    with VLLMServer(spec, log_path=tmp_path_factory.mktemp("answers") / "vllm.log") as running:
        yield running


def _answers(client: httpx.Client) -> dict[str, int]:
    return client.get(STATS_PATH).json()["answers"]


@pytest.mark.parametrize(("tool_choice", "stream", "kind"), [
    (NAMED, False, "tool_call"),  # vLLM answers a named tool choice with finish_reason stop
    (NAMED, True, "tool_call"),  # streamed: the tool_calls delta tells
    ("none", False, "no_tool_call"),  # tools offered, none called
])
def test_tagged_answers_are_told_to_the_engine(tool_server, tool_choice, stream, kind):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "look it up"}], "tools": TOOLS,
            "tool_choice": tool_choice, "max_tokens": 300, "seed": 7, "stream": stream}
    headers = {"X-AgentKV-Agent": "coder", "X-AgentKV-Session": f"s-{kind}-{stream}"}
    with httpx.Client(base_url=tool_server.base_url, timeout=120, trust_env=False) as client:
        time.sleep(STATS_MAX_AGE)  # a fresh document: one served again could predate earlier answers
        before = _answers(client)
        client.post("/v1/chat/completions", json=body, headers=headers).raise_for_status()
        # told in the background after the answer reached the client, and stats are served again
        # for up to STATS_MAX_AGE: poll until the count moves
        wait_for(lambda: _answers(client) != before, "the answer to be told to the engine")
        after = _answers(client)
    assert {k: after.get(k, 0) - before.get(k, 0) for k in ("tool_call", "no_tool_call")} == {
        "tool_call": int(kind == "tool_call"), "no_tool_call": int(kind == "no_tool_call")}


def test_untagged_answers_reach_the_recognized_session(tool_server):
    """A client that sends no agentkv metadata at all: recognition finds the agent from the shared
    system prompt, and the middleware tells its answer by the response id."""
    system = " ".join(f"rule {i}: answer tersely and cite the tool output verbatim." for i in range(40))
    with httpx.Client(base_url=tool_server.base_url, timeout=120, trust_env=False) as client:
        def ask(question: str, tool_choice: object) -> None:
            body = {"model": "tiny", "messages": [{"role": "system", "content": system},
                                                  {"role": "user", "content": question}],
                    "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 300, "seed": 7}
            client.post("/v1/chat/completions", json=body).raise_for_status()

        for i in range(6):  # recognition learns the shared preamble from the traffic
            ask(f"question number {i} about the weather", "none")
        time.sleep(STATS_MAX_AGE)
        before = client.get(STATS_PATH).json()
        ask("look it up", NAMED)
        wait_for(lambda: _answers(client).get("tool_call", 0) > before["answers"].get("tool_call", 0),
                 "the untagged answer to be told to the engine")
        after = client.get(STATS_PATH).json()
    assert before["recognition"]["recognized_requests"] >= 1
    assert after["answers"].get("tool_call", 0) - before["answers"].get("tool_call", 0) == 1
