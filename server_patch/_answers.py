"""Whether a request's answer was a tool call, read off the response as it streams by.

An answer that calls a tool brings the same agent back once the tool returns, with the whole
prompt as its prefix; one that does not hands the session on (or ends it). The engine sees
only token ids, so the API server's middleware reads the response (a JSON body or server-sent
events) and tells the engine's runtime. How a tool call shows depends on the API: in a chat
completion as ``"finish_reason": "tool_calls"`` or as a non-empty ``"tool_calls": [{...`` list
(vLLM reports a named ``tool_choice`` with finish reason ``stop``, and a streamed call cut at
``max_tokens`` with ``length``); in a response of the Responses API as an output item of
``"type": "function_call"``; in an Anthropic message as a ``"tool_use"`` content block or stop
reason.

An untagged request has no session the middleware could name: the engine's recognition gives
it one. Then the middleware names the response instead (its ``"id"``, the first one in the body:
vLLM writes the response's own id first, a tool call's id later) and the engine finds the
recognized session by the request id the response id stands for (``answer_keys``).
"""

from __future__ import annotations

import re

__all__ = ["AnswerWatch", "answer_keys"]

_CHAT_TOOL_CALLS = re.compile(rb'"finish_reason"\s*:\s*"tool_calls"|"tool_calls"\s*:\s*\[\s*\{')
_TOOL_CALLS = {  # per tagged path; a JSON string's own quotes are escaped, so none matches inside text
    "/v1/chat/completions": _CHAT_TOOL_CALLS,
    "/v1/completions": _CHAT_TOOL_CALLS,
    "/v1/responses": re.compile(rb'"type"\s*:\s*"function_call"'),
    "/v1/messages": re.compile(rb'"type"\s*:\s*"tool_use"|"stop_reason"\s*:\s*"tool_use"'),
}
# the engine request's external id is the response's id plus this (answer_keys)
_EXTERNAL_SUFFIX = {"/v1/completions": "-0", "/v1/responses": "_0"}  # a single prompt; the first generation
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"([A-Za-z0-9._:-]{1,128})"')
_OVERLAP = 64  # bytes kept from the previous chunk: the pattern may straddle two
_MAX_ID_SCAN = 4096  # the response id comes first: bytes scanned for it before giving up


def answer_keys(request_id: str) -> tuple[str, ...]:
    """The keys a response may name an engine request by: vLLM (0.32, 0.33) runs a request as its
    external id plus ``-`` and 8 random characters, and the external id of a chat completion (and
    of an Anthropic message, served as one) is the response's id, that of a completion's single
    prompt the response's id plus ``-0``, that of a response's first generation its id plus ``_0``."""
    external, dash, suffix = request_id.rpartition("-")
    return (request_id, external) if dash and len(suffix) == 8 else (request_id,)


class AnswerWatch:
    """Scans the body chunks of one response; ``verdict()`` once it is complete.

    Invariant: ``seen`` turns true only on a tool call in a 200 response.
    Without one the answer counts as "no tool call" only if the request offered tools (a server
    without a tool parser reports tool calls as plain text, so silence means nothing then).
    """

    def __init__(self, session: str | None, offered_tools: bool, *, path: str = "") -> None:
        """``session``: the tagged request's; None: an untagged one to ``path``, told by ``response_id``."""
        self.session = session
        self._suffix = _EXTERNAL_SUFFIX.get(path, "")
        self._tool_calls = _TOOL_CALLS.get(path, _CHAT_TOOL_CALLS)
        self.offered_tools = offered_tools
        self.status: int | None = None
        self.seen = False
        self.response_id: str | None = None
        self._scanned = 0 if session is None else _MAX_ID_SCAN  # only an untagged answer needs its id
        self._tail = b""

    def started(self, status: int) -> None:
        self.status = status

    def chunk(self, body: bytes) -> None:
        if self.seen or self.status != 200 or not body:
            return
        window = self._tail + body
        if self._scanned < _MAX_ID_SCAN:
            found = _RESPONSE_ID.search(window)
            if found is not None:
                self.response_id, self._scanned = found.group(1).decode("ascii"), _MAX_ID_SCAN
            else:
                self._scanned += len(body)
        self.seen = self._tool_calls.search(window) is not None
        self._tail = window[-_OVERLAP:]

    def about(self) -> dict[str, str] | None:
        """What names the answer to the engine: the tagged request's session, or the untagged
        request its response id stands for (None: the id was not seen)."""
        if self.session is not None:
            return {"session": self.session}
        return None if self.response_id is None else {"request": self.response_id + self._suffix}

    def verdict(self) -> bool | None:
        """True: a tool call; False: an answer without one to a request that offered tools;
        None: nothing to tell (an error, or no tools offered and none called)."""
        if self.status != 200:
            return None
        if self.seen:
            return True
        return False if self.offered_tools else None
