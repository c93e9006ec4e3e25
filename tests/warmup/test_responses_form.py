"""A Responses API request in the chat form vLLM renders it in (the anchor book's view of it)."""

from __future__ import annotations

from typing import Any

import pytest

from agentkv.frameworks import TaggedRequest
from agentkv.protocol import AgentTag
from agentkv.warmup import AnchorBook
from agentkv.warmup._responses import chat_form

from ._fake_vllm import BASE, FakeVLLM, render_tokens, tokenizer_of

SYSTEM = "You are the coder. Write small, correct functions and explain nothing. " * 3
PARAMETERS = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
SEARCH = {"type": "function", "name": "search", "description": "Search the docs.", "parameters": PARAMETERS}
SEARCH_CHAT = {"type": "function", "function": {"name": "search", "description": "Search the docs.",
                                                "parameters": PARAMETERS}}


def responses(user: str = "task", **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "instructions": SYSTEM, "input": user, "tools": [SEARCH], **extra}


def test_instructions_input_and_tools_in_chat_form():
    assert chat_form(responses(tool_choice="auto", max_output_tokens=5)) == {
        "model": "tiny", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "task"}],
        "tools": [SEARCH_CHAT], "tool_choice": "auto"}


def test_input_items_up_to_the_first_that_is_not_a_message():
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
        {"type": "message", "role": "user", "content": "example question"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "example answer"}]},
        {"role": "user", "content": "the task"},
        {"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "found"},
    ]
    form = chat_form({"model": "tiny", "input": items, "tools": [SEARCH, {"type": "web_search"}],
                      "tool_choice": {"type": "function", "name": "search"}, "cache_salt": "tenant-1"})
    assert form == {
        "model": "tiny",
        "messages": [{"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
                     {"role": "user", "content": "example question"},
                     {"role": "assistant", "content": "example answer"},
                     {"role": "user", "content": "the task"}],
        "tools": [SEARCH_CHAT],  # only function tools are rendered; a tool choice object is the API's own
        "add_generation_prompt": False,  # cut before the function call: what follows renders on
        "cache_salt": "tenant-1"}
    # what follows the cut changes nothing
    assert chat_form({"model": "tiny", "input": [*items, {"role": "user", "content": "more"}],
                      "tools": [SEARCH, {"type": "web_search"}], "cache_salt": "tenant-1"}) == form


def test_an_assistant_message_after_an_assistant_message_is_a_cut():
    """vLLM merges it into the one before (reasoning, then text): not reproduced, so cut there."""
    items = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
             {"role": "assistant", "content": "b"}]
    assert chat_form({"model": "tiny", "input": items})["messages"] == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_reasoning_effort_reaches_the_template():
    assert chat_form(responses(reasoning={"effort": "low"}))["chat_template_kwargs"] == {
        "reasoning_effort": "low", "enable_thinking": True}
    assert chat_form(responses(reasoning={"effort": "none"},
                               chat_template_kwargs={"enable_thinking": True, "reasoning_effort": "high"}))[
        "chat_template_kwargs"] == {"reasoning_effort": "none", "enable_thinking": True}


@pytest.mark.parametrize("body", [
    responses(previous_response_id="resp_1"),  # the history is stored on the server
    responses(conversation="conv_1"),
    {"model": "tiny", "input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
    {"model": "tiny"},
    ["not", "a", "body"],
])
def test_requests_with_nothing_to_render_from_the_body(body):
    assert chat_form(body) is None


def test_the_anchor_of_responses_calls_is_what_the_chat_form_renders():
    fake = FakeVLLM(block_size=16)
    book = AnchorBook(base_url=BASE, block_size=16)
    for session in ("s1", "s2"):
        book.observe(TaggedRequest(AgentTag("coder", session), "post", "/responses", BASE + "/v1/",
                                   responses(user=f"the task of {session}")))
    book.observe(TaggedRequest(AgentTag("coder", "s3"), "post", "/responses", BASE + "/v1/",
                               responses(previous_response_id="resp_1")))
    assert book.stats()["captured"] == 2 and book.stats()["ignored"] == 1
    anchor = book.resolve("coder", tokenizer_of(fake))
    fixed = render_tokens(fake, [{"role": "system", "content": SYSTEM}], [SEARCH_CHAT], add_generation_prompt=False)
    assert anchor is not None and anchor.source == "cross-session"
    assert anchor.length >= len(fixed) // 16 * 16 > 0
    assert list(anchor.tokens[:len(fixed)]) == fixed[:anchor.length]
