"""Whether a tagged request's answer was a tool call, read off the response as it streams by.

An answer that calls a tool brings the same agent back once the tool returns, with the whole
prompt as its prefix; one that does not hands the session on (or ends it). The engine sees
only token ids, so the API server's middleware reads the response (a JSON body or server-sent
events) and tells the engine's runtime. A tool call shows as ``"finish_reason": "tool_calls"``
or as a non-empty ``"tool_calls": [{...`` list (vLLM reports a named ``tool_choice`` with
finish reason ``stop``, and a streamed call cut at ``max_tokens`` with ``length``).
"""

from __future__ import annotations

import re

__all__ = ["AnswerWatch"]

_TOOL_CALLS = re.compile(rb'"finish_reason"\s*:\s*"tool_calls"|"tool_calls"\s*:\s*\[\s*\{')
_OVERLAP = 64  # bytes kept from the previous chunk: the pattern may straddle two


class AnswerWatch:
    """Scans the body chunks of one response; ``verdict()`` once it is complete.

    Invariant: ``seen`` turns true only on a tool call in a 200 response.
    Without one the answer counts as "no tool call" only if the request offered tools (a server
    without a tool parser reports tool calls as plain text, so silence means nothing then).
    """

    def __init__(self, session: str, offered_tools: bool) -> None:
        self.session = session
        self.offered_tools = offered_tools
        self.status: int | None = None
        self.seen = False
        self._tail = b""

    def started(self, status: int) -> None:
        self.status = status

    def chunk(self, body: bytes) -> None:
        if self.seen or self.status != 200 or not body:
            return
        window = self._tail + body
        self.seen = _TOOL_CALLS.search(window) is not None
        self._tail = window[-_OVERLAP:]

    def verdict(self) -> bool | None:
        """True: a tool call; False: an answer without one to a request that offered tools;
        None: nothing to tell (an error, or no tools offered and none called)."""
        if self.status != 200:
            return None
        if self.seen:
            return True
        return False if self.offered_tools else None
