"""Which agent, session and parent each request carries: its tag, or what recognition finds
(mixed into ``AgentKVRuntime``; parsed once per request)."""

from __future__ import annotations

from collections import OrderedDict

from vllm.v1.request import Request

from agentkv.protocol import AgentTag, MalformedCounter, ProtocolError, parse_xargs, validate_id

from ._answers import answer_keys
from ._recognize import Recognizer

__all__ = ["RequestTagging"]

_UNPARSED = object()  # tag_of's cache miss (a cached None means: parsed, untagged)
_MAX_CACHED_TAGS = 65_536
_MAX_ANSWER_KEYS = 8_192  # recognized requests whose answer may still be told (two keys each)


class RequestTagging:
    """The tags of an ``AgentKVRuntime``'s requests (mixed into it).

    Invariants: ``_tags`` holds at most ``_MAX_CACHED_TAGS`` requests' tags, the latest; a request
    whose session recognition found is in ``_quoting`` and its response's keys in
    ``_answer_sessions`` (each at most ``_MAX_ANSWER_KEYS``, the latest).
    """

    recognizer: Recognizer | None
    malformed: MalformedCounter
    block_size: int
    _tags: OrderedDict[str, AgentTag | None]
    _answer_sessions: OrderedDict[str, str]  # answer key -> recognized session
    _quoting: OrderedDict[str, AgentTag]  # recognized requests not yet freed

    def tag_of(self, request: Request) -> AgentTag | None:
        """The request's agentkv tag (parsed once per request; malformed ones counted)."""
        request_id = request.request_id
        known = self._tags.get(request_id, _UNPARSED)
        if known is not _UNPARSED:
            return known  # type: ignore[return-value]
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        result = parse_xargs(extra)
        self.malformed.record(result.errors)
        tag, recognized = self._recognized(request, result.tag)
        # X-Session-ID stands in for a missing agentkv session, except on warm-ups, which
        # carry it only as a routing key and must not join (or revive) any session
        if tag is not None and tag.session is None and request.session_id and not tag.warmup:
            try:
                tag = AgentTag(tag.agent, request.session_id, tag.parent, tag.step, tag.warmup)
            except ProtocolError as exc:
                self.malformed.record((exc,))  # type: ignore[arg-type]
        self._tags[request_id] = tag
        if len(self._tags) > _MAX_CACHED_TAGS:
            self._tags.popitem(last=False)
        if recognized and tag is not None and tag.session is not None:
            # its session recognized: the middleware can name only the response, by which this request is found
            for key in answer_keys(request_id):
                self._answer_sessions[key] = tag.session
            while len(self._answer_sessions) > _MAX_ANSWER_KEYS:
                self._answer_sessions.popitem(last=False)
            self._quoting[request_id] = tag  # its answer is read when it is freed
            while len(self._quoting) > _MAX_ANSWER_KEYS:
                self._quoting.popitem(last=False)
        return tag

    def _recognized(self, request: Request, tag: AgentTag | None) -> tuple[AgentTag | None, bool]:
        """(the request's tag, whether recognition found its session). A tag wins; an untagged
        request gets the agent, session and parent recognition finds, and one that names its agent
        but no session (nor an X-Session-ID) the session recognition finds: the conversation it
        continues, or one of its own."""
        if self.recognizer is None or not self.block_size:
            return tag, False
        tokens = request.prompt_token_ids or []
        if tag is not None:
            if tag.warmup:
                return tag, False
            if tag.session is not None or request.session_id:
                self.recognizer.observe_tagged(tag.agent, request.block_hashes, tokens, self.block_size)
                return tag, False
            found = self.recognizer.recognize(request.request_id, request.block_hashes, tokens, self.block_size,
                                              agent=tag.agent)
            if found.session is None:
                return tag, False
            return AgentTag(tag.agent, found.session, tag.parent, tag.step), True
        session_id = request.session_id
        if session_id:
            try:
                validate_id(session_id, "session")
            except ProtocolError as exc:  # an X-Session-ID outside the wire alphabet: counted, then
                self.malformed.record((exc,))  # type: ignore[arg-type]
                session_id = None  # recognition follows the conversation itself
        found = self.recognizer.recognize(request.request_id, request.block_hashes, tokens, self.block_size,
                                          session_id or None)
        if found.agent is None:
            return None, False
        return AgentTag(found.agent, found.session, found.parent, found.step), True
