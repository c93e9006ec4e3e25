"""The prefix-stability lint: where an agent's leading content changed between two of its calls."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ._snapshot import Structure, dumps_sorted

__all__ = ["Divergence", "common_prefix", "diff_structures"]

_SNIPPET: Final = 24


def common_prefix(*sequences: Sequence[Any]) -> int:
    """Length of the longest common prefix of all ``sequences`` (0 for none)."""
    if not sequences:
        return 0
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        value = first[i]
        if any(s[i] != value for s in sequences[1:]):
            return i
    return n


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where an agent's leading content or tokens changed between two of its calls."""

    agent: str
    where: str  # "model", "messages[0].content", "tools", "tools[2]", "options.cache_salt", "tokens", ...
    detail: str
    message: int | None = None  # message index
    char: int | None = None  # character offset inside the message content
    tool: str | None = None  # tool name
    token: int | None = None  # token offset where the rendered prefixes part

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"where": self.where, "detail": self.detail}
        for key in ("message", "char", "tool", "token"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


def _first_difference(a: Any, b: Any, path: str = "") -> tuple[str, str] | None:
    """First place two JSON values differ: (path, what); ``what`` is ``key order``, ``keys``, ``value``..."""
    if type(a) is not type(b):
        return path or "$", "type"
    if isinstance(a, dict):
        if list(a) != list(b):
            if set(a) == set(b):
                return path or "$", "key order"
            missing = sorted(set(a) ^ set(b))
            return f"{path}.{missing[0]}" if path else missing[0], "keys"
        for key in a:
            found = _first_difference(a[key], b[key], f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found is not None:
                return found
        return (path or "$", "length") if len(a) != len(b) else None
    return None if a == b else (path or "$", "value")


def _char_offset(a: str, b: str) -> int:
    return common_prefix(a, b)


def _snippet(text: str, at: int) -> str:
    start = max(0, at - _SNIPPET // 2)
    piece = text[start : at + _SNIPPET]
    return ("…" if start else "") + piece + ("…" if at + _SNIPPET < len(text) else "")


def diff_structures(agent: str, old: Structure, new: Structure) -> Divergence | None:
    """Why ``new`` does not start like ``old`` (None when the leading content is byte-identical)."""
    if old.kind != new.kind:
        return Divergence(agent, "kind", f"the agent switched from {old.kind} to {new.kind} requests")
    if old.model != new.model:
        return Divergence(agent, "model", f"model changed from {old.model!r} to {new.model!r}")
    if old.options != new.options:
        before, after = dict(old.options), dict(new.options)
        key = next(k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k))
        detail = f"request option {key!r} changed: {before.get(key)} -> {after.get(key)}"
        return Divergence(agent, f"options.{key}", detail)
    if old.first != new.first:
        return _diff_first(agent, old.first, new.first)
    if old.tools != new.tools:
        return _diff_tools(agent, old, new)
    return None


def _diff_first(agent: str, old: str | None, new: str | None) -> Divergence:
    if old is None or new is None:
        return Divergence(agent, "messages[0]", "messages[0] appeared or disappeared", message=0)
    a, b = json.loads(old), json.loads(new)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if a.get("role") != b.get("role"):
            return Divergence(agent, "messages[0].role", f"role changed: {a.get('role')!r} -> {b.get('role')!r}",
                              message=0)
        ca, cb = a.get("content"), b.get("content")
        if isinstance(ca, str) and isinstance(cb, str) and ca != cb:
            at = _char_offset(ca, cb)
            return Divergence(
                agent,
                "messages[0].content",
                f"messages[0] content differs from character {at}: {_snippet(ca, at)!r} vs {_snippet(cb, at)!r}",
                message=0,
                char=at,
            )
    found = _first_difference(a, b)
    path, what = found if found is not None else ("$", "value")
    return Divergence(agent, "messages[0]", f"messages[0] differs at {path} ({what})", message=0)


def _diff_tools(agent: str, old: Structure, new: Structure) -> Divergence:
    if old.tool_names != new.tool_names:
        if sorted(old.tool_names) == sorted(new.tool_names):
            moved = next(a for a, b in zip(old.tool_names, new.tool_names, strict=True) if a != b)
            return Divergence(
                agent,
                "tools",
                f"the same tools in another order ({', '.join(old.tool_names)} vs {', '.join(new.tool_names)}): "
                "a tool list built from a set? sort it",
                tool=moved,
            )
        added = sorted(set(new.tool_names) - set(old.tool_names))
        removed = sorted(set(old.tool_names) - set(new.tool_names))
        changes = ", ".join([f"+{n}" for n in added] + [f"-{n}" for n in removed]) or "duplicates"
        return Divergence(agent, "tools", f"tool list changed ({changes})", tool=(added or removed or [None])[0])
    for i, (a, b) in enumerate(zip(old.tools, new.tools, strict=True)):
        if a == b:
            continue
        name = new.tool_names[i]
        ja, jb = json.loads(a), json.loads(b)
        found = _first_difference(ja, jb)
        path, what = found if found is not None else ("$", "value")
        if dumps_sorted(ja) == dumps_sorted(jb):
            detail = f"tool {name!r}: same definition, key order changed at {path} (the template renders key order)"
        else:
            detail = f"tool {name!r} changed at {path} ({what})"
        return Divergence(agent, f"tools[{i}]", detail, tool=name)
    return Divergence(agent, "tools", "tools differ")
