"""Anchors: the exact prefix every call of an agent shares, captured from its real requests.

Anchors are never rebuilt from what the app *declares*, only from what it *sends*: chat templates
render tools, dates and key order in ways a rebuilt prompt would miss. :meth:`AnchorBook.observe`
(an ``on_request`` listener, no I/O) snapshots each agent's calls (``_snapshot``) and lints their
leading content (``_lint``); :meth:`AnchorBook.resolve` (on the warm-up worker) takes the longest
common token prefix of the latest three sessions' first calls (two until there are three) as rendered
by the server's ``POST /tokenize``, floored to the block size. See docs/frameworks.md ("Warm-up",
"Anchors", "Prefix-stability lint").
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from agentkv._bounded import BoundedDict
from agentkv.client import ErrorCounter, TaggedRequest, install, on_request

from ._lint import Divergence, common_prefix, diff_structures
from ._messages import chat_form as messages_chat_form
from ._responses import chat_form as responses_chat_form
from ._snapshot import Structure, snapshot
from ._urls import same_server

__all__ = ["DEFAULT_BLOCK_SIZE", "Anchor", "AnchorBook", "Tokenize"]

logger = logging.getLogger("agentkv.warmup")

DEFAULT_BLOCK_SIZE: Final = 32
# A known anchor is recomputed from newer sessions' calls at most this often (s): each recomputation
# asks the server to tokenize whole calls, in the pause where the application's next call is sent,
# and interleaved sessions would otherwise renew an agent's latest capture at nearly every call.
ANCHOR_REFRESH: Final = 30.0
_PREFIX_ROLES: Final = frozenset({"system", "developer"})


@dataclass(frozen=True, slots=True)
class Anchor:
    """An agent's warmable prefix: exact token ids (``tokens``) and/or a chat replay (``chat``).

    ``tokens`` is floored to ``block_size``; ``shared_tokens`` is the unfloored common prefix.
    ``source``: ``cross-session`` (common prefix of the latest sessions' calls), ``structural`` (one call
    vs. its own messages[0] + tools), ``prompt`` (completions prompts) or ``chat`` (no tokenizer:
    replay ``chat`` = messages[0] + tools; its length is only known from the warm-up's answer).
    ``extra`` holds body fields the warm-up must repeat to hit the same blocks (``cache_salt``).
    """

    agent: str
    model: str | None
    tokens: tuple[int, ...]
    block_size: int
    source: str
    shared_tokens: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)
    chat: Mapping[str, Any] | None = None

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def blocks(self) -> int:
        return len(self.tokens) // self.block_size if self.block_size else 0


@dataclass(slots=True)
class _Capture:
    id: int
    session: str | None
    time: float
    structure: Structure
    body: str  # JSON: the /tokenize payload of the whole call (without model)
    extra: dict[str, Any]
    first_role: str | None
    prompt_ids: tuple[int, ...] | None = None  # completions with a token-id prompt
    tool_choice: Any = None  # repeated by a chat replay (a server without auto tool choice needs "none")
    tokens: tuple[int, ...] | None = None  # cached tokenization of the whole call
    struct_tokens: tuple[int, ...] | None = None  # cached tokenization of messages[0] + tools alone
    struct_failed: bool = False


@dataclass(slots=True)
class _Agent:
    latest: _Capture | None = None  # first call of the most recent session
    ref: _Capture | None = None  # first call of the session before it
    older: _Capture | None = None  # first call of the session before that
    last_structure: Structure | None = None
    last_seen: float = 0.0
    calls: int = 0
    sessions: int = 0
    anchor: Anchor | None = None
    anchor_key: tuple[Any, ...] | None = None
    anchor_at: float = -math.inf  # when ``anchor`` was computed
    divergence: Divergence | None = None
    divergences: int = 0
    logged: bool = False
    token_checked: tuple[int, int] | None = None


Tokenize = Callable[[Mapping[str, Any]], Sequence[int]]


class AnchorBook:
    """Per-agent anchors and prefix-stability findings, learned from the agents' real requests.

    Thread-safe. :meth:`observe` is the ``on_request`` listener (only JSON snapshots and string
    comparisons; no I/O); :meth:`resolve` does the tokenization (I/O through the ``tokenize``
    callable) and belongs on a background thread. ``base_url``: only requests to that server are
    captured (None: all). ``block_size`` may be updated later (the server's, from its stats).
    """

    def __init__(
        self,
        *,
        base_url: str | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_agents: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger = logger,
    ) -> None:
        self.base_url = base_url
        self.block_size = block_size
        self.clock = clock
        self._log = log
        self.errors = ErrorCounter(log)
        self._agents: BoundedDict[str, _Agent] = BoundedDict(max_agents)
        self._lock = threading.Lock()
        self._ids = 0
        self._unsubscribe: Callable[[], None] | None = None
        self._attached = 0  # attach() calls not undone by detach() yet
        self._attach_lock = threading.Lock()
        self.counts = {"captured": 0, "ignored": 0, "other_server": 0}

    @property
    def max_agents(self) -> int:
        """At most this many agents are kept (the least recently captured forgotten first)."""
        return self._agents.cap

    # -- subscription ------------------------------------------------------------------

    def attach(self) -> AnchorBook:
        """Subscribe :meth:`observe` to ``agentkv.client.on_request``; each attach is undone by one
        :meth:`detach` (coordinators sharing a book each attach it: it captures until the last detaches)."""
        install()
        with self._attach_lock:
            self._attached += 1
            if self._unsubscribe is None:
                self._unsubscribe = on_request(self.observe)
        return self

    def detach(self) -> None:
        with self._attach_lock:
            self._attached = max(0, self._attached - 1)
            if self._attached:
                return
            unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe is not None:
            unsubscribe()

    # -- capture -----------------------------------------------------------------------

    def observe(self, request: TaggedRequest) -> None:
        """``on_request`` listener: capture a tagged request's prefix (never raises)."""
        try:
            if request.tag.warmup:
                return
            if self.base_url is not None and not same_server(request.base_url, self.base_url):
                self.counts["other_server"] += 1
                return
            url = request.url.rstrip("/")
            body = request.json_data
            if url.endswith("/responses") or url == "responses":
                body = responses_chat_form(body)  # rendered as a chat request; None counts as ignored below
            elif url.endswith("/messages") or url == "messages":
                body = messages_chat_form(body)
            elif not (url.endswith("/completions") or url in ("completions", "chat/completions")):
                self.counts["ignored"] += 1
                return
            self.capture(request.tag.agent, request.tag.session, body)
        except Exception as exc:
            self.errors.record("anchor capture", exc)

    def capture(self, agent: str, session: str | None, body: Any, *, now: float | None = None) -> bool:
        """Record one real call of ``agent`` (a chat or completions request body, or a Responses or
        Messages API request in its chat form); False if unusable.

        ``body`` is only read: it is serialized here, so later changes to it do not matter.
        """
        snap = snapshot(body)
        if snap is None:
            self.counts["ignored"] += 1
            return False
        structure = snap.structure
        tool_choice = body.get("tool_choice") if structure.kind == "chat" else None
        now = self.clock() if now is None else now
        finding: Divergence | None = None
        with self._lock:
            record = self._agents.get(agent)
            latest = None if record is None else record.latest
            keep = (latest is None or session is None or session != latest.session
                    or latest.structure.model != structure.model or latest.structure.kind != structure.kind)
            self._ids += 1
            capture = _Capture(self._ids, session, now, structure, snap.payload() if keep else "", snap.extra,
                               snap.first_role, snap.prompt_ids() if keep else None, tool_choice)
            if record is None:
                record = _Agent()
                self._agents[agent] = record
            else:
                self._agents.touch(agent)
            record.calls += 1
            record.last_seen = now
            if record.last_structure is not None and record.last_structure != structure:
                finding = diff_structures(agent, record.last_structure, structure)
            record.last_structure = structure
            latest = record.latest
            if latest is None:
                record.latest, record.sessions = capture, 1
            elif latest.structure.model != structure.model or latest.structure.kind != structure.kind:
                record.latest, record.ref, record.older, record.sessions = capture, None, None, 1  # another model
            elif session is None or session != latest.session:
                record.older, record.ref, record.latest = record.ref, latest, capture
                record.sessions += 1
            self.counts["captured"] += 1
            if finding is not None:
                self._note(record, finding)
        return True

    def _note(self, record: _Agent, finding: Divergence) -> None:
        """Record a lint finding (under the lock); log the first one per agent."""
        record.divergence = finding
        record.divergences += 1
        if not record.logged:
            record.logged = True
            self._log.warning(
                "agentkv warm-up: agent %r has no stable prompt prefix: %s. Its calls cannot share cached "
                "blocks past that point (further changes are only counted in the warm-up stats)",
                finding.agent,
                finding.detail,
            )

    # -- queries -----------------------------------------------------------------------

    def agents(self) -> list[str]:
        with self._lock:
            return list(self._agents)

    def last_seen(self, agent: str) -> float | None:
        with self._lock:
            record = self._agents.get(agent)
            return None if record is None else record.last_seen

    def anchor(self, agent: str) -> Anchor | None:
        """The last anchor :meth:`resolve` computed for ``agent`` (no I/O)."""
        with self._lock:
            record = self._agents.get(agent)
            return None if record is None else record.anchor

    def divergence(self, agent: str) -> Divergence | None:
        with self._lock:
            record = self._agents.get(agent)
            return None if record is None else record.divergence

    def divergences(self) -> dict[str, dict[str, Any]]:
        """Per agent with an unstable prefix: the latest finding and how many changes were seen."""
        with self._lock:
            return {
                agent: {**r.divergence.as_dict(), "count": r.divergences}
                for agent, r in self._agents.items()
                if r.divergence is not None
            }

    def stats(self) -> dict[str, Any]:
        with self._lock:
            agents = {}
            for name, r in self._agents.items():
                anchor = r.anchor
                agents[name] = {
                    "calls": r.calls,
                    "sessions": r.sessions,
                    "anchor_tokens": None if anchor is None else anchor.length,
                    "anchor_blocks": None if anchor is None else anchor.blocks,
                    "source": None if anchor is None else anchor.source,
                    "stable": r.divergence is None,
                }
                if r.divergence is not None:
                    agents[name]["divergence"] = {**r.divergence.as_dict(), "count": r.divergences}
            return {"agents": agents, **self.counts, "errors": dict(self.errors.by_kind)}

    # -- resolution (background thread) -------------------------------------------------

    def resolve(self, agent: str, tokenize: Tokenize | None) -> Anchor | None:
        """Compute (or reuse) the anchor of ``agent``; ``tokenize`` is ``POST /tokenize`` (payload -> ids).

        Without ``tokenize`` (a server without the endpoint) the anchor is a chat replay of
        messages[0] + tools. Returns None when nothing warmable is known yet. Tokenizer errors
        propagate (the caller counts them); a failed messages[0] + tools rendering (a template that
        needs a user message) only disables the single-session fallback.
        """
        with self._lock:
            record = self._agents.get(agent)
            if record is None or record.latest is None:
                return None
            latest, ref, older = record.latest, record.ref, record.older
            block = max(1, int(self.block_size or DEFAULT_BLOCK_SIZE))
            key = (latest.id, None if ref is None else ref.id, None if older is None else older.id, block,
                   tokenize is None)
            if record.anchor_key == key:
                return record.anchor
            now = self.clock()
            known = record.anchor
            if known is not None and record.anchor_key is not None and record.anchor_key[1] is not None \
                    and ref is not None and record.anchor_key[3:] == key[3:] \
                    and known.model == latest.structure.model and now - record.anchor_at < ANCHOR_REFRESH:
                return known  # a cross-session anchor, newer sessions' calls: what they share moves rarely
        if tokenize is None:
            anchor = self._chat_anchor(agent, latest, block)
        else:
            anchor = self._token_anchor(agent, record, latest, ref, older, block, tokenize)
        with self._lock:
            if record.latest is latest and record.ref is ref:
                record.anchor, record.anchor_key, record.anchor_at = anchor, key, now
        return anchor

    def _chat_anchor(self, agent: str, latest: _Capture, block: int) -> Anchor | None:
        if latest.structure.kind != "chat" or latest.first_role not in _PREFIX_ROLES:
            return None
        payload = _replay_payload(latest)
        return Anchor(agent, latest.structure.model, (), block, "chat", 0, dict(latest.extra), payload)

    def _token_anchor(
        self, agent: str, record: _Agent, latest: _Capture, ref: _Capture | None, older: _Capture | None, block: int,
        tokenize: Tokenize,
    ) -> Anchor | None:
        mine = _tokens_of(latest, tokenize)
        if ref is not None:
            shared = common_prefix(mine, _tokens_of(ref, tokenize))
            source = "cross-session" if latest.structure.kind == "chat" else "prompt"
            self._check_tokens(agent, record, latest, ref, shared, tokenize)
            if older is not None:  # two sessions may open alike (the same task): the anchor is what three share
                shared = min(shared, common_prefix(mine, _tokens_of(older, tokenize)))
        else:
            struct = _struct_tokens_of(latest, tokenize)
            if struct is None:
                return None  # one call and no way to tell its fixed part: wait for another session
            shared, source = common_prefix(mine, struct), "structural"
        floored = shared // block * block
        if floored == 0:
            return None
        replayable = latest.structure.kind == "chat" and latest.first_role in _PREFIX_ROLES
        chat = _replay_payload(latest) if replayable else None
        return Anchor(agent, latest.structure.model, tuple(mine[:floored]), block, source, shared,
                      dict(latest.extra), chat)

    def _check_tokens(
        self, agent: str, record: _Agent, latest: _Capture, ref: _Capture, shared: int, tokenize: Tokenize
    ) -> None:
        """Token-level lint: two sessions' renderings part inside what should be their fixed prefix."""
        pair = (ref.id, latest.id)
        if record.token_checked == pair or latest.structure.kind != "chat":
            return
        record.token_checked = pair
        struct = _struct_tokens_of(latest, tokenize)
        if struct is None or shared >= len(struct):
            return
        block = max(1, int(self.block_size or DEFAULT_BLOCK_SIZE))
        same_content = ref.structure == latest.structure
        where = (
            "the chat template renders something variable (e.g. today's date) although messages[0] and tools "
            "are identical"
            if same_content
            else "messages[0]/tools differ between the sessions"
        )
        finding = Divergence(
            agent,
            "tokens",
            f"the rendered prefix of two sessions parts at token {shared} (block {shared // block}) of "
            f"{len(struct)} fixed tokens: {where}",
            token=shared,
        )
        with self._lock:
            if same_content or record.divergence is None:
                self._note(record, finding)
            elif record.divergence.token is None:
                record.divergence = Divergence(**{**_fields(record.divergence), "token": shared})


def _fields(d: Divergence) -> dict[str, Any]:
    return {name: getattr(d, name) for name in ("agent", "where", "detail", "message", "char", "tool", "token")}


def _tokens_of(capture: _Capture, tokenize: Tokenize) -> tuple[int, ...]:
    if capture.tokens is None:
        if capture.prompt_ids is not None:
            capture.tokens = capture.prompt_ids
        else:
            capture.tokens = tuple(int(t) for t in tokenize(_payload(capture)))
    return capture.tokens


def _payload(capture: _Capture) -> dict[str, Any]:
    """The ``POST /tokenize`` body that renders the whole call as the server did."""
    body = json.loads(capture.body)
    if capture.structure.model is not None:
        body["model"] = capture.structure.model
    return body


def _struct_payload(capture: _Capture) -> dict[str, Any]:
    """messages[0] + tools + render options, with no generation prompt: the fixed part alone."""
    body = _payload(capture)
    payload = {k: v for k, v in body.items() if k != "messages"}
    payload["messages"] = body["messages"][:1]
    payload["add_generation_prompt"] = False
    payload.pop("continue_final_message", None)
    return payload


def _replay_payload(capture: _Capture) -> dict[str, Any]:
    """A chat request rendering messages[0] + tools alone (the fallback warm-up without /tokenize)."""
    payload = _struct_payload(capture)
    if "tools" in payload and capture.tool_choice is not None:
        payload["tool_choice"] = capture.tool_choice
    return payload


def _struct_tokens_of(capture: _Capture, tokenize: Tokenize) -> tuple[int, ...] | None:
    if capture.struct_tokens is None and not capture.struct_failed:
        if capture.structure.kind != "chat" or capture.first_role not in _PREFIX_ROLES:
            capture.struct_failed = True
        else:
            try:
                capture.struct_tokens = tuple(int(t) for t in tokenize(_struct_payload(capture)))
            except Exception:  # e.g. a template that puts tools in the first user message
                capture.struct_failed = True
    return capture.struct_tokens
