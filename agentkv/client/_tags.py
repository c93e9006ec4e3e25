"""The current agent tag (a ContextVar) and what ``X-Session-ID`` carries (the routing key).

Invariant: a request sent through the patched openai SDK carries the tag that is current in the
context sending it.
"""

from __future__ import annotations

import contextvars
from typing import Final

from agentkv.protocol import HEADER_VLLM_SESSION, AgentTag

__all__ = ["TagToken", "current_tag", "push_tag", "reset_tag", "routing_header", "set_routing_key", "set_tag"]

_CURRENT: Final[contextvars.ContextVar[AgentTag | None]] = contextvars.ContextVar("agentkv_tag", default=None)

TagToken = contextvars.Token[AgentTag | None]


def current_tag() -> AgentTag | None:
    """The tag that an OpenAI request sent from here would carry (None: untagged)."""
    return _CURRENT.get()


def set_tag(tag: AgentTag | None) -> AgentTag | None:
    """Set the current tag in this context; returns the previous one (restore it with ``set_tag(prev)``)."""
    previous = _CURRENT.get()
    _CURRENT.set(tag)
    return previous


def push_tag(tag: AgentTag | None) -> TagToken:
    """Set the current tag; returns the token that :func:`reset_tag` restores the previous one with."""
    return _CURRENT.set(tag)


def reset_tag(token: TagToken) -> None:
    """Restore the tag current before :func:`push_tag`; untagged if the token belongs to another context."""
    try:
        _CURRENT.reset(token)
    except ValueError:  # reset in another context (e.g. a generator moved across tasks)
        _CURRENT.set(None)


_ROUTING_KEYS: Final = ("session", "agent")
_routing_key = "session"


def set_routing_key(key: str) -> str:
    """What ``X-Session-ID`` carries, i.e. what a router's session affinity groups by; returns
    the previous key (to restore it).

    ``"session"`` (default) keeps a session's history on one replica; ``"agent"`` keeps each
    agent's anchor on one replica. The agentkv tag itself is unchanged either way.
    """
    global _routing_key
    if key not in _ROUTING_KEYS:
        raise ValueError(f"routing key must be one of {_ROUTING_KEYS}, not {key!r}")
    previous, _routing_key = _routing_key, key
    return previous


def routing_header(agent: str, session: str | None) -> dict[str, str]:
    """``X-Session-ID`` for a request of ``agent`` in ``session`` under the current routing key."""
    value = agent if _routing_key == "agent" else session
    return {HEADER_VLLM_SESSION: value} if value else {}
