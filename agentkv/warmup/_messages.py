"""An Anthropic Messages API request as the chat request vLLM renders it, so that its anchor can be learned.

vLLM (0.32, 0.33) serves ``POST /v1/messages`` as a chat completion
(``AnthropicServingMessages.to_chat_completion_request``): the text blocks of ``system`` become
one system message (a Claude Code billing header block dropped), a message's string content or
single text block its content and several text blocks a list of text parts, the tools the chat
form with ``input_schema`` as ``parameters`` (``"auto"`` when tools come without a
``tool_choice``), and ``output_config.effort`` the template's ``reasoning_effort`` (and
``enable_thinking``). Disabled thinking is taken as ``reasoning_effort="none"``, what
``--anthropic-disabled-thinking-effort auto`` picks unless the template rejects or ignores
``none``; where it picks ``low`` and the two render apart, such an agent's warm-ups miss (the
server counts them wasted).

Only the messages before the first that holds anything but text (a tool use or result, an image,
thinking) or is an inline system message (which vLLM merges into the leading one for some
templates) are converted, rendered without a generation prompt: an anchor is a prefix the calls
share, so it lies in them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._responses import with_render_options

__all__ = ["chat_form"]

_BILLING_HEADER = "x-anthropic-billing-header"  # per-request text vLLM drops to keep the prefix cacheable
_TOOL_CHANGES = frozenset({"tool_addition", "tool_removal"})  # change the tools vLLM renders: not reproduced
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_form(body: Any) -> dict[str, Any] | None:
    """The chat-completions body that renders as ``body`` (a Messages API request) does, up to its
    first message that is not plain text; None when there is nothing to render from the body."""
    if not isinstance(body, Mapping) or not isinstance(body.get("messages"), Sequence):
        return None
    messages: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system is None:
        return None
    if system:
        messages.append({"role": "system", "content": system})
    whole = True
    for item in body["messages"]:
        if _changes_tools(item):
            return None
        message = _message(item)
        if message is None:
            whole = False
            break
        if message:  # a user message of empty text blocks is dropped, as vLLM drops it
            messages.append(message)
    if not messages:
        return None
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = body.get("tools")
    if tools is not None:
        converted = [_tool(tool) for tool in tools] if isinstance(tools, Sequence) else [None]
        if None in converted:
            return None
        chat["tools"] = converted
    choice = _tool_choice(body.get("tool_choice"), has_tools=tools is not None)
    if choice is not None:
        chat["tool_choice"] = choice
    return with_render_options(chat, body, effort=_effort(body), whole=whole)


def _system_text(system: Any) -> str | None:
    """The leading system message's text ("" for none), None for a ``system`` not understood."""
    if system is None or isinstance(system, str):
        return system or ""
    if not isinstance(system, Sequence):
        return None
    parts = []
    for block in system:
        if not isinstance(block, Mapping):
            return None
        text = block.get("text")
        if block.get("type") == "text" and isinstance(text, str) and text and not text.startswith(_BILLING_HEADER):
            parts.append(text)
    return "".join(parts)


def _message(item: Any) -> dict[str, Any] | None:
    """The chat message of a plain-text message ({} for one vLLM drops), or None for a cut."""
    if not isinstance(item, Mapping) or item.get("role") not in ("user", "assistant"):
        return None
    content = item.get("content")
    if isinstance(content, str):
        return {"role": item["role"], "content": content}
    if not isinstance(content, Sequence):
        return None
    parts = []
    for block in content:
        if not isinstance(block, Mapping) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            return None
        if block["text"]:
            parts.append({"type": "text", "text": block["text"]})
    if not parts:  # vLLM drops such a user message, and sends such an assistant's with no content at all
        return {} if item["role"] == "user" else None
    return {"role": item["role"], "content": parts[0]["text"] if len(parts) == 1 else parts}


def _changes_tools(item: Any) -> bool:
    content = item.get("content") if isinstance(item, Mapping) else None
    return isinstance(content, Sequence) and not isinstance(content, str) and any(
        isinstance(block, Mapping) and block.get("type") in _TOOL_CHANGES for block in content)


def _tool(tool: Any) -> dict[str, Any] | None:
    if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str) \
            or not isinstance(tool.get("input_schema"), Mapping):
        return None  # a server tool or a malformed one: what vLLM renders for it is not known here
    fields = {"name": tool["name"], "description": tool.get("description"), "parameters": tool["input_schema"],
              "strict": tool.get("strict"), "defer_loading": tool.get("defer_loading")}  # vLLM's order
    return {"type": "function", "function": {k: v for k, v in fields.items() if v is not None}}


def _tool_choice(choice: Any, *, has_tools: bool) -> Any:
    if not isinstance(choice, Mapping):
        return "auto" if has_tools else None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return _TOOL_CHOICES.get(kind) if isinstance(kind, str) else None


def _effort(body: Mapping[str, Any]) -> str | None:
    """vLLM's ``reasoning_effort``: disabled thinking wins over ``output_config.effort``."""
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") == "disabled":
        return "none"
    config = body.get("output_config")
    effort = config.get("effort") if isinstance(config, Mapping) else None
    return effort if isinstance(effort, str) else None
