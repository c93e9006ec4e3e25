"""Snapshots of a request's prompt-determining fields, as canonical JSON (key order kept).

Invariant: two calls whose :class:`Structure` is equal render the same leading content (the
template renders dicts in their key order, so key order is part of the structure).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["CACHE_KEYS", "Snapshot", "Structure", "dumps", "dumps_sorted", "snapshot", "template_kwargs", "tool_name"]

# Request fields that change how a chat request is rendered into tokens (vLLM chat + tokenize APIs).
CHAT_RENDER_KEYS: Final = (
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "reasoning_effort",
    "mm_processor_kwargs",
)
# Chat fields vLLM's chat endpoint passes to the template as kwargs (/tokenize has no such field)
_TEMPLATE_FIELDS: Final = ("documents", "reasoning_effort")
_UNSET: Final = (None, "auto")  # vLLM's merge_kwargs leaves these out
TOKENIZE_CHAT_KEYS: Final = frozenset(
    {"messages", "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
     "continue_final_message", "add_special_tokens", "mm_processor_kwargs"}
)
# Fields that must be identical for two calls to share cached blocks, without being rendered.
CACHE_KEYS: Final = ("cache_salt",)


def dumps(value: Any) -> str:
    """Canonical JSON *keeping key order* (the template renders dicts in their order)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def dumps_sorted(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False)


@dataclass(frozen=True, slots=True)
class Structure:
    """The prompt-determining parts of one call as canonical JSON strings (key order kept)."""

    kind: str  # "chat" | "completion"
    model: str | None
    first: str | None  # messages[0] (chat)
    tools: tuple[str, ...] = ()
    tool_names: tuple[str, ...] = ()
    options: tuple[tuple[str, str], ...] = ()  # (key, canonical JSON) of render/cache options


def tool_name(tool: Any) -> str:
    if isinstance(tool, Mapping):
        fn = tool.get("function")
        if isinstance(fn, Mapping) and fn.get("name"):
            return str(fn["name"])
        if tool.get("name"):
            return str(tool["name"])
    return "?"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One request's :class:`Structure` plus what is needed to tokenize the whole call later.

    ``body`` is the request body, only read: :meth:`payload` and :meth:`prompt_ids` serialize the
    whole call, so they are only called for the calls kept for tokenization (the first call of each
    session) and the long histories of later calls are never copied.
    """

    structure: Structure
    extra: dict[str, Any]  # body fields that must repeat to hit the same blocks (cache_salt)
    first_role: str | None  # role of messages[0] (chat)
    body: Mapping[str, Any]

    def payload(self) -> str:
        """JSON of the ``POST /tokenize`` body that renders the whole call (without model)."""
        body = self.body
        if self.structure.kind == "chat":
            payload: dict[str, Any] = {"messages": list(body["messages"])}
            tools = body.get("tools") or []
            if tools:
                payload["tools"] = list(tools)
            for key in CHAT_RENDER_KEYS:
                if body.get(key) is not None and key in TOKENIZE_CHAT_KEYS:
                    payload[key] = body[key]
            kwargs = template_kwargs(body)
            if kwargs:
                payload["chat_template_kwargs"] = kwargs
            return dumps(payload)
        if isinstance(body.get("prompt"), str):
            payload = {"prompt": body["prompt"]}
            if body.get("add_special_tokens") is not None:
                payload["add_special_tokens"] = body["add_special_tokens"]
            return dumps(payload)
        return "{}"

    def prompt_ids(self) -> tuple[int, ...] | None:
        """The token ids of a completions prompt given as ids (None for text prompts and chat)."""
        prompt = self.body.get("prompt")
        if self.structure.kind == "chat" or isinstance(prompt, str):
            return None
        if not all(_is_int(t) for t in prompt):
            raise ValueError("a token-id prompt must hold integers only")
        return tuple(prompt)


def template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The template kwargs vLLM's chat endpoint renders ``body`` with: its ``chat_template_kwargs``
    with ``documents`` and ``reasoning_effort`` (and ``enable_thinking`` unless given) merged over
    them, as ``ChatCompletionRequest.build_chat_params`` does (vLLM 0.32, 0.33)."""
    given = body.get("chat_template_kwargs")
    kwargs = dict(given) if isinstance(given, Mapping) else {}
    effort = body.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = effort != "none"
    kwargs.update((k, body[k]) for k in _TEMPLATE_FIELDS if body.get(k) not in _UNSET)
    return kwargs


def snapshot(body: Any) -> Snapshot | None:
    """The snapshot of a chat or completions request body (None: not one this can warm)."""
    if not isinstance(body, Mapping):
        return None
    model = body.get("model")
    model = None if model is None else str(model)
    extra = {k: body[k] for k in CACHE_KEYS if body.get(k) is not None}
    messages = body.get("messages")
    if isinstance(messages, Sequence) and not isinstance(messages, str | bytes) and messages:
        tools = body.get("tools") or []  # None and [] render alike; [] is never sent back (vLLM rejects it)
        options = tuple(
            (k, dumps(body[k])) for k in (*CHAT_RENDER_KEYS, *CACHE_KEYS)
            if body.get(k) is not None and k not in ("add_generation_prompt", "continue_final_message")
        )
        first = messages[0]
        structure = Structure("chat", model, dumps(first), tuple(dumps(t) for t in tools),
                              tuple(tool_name(t) for t in tools), options)
        role = first.get("role") if isinstance(first, Mapping) else None
        return Snapshot(structure, extra, None if role is None else str(role), body)
    prompt = body.get("prompt")
    options = tuple((k, dumps(body[k])) for k in CACHE_KEYS if body.get(k) is not None)
    ids = isinstance(prompt, Sequence) and bool(prompt) and _is_int(prompt[0])
    if isinstance(prompt, str) or ids:
        return Snapshot(Structure("completion", model, None, (), (), options), extra, None, body)
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
