"""What the middleware checks before it acts on a request: the API key and the body's shape.

vLLM authenticates only its own route prefixes (``/v1``...) and runs after this middleware, so
``/agentkv/*`` is guarded here, with vLLM's rule: the keys of ``--api-key`` (else
``VLLM_API_KEY``), presented as ``Authorization: Bearer KEY`` (scheme case-insensitive).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import MutableMapping, Sequence
from typing import Any

from starlette.datastructures import Headers

__all__ = ["ApiKeyGuard", "BodyError", "json_depth", "parse_json"]


class ApiKeyGuard:
    """Invariant: with no key configured every caller is allowed; with keys, exactly the
    callers vLLM's own AuthenticationMiddleware would let through to ``/v1``."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self.tokens = tuple(t for t in tokens if t)
        self._hashes = [hashlib.sha256(t.encode("utf-8")).digest() for t in self.tokens]

    @classmethod
    def for_scope(cls, scope: MutableMapping[str, Any]) -> ApiKeyGuard:
        """The keys vLLM was started with (``app.state.args.api_key``), else ``VLLM_API_KEY``."""
        state = getattr(scope.get("app"), "state", None)
        args = getattr(state, "args", None)
        configured = getattr(args, "api_key", None)
        return cls(list(configured) if configured else [os.environ.get("VLLM_API_KEY", "")])

    @property
    def required(self) -> bool:
        return bool(self._hashes)

    def allows(self, scope: MutableMapping[str, Any]) -> bool:
        if not self._hashes:
            return True
        value = Headers(scope=scope).get("Authorization")
        if not value:
            return False
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        match = False
        for known in self._hashes:  # compare against every key: timing says nothing about which
            match |= secrets.compare_digest(digest, known)
        return match


class BodyError(ValueError):
    """A request body agentkv cannot accept; the message is the client's 400 answer."""


def json_depth(value: object) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_json(body: bytes, *, what: str, max_depth: int) -> Any:
    """Parse ``body`` or raise BodyError: not JSON, nested deeper than ``max_depth``, or too
    deep for the parser itself (which raises RecursionError long before any limit of ours)."""
    try:
        document = json.loads(body)
    except RecursionError:
        raise BodyError(f"{what} body is nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, or an integer too long to convert
        raise BodyError(f"{what} body is not valid JSON: {exc}") from None
    if json_depth(document) > max_depth:
        raise BodyError(f"{what} body is nested deeper than {max_depth} levels")
    return document
