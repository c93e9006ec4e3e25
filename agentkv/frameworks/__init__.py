"""Framework adapters (LangGraph, AutoGen, plain OpenAI SDK).

This package re-exports the client core (:mod:`agentkv.client`: tagging, hooks, lineage, the SDK
patch) and the event sink; ``agentkv.frameworks.langgraph`` and ``agentkv.frameworks.autogen``
import their framework when imported.
"""

from agentkv.client import (
    UNSET,
    Dispatch,
    SessionTracker,
    TaggedRequest,
    agent,
    current_tag,
    install,
    installed,
    learner_listener,
    on_dispatch,
    on_dispatch_end,
    on_request,
    on_session_end,
    routing_header,
    sanitize_id,
    set_routing_key,
    stats,
    tracker,
    uninstall,
    use_tag,
)

from ._events import EventSink

__all__ = [
    "UNSET",
    "Dispatch",
    "EventSink",
    "SessionTracker",
    "TaggedRequest",
    "agent",
    "current_tag",
    "install",
    "installed",
    "learner_listener",
    "on_dispatch",
    "on_dispatch_end",
    "on_request",
    "on_session_end",
    "routing_header",
    "sanitize_id",
    "set_routing_key",
    "stats",
    "tracker",
    "uninstall",
    "use_tag",
]
