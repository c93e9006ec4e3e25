"""The client core that every adapter and the warm-up coordinator stand on.

Tagging (the current :class:`~agentkv.protocol.AgentTag`, :func:`agent`, :func:`use_tag`, id
sanitizing), the hook bus (dispatches, dispatch ends, session ends, tagged requests and responses),
per-session lineage (:class:`SessionTracker`), client counters and swallowed-error accounting, and
the one openai SDK patch that puts the tag on the wire and reports the answers. Needs only the
openai SDK (imported when the patch is installed). See docs/frameworks.md.
"""

from ._errors import COUNTS, ERRORS, ErrorCounter, count
from ._hooks import (
    Dispatch,
    TaggedRequest,
    TaggedResponse,
    dispatch_ended,
    learner_listener,
    on_dispatch,
    on_dispatch_end,
    on_request,
    on_session_end,
)
from ._ids import UNSET, Unset, sanitize_id
from ._lineage import SessionTracker, tracker
from ._scopes import TagScope, agent, use_tag
from ._sdk import install, installed, on_response, stats, uninstall, usage_of
from ._tags import TagToken, current_tag, push_tag, reset_tag, routing_header, set_routing_key, set_tag

__all__ = [
    "COUNTS",
    "ERRORS",
    "UNSET",
    "Dispatch",
    "ErrorCounter",
    "SessionTracker",
    "TagScope",
    "TagToken",
    "TaggedRequest",
    "TaggedResponse",
    "Unset",
    "agent",
    "count",
    "current_tag",
    "dispatch_ended",
    "install",
    "installed",
    "learner_listener",
    "on_dispatch",
    "on_dispatch_end",
    "on_request",
    "on_response",
    "on_session_end",
    "push_tag",
    "reset_tag",
    "routing_header",
    "sanitize_id",
    "set_routing_key",
    "set_tag",
    "stats",
    "tracker",
    "uninstall",
    "usage_of",
    "use_tag",
]
