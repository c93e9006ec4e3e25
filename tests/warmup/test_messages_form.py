"""An Anthropic Messages API request in the chat form vLLM renders it in (the anchor book's view of it)."""

from __future__ import annotations

from typing import Any

import pytest

from agentkv.frameworks import TaggedRequest
from agentkv.protocol import AgentTag
from agentkv.warmup import AnchorBook
from agentkv.warmup._messages import chat_form

from ._fake_vllm import BASE, FakeVLLM, render_tokens, tokenizer_of

SYSTEM = "You are the coder. Write small, correct functions and explain nothing. " * 3
SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
SEARCH = {"name": "search", "description": "Search the docs.", "input_schema": SCHEMA}
SEARCH_CHAT = {"type": "function", "function": {"name": "search", "description": "Search the docs.",
                                                "parameters": SCHEMA}}
TOOL_USE = [{"type": "text", "text": "looking"},
            {"type": "tool_use", "id": "t1", "name": "search", "input": {"q": "x"}}]
TOOL_RESULT = [{"type": "tool_result", "tool_use_id": "t1", "content": "found"}]


def messages(user: str = "task", **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 5, "system": SYSTEM, "messages": [{"role": "user", "content": user}],
            "tools": [SEARCH], **extra}


def test_system_messages_and_tools_in_chat_form():
    assert chat_form(messages(tool_choice={"type": "any"})) == {
        "model": "tiny", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "task"}],
        "tools": [SEARCH_CHAT], "tool_choice": "required"}
    assert chat_form(messages())["tool_choice"] == "auto"  # tools without a choice: vLLM's default


def test_messages_up_to_the_first_that_is_not_plain_text():
    body = {"model": "tiny", "max_tokens": 5, "cache_salt": "tenant-1",
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=42;"},
                       {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "example"},
                                                      {"type": "text", "text": " question"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "example answer"}]},
                         {"role": "user", "content": "the task"},
                         {"role": "assistant", "content": TOOL_USE},
                         {"role": "user", "content": TOOL_RESULT}],
            "tool_choice": {"type": "tool", "name": "search"}, "tools": [SEARCH]}
    form = chat_form(body)
    assert form == {
        "model": "tiny",
        "messages": [{"role": "system", "content": SYSTEM},  # the per-request billing header dropped
                     {"role": "user", "content": [{"type": "text", "text": "example"},
                                                  {"type": "text", "text": " question"}]},
                     {"role": "assistant", "content": "example answer"},
                     {"role": "user", "content": "the task"}],
        "tools": [SEARCH_CHAT], "tool_choice": {"type": "function", "function": {"name": "search"}},
        "add_generation_prompt": False,  # cut before the tool use: what follows renders on
        "cache_salt": "tenant-1"}
    more = [*body["messages"], {"role": "assistant", "content": "done"}]
    assert chat_form({**body, "messages": more}) == form  # what follows the cut changes nothing


def test_effort_and_disabled_thinking_reach_the_template():
    assert chat_form(messages(output_config={"effort": "low"}))["chat_template_kwargs"] == {
        "enable_thinking": True, "reasoning_effort": "low"}
    assert chat_form(messages(output_config={"effort": "high"}, thinking={"type": "disabled"},
                              chat_template_kwargs={"enable_thinking": True}))["chat_template_kwargs"] == {
        "enable_thinking": True, "reasoning_effort": "none"}


@pytest.mark.parametrize("body", [
    {"model": "tiny", "messages": [{"role": "assistant", "content": TOOL_USE}]},  # nothing before the cut
    messages(tools=[{"type": "web_search_20250305", "name": "web_search"}]),  # a server tool: not rendered here
    {**messages(), "messages": [{"role": "user", "content": [
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "search"}}]}]},  # changes the tools
    messages(system=[{"type": "text", "text": SYSTEM}, "not a block"]),
    {"model": "tiny", "messages": []},
    {"model": "tiny", "prompt": "not a Messages request"},
    ["not", "a", "body"],
])
def test_requests_with_nothing_to_render_from_the_body(body):
    assert chat_form(body) is None


# Each body as vLLM converts it (its own converter, 0.32 and 0.33) and as ``chat_form`` does
# must render alike: the same messages (up to the cut), tools, tool choice and template kwargs.
SAME_AS_VLLM = [
    messages(),
    messages(tool_choice={"type": "none"}, output_config={"effort": "medium"}),
    messages(system=None, thinking={"type": "disabled"}, chat_template_kwargs={"enable_thinking": True}),
    {"model": "tiny", "max_tokens": 5, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
     "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]},  # dropped by vLLM
                  {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
                  {"role": "assistant", "content": "plain"},
                  {"role": "user", "content": TOOL_RESULT}],
     "tools": [{**SEARCH, "strict": True}, {"name": "run", "input_schema": {"type": "object"}}],
     "tool_choice": {"type": "tool", "name": "run", "disable_parallel_tool_use": True}},
]


@pytest.mark.parametrize("body", SAME_AS_VLLM)
def test_the_chat_form_renders_as_vllm_converts(body):
    serving = pytest.importorskip("vllm.entrypoints.anthropic.serving")
    protocol = pytest.importorskip("vllm.entrypoints.anthropic.protocol")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    theirs = serving.AnthropicServingMessages.to_chat_completion_request(
        protocol.AnthropicMessagesRequest.model_validate(body))
    form = chat_form(body)
    assert form is not None
    whole = form.pop("add_generation_prompt", True)
    ours = ChatCompletionRequest.model_validate(form)
    assert ours.messages == (theirs.messages if whole else theirs.messages[:len(ours.messages)])
    if not whole:
        assert len(theirs.messages) > len(ours.messages)
    assert [t.model_dump() for t in ours.tools or ()] == [t.model_dump() for t in theirs.tools or ()]
    assert ours.tool_choice == theirs.tool_choice
    assert ours.build_chat_params(None, "auto").chat_template_kwargs == \
        theirs.build_chat_params(None, "auto").chat_template_kwargs


def test_the_anchor_of_messages_calls_is_what_the_chat_form_renders():
    fake = FakeVLLM(block_size=16)
    book = AnchorBook(base_url=BASE, block_size=16)
    for session in ("s1", "s2"):
        book.observe(TaggedRequest(AgentTag("coder", session), "post", "/v1/messages", BASE,
                                   messages(user=f"the task of {session}")))
    book.observe(TaggedRequest(AgentTag("coder", "s3"), "post", "/v1/messages", BASE,
                               messages(tools=[{"type": "bash_20250124", "name": "bash"}])))
    assert book.stats()["captured"] == 2 and book.stats()["ignored"] == 1
    anchor = book.resolve("coder", tokenizer_of(fake))
    fixed = render_tokens(fake, [{"role": "system", "content": SYSTEM}], [SEARCH_CHAT], add_generation_prompt=False)
    assert anchor is not None and anchor.source == "cross-session"
    assert anchor.length >= len(fixed) // 16 * 16 > 0
    assert list(anchor.tokens[:len(fixed)]) == fixed[:anchor.length]
