"""Which agent, session and parent each request carries: its tag, or what recognition finds
(mixed into ``AgentKVRuntime``; parsed once per request)."""

from __future__ import annotations

from collections import OrderedDict

from vllm.v1.request import Request

from agentkv.protocol import (
    HEADER_VLLM_SESSION,
    AgentTag,
    MalformedCounter,
    ProtocolError,
    names_a_session,
    parse_xargs,
    validate_id,
)

from ._answers import answer_keys
from ._recognize import Recognizer

__all__ = ["RequestTagging"]

_UNPARSED = object()  # tag_of's cache miss (a cached None means: parsed, untagged)
_MAX_CACHED_TAGS = 65_536
_MAX_FINISHED_TAGS = 4_096  # finished requests' tags, kept so that a late reader gets the same tag
_MAX_ANSWER_KEYS = 8_192  # recognized requests whose answer may still be told (two keys each)


class RequestTagging:
    """The tags of an ``AgentKVRuntime``'s requests (mixed into it).

    Invariants: ``_tags`` holds the tags of requests not finished yet, at most ``_MAX_CACHED_TAGS``
    (the latest), ``_finished_tags`` those of the latest ``_MAX_FINISHED_TAGS`` finished ones; a request
    whose session recognition found is in ``_quoting`` and its response's keys in
    ``_answer_sessions`` (each at most ``_MAX_ANSWER_KEYS``, the latest).
    """

    recognizer: Recognizer | None
    malformed: MalformedCounter
    block_size: int
    _tags: OrderedDict[str, AgentTag | None]
    _finished_tags: OrderedDict[str, AgentTag | None]
    _answer_sessions: OrderedDict[str, str]  # answer key -> recognized session
    _quoting: OrderedDict[str, str]  # recognized requests not yet freed -> their session

    def tag_of(self, request: Request) -> AgentTag | None:
        """The request's agentkv tag (parsed once per request; malformed ones counted)."""
        request_id = request.request_id
        known = self._tags.get(request_id, _UNPARSED)
        if known is _UNPARSED:
            known = self._finished_tags.get(request_id, _UNPARSED)  # parsed once: not recognized again
        if known is not _UNPARSED:
            return known  # type: ignore[return-value]
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        result = parse_xargs(extra)
        self.malformed.record(result.errors)
        session_id = self._session_header(request, result.tag)
        tag, recognized = self._recognized(request, result.tag, session_id)
        if tag is not None and tag.session is None and session_id:
            tag = AgentTag(tag.agent, session_id, tag.parent, tag.step)
        self._tags[request_id] = tag
        if len(self._tags) > _MAX_CACHED_TAGS:
            self._tags.popitem(last=False)
        # a session agentkv's metadata did not name (recognized, or vLLM's session_id beside a tag
        # naming the agent alone): the middleware can name only the response, by which it is found
        named_by_vllm = result.tag is not None and result.tag.session is None and bool(session_id)
        if (recognized or named_by_vllm) and tag is not None and tag.session is not None:
            for key in answer_keys(request_id):
                self._answer_sessions[key] = tag.session
            while len(self._answer_sessions) > _MAX_ANSWER_KEYS:
                self._answer_sessions.popitem(last=False)
        if recognized and tag is not None and tag.session is not None:
            self._quoting[request_id] = tag.session  # its answer is read when it is freed
            while len(self._quoting) > _MAX_ANSWER_KEYS:
                self._quoting.popitem(last=False)
        return tag

    def _finish_tag(self, request_id: str) -> AgentTag | None:
        """The finished request's tag, moved from the live requests' cache to the finished ones'."""
        tag = self._tags.pop(request_id, None)
        self._finished_tags[request_id] = tag
        if len(self._finished_tags) > _MAX_FINISHED_TAGS:
            self._finished_tags.popitem(last=False)
        return tag

    def _session_header(self, request: Request, tag: AgentTag | None) -> str | None:
        """The X-Session-ID that names the request's session: on a tagged request that names none
        (not a warm-up, which carries it only as a routing key and must not join or revive any
        session), and on an untagged one while recognition runs. One outside the wire alphabet is
        counted and ignored: recognition follows the conversation itself."""
        session_id = request.session_id
        if not session_id or (tag is None and self.recognizer is None):
            return None
        if tag is not None and (tag.session is not None or tag.warmup or not names_a_session(session_id, tag.agent)):
            return None
        try:
            return validate_id(session_id, HEADER_VLLM_SESSION)
        except ProtocolError as exc:
            self.malformed.record((exc,))  # type: ignore[arg-type]
            return None

    def _recognized(self, request: Request, tag: AgentTag | None,
                    session_id: str | None) -> tuple[AgentTag | None, bool]:
        """(the request's tag, whether recognition found its session). A tag wins; an untagged
        request gets the agent, session and parent recognition finds, and one that names its agent
        but no session (nor a valid X-Session-ID, ``session_id``) the session recognition finds: the
        conversation it continues, or one of its own."""
        if self.recognizer is None or not self.block_size:
            return tag, False
        tokens = request.prompt_token_ids or []
        if tag is not None:
            if tag.warmup:
                return tag, False
            if tag.session is not None or session_id:
                self.recognizer.observe_tagged(tag.agent, request.block_hashes, tokens, self.block_size)
                return tag, False
            found = self.recognizer.recognize(request.request_id, request.block_hashes, tokens, self.block_size,
                                              agent=tag.agent)
            if found.session is None:
                return tag, False
            return AgentTag(tag.agent, found.session, tag.parent, tag.step), True
        found = self.recognizer.recognize(request.request_id, request.block_hashes, tokens, self.block_size,
                                          session_id)
        if found.agent is None:
            return None, False
        return AgentTag(found.agent, found.session, found.parent, found.step), True
