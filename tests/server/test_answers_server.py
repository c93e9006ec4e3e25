"""A real ``agentkv serve`` with vLLM's tool parser learns which tagged answers called a tool."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

import agentkv
import agentkv.client
from agentkv.client import TaggedResponse
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


# the same tool in the Responses API and in Anthropic's Messages API, which vLLM serves too
RESPONSES_TOOLS = [{"type": "function", "name": "search", "parameters": TOOLS[0]["function"]["parameters"]}]
RESPONSES_NAMED = {"type": "function", "name": "search"}
MESSAGES_TOOLS = [{"name": "search", "input_schema": TOOLS[0]["function"]["parameters"]}]


def _request(path: str, system: str, question: str, *, call: bool, stream: bool = False) -> dict[str, object]:
    """A request to ``path`` offering the search tool, naming it (``call``) or ruling it out."""
    if path == "/v1/responses":  # seeded: vLLM 0.32 drops a non-streamed call whose random arguments do not parse
        return {"model": "tiny", "instructions": system, "input": question, "tools": RESPONSES_TOOLS, "seed": 7,
                "tool_choice": RESPONSES_NAMED if call else "none", "max_output_tokens": 300, "stream": stream}
    if path == "/v1/messages":  # vLLM 0.32 fails a non-streamed tool_use of this random model: streamed
        choice = {"type": "tool", "name": "search"} if call else {"type": "none"}
        return {"model": "tiny", "system": system, "messages": [{"role": "user", "content": question}],
                "tools": MESSAGES_TOOLS, "tool_choice": choice, "max_tokens": 300, "stream": True}
    return {"model": "tiny", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "tools": TOOLS, "tool_choice": NAMED if call else "none", "max_tokens": 300, "seed": 7, "stream": stream}


@pytest.mark.parametrize(("path", "call", "stream"), [
    ("/v1/responses", True, False), ("/v1/responses", True, True), ("/v1/responses", False, False),
    ("/v1/messages", True, True), ("/v1/messages", False, True),
])
def test_tags_and_answers_of_the_responses_and_messages_apis(tool_server, path, call, stream):
    """The OpenAI SDK's ``responses.create`` (the OpenAI Agents SDK's default) and Anthropic clients:
    the same headers tag the request (here a client of its own sends those of ``agentkv.agent``'s
    tag), and how it was answered reaches the engine."""
    session = f"s{path[4:8]}{call}{stream}"
    with httpx.Client(base_url=tool_server.base_url, timeout=120, trust_env=False) as client:
        time.sleep(STATS_MAX_AGE)
        before = client.get(STATS_PATH).json()
        with agentkv.agent("coder", session=session) as tag:
            assert tag is not None
            client.post(path, json=_request(path, "be brief", "look it up", call=call, stream=stream),
                        headers=tag.to_headers()).raise_for_status()
        wait_for(lambda: _answers(client) != before["answers"], "the answer to be told to the engine")
        after = client.get(STATS_PATH).json()
    assert after["tagged_requests"] - before["tagged_requests"] == 1
    kind = "tool_call" if call else "no_tool_call"
    assert {k: after["answers"].get(k, 0) - before["answers"].get(k, 0) for k in ("tool_call", "no_tool_call")} == {
        "tool_call": int(kind == "tool_call"), "no_tool_call": int(kind == "no_tool_call")}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_untagged_answers_reach_the_recognized_session(tool_server, path):
    """A client that sends no agentkv metadata at all: recognition finds the agent from the shared
    system prompt, and the middleware tells its answer by the response id."""
    system = f"{path}: " + " ".join(f"rule {i}: answer tersely and cite the tool output verbatim." for i in range(40))
    with httpx.Client(base_url=tool_server.base_url, timeout=120, trust_env=False) as client:
        def ask(question: str, call: bool) -> None:
            # the call streamed: a streamed response shows its function call before its arguments,
            # which this random model may leave unparsable (2 of 10 unseeded calls lose the call)
            request = _request(path, system, question, call=call, stream=call and path == "/v1/responses")
            client.post(path, json=request).raise_for_status()

        for i in range(6):  # recognition learns the shared preamble from the traffic
            ask(f"question number {i} about the weather", False)
        time.sleep(STATS_MAX_AGE)
        before = client.get(STATS_PATH).json()
        ask("look it up", True)
        wait_for(lambda: _answers(client).get("tool_call", 0) > before["answers"].get("tool_call", 0),
                 "the untagged answer to be told to the engine")
        after = client.get(STATS_PATH).json()
    assert before["recognition"]["recognized_requests"] >= 1
    assert after["answers"].get("tool_call", 0) - before["answers"].get("tool_call", 0) == 1


def test_the_sdk_tags_responses_create_and_reads_its_usage(tool_server):
    """``client.responses.create`` inside ``agentkv.agent``: tagged like a chat completion (the
    server learns the hand-off), and the response listener reads the Responses API's usage."""
    seen: list[TaggedResponse] = []
    unsubscribe = agentkv.client.on_response(seen.append)
    instructions = " ".join(["plan the work step by step."] * 30)
    try:
        with httpx.Client(trust_env=False, timeout=120) as http:
            client = OpenAI(base_url=tool_server.base_url + "/v1", api_key="x", http_client=http)
            for agent in ("planner", "planner", "writer"):
                with agentkv.agent(agent, session="sdk-responses"):
                    client.responses.create(model="tiny", instructions=instructions, input="go",
                                            max_output_tokens=2)
    finally:
        unsubscribe()
    assert [(r.tag.agent, r.tag.session) for r in seen] == [("planner", "sdk-responses")] * 2 + [
        ("writer", "sdk-responses")]
    assert seen[0].prompt_tokens == seen[1].prompt_tokens > 0
    assert seen[1].cached_tokens >= 32  # the instructions, cached by the first call
    with httpx.Client(base_url=tool_server.base_url, timeout=30, trust_env=False) as client:
        wait_for(lambda: client.get(STATS_PATH).json()["transitions"].get("planner", {}).get("writer", 0) > 0,
                 "the planner -> writer hand-off to be learned")
