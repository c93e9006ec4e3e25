"""A Responses API request as the chat request vLLM renders it, so that its anchor can be learned.

vLLM (0.32, 0.33) renders ``POST /v1/responses`` through the model's chat template like a chat
completion: ``instructions`` become the system message, a string ``input`` the user message, each
input message a chat message (an assistant's the text of its first part), and function tools take
the chat form ``{"type": "function", "function": {...}}``. ``reasoning.effort`` reaches the
template as ``reasoning_effort`` (and ``enable_thinking``).

Only the input up to the first item of another kind (a function call, its output, a reasoning
item) is converted, rendered without a generation prompt: the messages before that item render
the same whatever follows them, and an anchor is a prefix the calls share, so it lies in them.
A request continuing a stored response (``previous_response_id``, ``conversation``) has history
only the server knows: it is not converted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["chat_form"]

_TEMPLATE_ROLES = frozenset({"system", "developer", "user", "assistant"})


def chat_form(body: Any) -> dict[str, Any] | None:
    """The chat-completions body that renders as ``body`` (a Responses API request) does, up to its
    first input item that is not a message; None when there is nothing to render from the body."""
    if not isinstance(body, Mapping) or body.get("previous_response_id") is not None \
            or body.get("conversation") is not None:
        return None
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    whole = True
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, Sequence):
        for item in items:
            message = _message(item, messages[-1] if messages else None)
            if message is None:
                whole = False
                break
            messages.append(message)
    if not messages:
        return None
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = [_tool(t) for t in body.get("tools") or () if isinstance(t, Mapping) and t.get("type") == "function"]
    if tools:
        chat["tools"] = tools
        if isinstance(body.get("tool_choice"), str):  # "auto", "none", "required": the same in both APIs
            chat["tool_choice"] = body["tool_choice"]
    reasoning = body.get("reasoning")
    return with_render_options(chat, body, effort=reasoning.get("effort") if isinstance(reasoning, Mapping) else None,
                               whole=whole)


def with_render_options(chat: dict[str, Any], body: Mapping[str, Any], *, effort: Any, whole: bool) -> dict[str, Any]:
    """``chat`` plus what else of ``body`` vLLM renders or caches by: its template kwargs with the
    reasoning ``effort`` merged over them, no generation prompt when the messages were cut
    (``whole`` False), its ``cache_salt``."""
    kwargs = dict(body["chat_template_kwargs"]) if isinstance(body.get("chat_template_kwargs"), Mapping) else {}
    if effort is not None:  # vLLM merges these over the request's own kwargs (enable_thinking unless given)
        kwargs = {"enable_thinking": effort != "none", **kwargs, "reasoning_effort": effort}
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    if not whole:
        chat["add_generation_prompt"] = False
    if body.get("cache_salt") is not None:
        chat["cache_salt"] = body["cache_salt"]
    return chat


def _message(item: Any, previous: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The chat message of one input item, or None for an item that is not a plain message (or
    one vLLM would merge into the assistant message before it)."""
    if not isinstance(item, Mapping) or item.get("role") not in _TEMPLATE_ROLES \
            or item.get("type", "message") != "message":
        return None
    if item["role"] != "assistant":
        return {k: v for k, v in item.items() if k != "type"}
    if previous is not None and previous.get("role") == "assistant":
        return None
    content = item.get("content")
    if isinstance(content, Sequence) and not isinstance(content, str) and content \
            and isinstance(content[0], Mapping):
        content = content[0].get("text")
    return {"role": "assistant", "content": content} if isinstance(content, str) else None


def _tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
