"""Anchors: the exact prefix every call of an agent shares, captured from its real requests.

An agent's *anchor* is what its calls repeat verbatim at the start of the prompt (system prompt,
tool definitions, few-shot examples). Warming it only helps if the warm-up renders to the very same
tokens as the agent's next real call, and chat templates make that easy to get wrong (field notes
§4): tools are rendered before the system text, after it, or inside the first user message; some
templates insert today's date; the key order inside a tool's ``parameters`` changes the rendering;
tool lists built from a set change order between processes; vLLM rejects ``tools: []``. So anchors
are never rebuilt from what the app *declares*: they are taken from what it *sends*.

* **Capture** (:meth:`AnchorBook.observe`, an ``agentkv.client.on_request`` listener, cheap, on
  the caller's thread): per agent, a JSON snapshot of the prompt-determining fields of its real
  requests (``model``, ``messages``, ``tools``, template options, ``cache_salt``; or ``prompt``), and
  their *structure*: canonical JSON of ``messages[0]`` and of each tool, byte for byte (key order
  kept, because the template renders it).
* **Resolve** (:meth:`AnchorBook.resolve`, on the warm-up worker): the anchor tokens are the longest
  common token prefix of two real calls of the agent from different sessions, both tokenized by the
  server itself (``POST /tokenize`` with the call's messages + tools + template options: whatever the
  template does, dates included, is reproduced). Before a second session exists, the second
  rendering is the call's own ``messages[0]`` + tools alone (``add_generation_prompt: false``). The
  common prefix is floored to the server's block size: only full blocks are cached.
* **Prefix-stability lint**: when the leading content of an agent changes between calls (``model``,
  ``messages[0]``, a tool, the tools' order, a tool's key order, a template option) or, with identical
  content, its rendering changes (a date in the template), the agent has no stable prefix past that
  point and no cache can help it there. The first time per agent this is logged (a warning naming the
  agent and where: message index and character offset, which tool and JSON path, or the token
  offset); :meth:`AnchorBook.stats` always lists it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from agentkv.client import ErrorCounter, TaggedRequest, install, on_request

__all__ = ["Anchor", "AnchorBook", "Divergence", "Structure", "common_prefix", "same_server"]

logger = logging.getLogger("agentkv.warmup")

DEFAULT_BLOCK_SIZE: Final = 32

# Request fields that change how a chat request is rendered into tokens (vLLM chat + tokenize APIs).
_CHAT_RENDER_KEYS: Final = (
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "mm_processor_kwargs",
)
_TOKENIZE_CHAT_KEYS: Final = frozenset(
    {"messages", "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
     "continue_final_message", "add_special_tokens", "mm_processor_kwargs"}
)
# Fields that must be identical for two calls to share cached blocks, without being rendered.
_CACHE_KEYS: Final = ("cache_salt",)
_PREFIX_ROLES: Final = frozenset({"system", "developer"})
_SNIPPET: Final = 24


def _dumps(value: Any) -> str:
    """Canonical JSON *keeping key order* (the template renders dicts in their order)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _dumps_sorted(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False)


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


_LOOPBACK: Final = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def same_server(url_a: str, url_b: str) -> bool:
    """Whether two base URLs name the same server (scheme-less host:port; loopback names are equal)."""
    a, b = urlsplit(str(url_a)), urlsplit(str(url_b))
    host_a = "loopback" if (a.hostname or "") in _LOOPBACK else (a.hostname or "")
    host_b = "loopback" if (b.hostname or "") in _LOOPBACK else (b.hostname or "")
    return host_a == host_b and (a.port or _default_port(a.scheme)) == (b.port or _default_port(b.scheme))


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


# --------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Structure:
    """The prompt-determining parts of one call as canonical JSON strings (key order kept)."""

    kind: str  # "chat" | "completion"
    model: str | None
    first: str | None  # messages[0] (chat)
    tools: tuple[str, ...] = ()
    tool_names: tuple[str, ...] = ()
    options: tuple[tuple[str, str], ...] = ()  # (key, canonical JSON) of render/cache options


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


@dataclass(frozen=True, slots=True)
class Anchor:
    """An agent's warmable prefix: exact token ids (``tokens``) and/or a chat replay (``chat``).

    ``tokens`` is floored to ``block_size``; ``shared_tokens`` is the unfloored common prefix.
    ``source``: ``cross-session`` (common prefix of two sessions' calls), ``structural`` (one call
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
    last_structure: Structure | None = None
    last_seen: float = 0.0
    calls: int = 0
    sessions: int = 0
    anchor: Anchor | None = None
    anchor_key: tuple[Any, ...] | None = None
    divergence: Divergence | None = None
    divergences: int = 0
    logged: bool = False
    token_checked: tuple[int, int] | None = None


# --------------------------------------------------------------------------------------
# Structural comparison (the lint)
# --------------------------------------------------------------------------------------


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


def _tool_name(tool: Any) -> str:
    if isinstance(tool, Mapping):
        fn = tool.get("function")
        if isinstance(fn, Mapping) and fn.get("name"):
            return str(fn["name"])
        if tool.get("name"):
            return str(tool["name"])
    return "?"


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
        if _dumps_sorted(ja) == _dumps_sorted(jb):
            detail = f"tool {name!r}: same definition, key order changed at {path} (the template renders key order)"
        else:
            detail = f"tool {name!r} changed at {path} ({what})"
        return Divergence(agent, f"tools[{i}]", detail, tool=name)
    return Divergence(agent, "tools", "tools differ")


# --------------------------------------------------------------------------------------
# The book
# --------------------------------------------------------------------------------------

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
        self.max_agents = max_agents
        self.clock = clock
        self._log = log
        self.errors = ErrorCounter(log)
        self._agents: OrderedDict[str, _Agent] = OrderedDict()
        self._lock = threading.Lock()
        self._ids = 0
        self._unsubscribe: Callable[[], None] | None = None
        self.counts = {"captured": 0, "ignored": 0, "other_server": 0}

    # -- subscription ------------------------------------------------------------------

    def attach(self) -> AnchorBook:
        """Subscribe :meth:`observe` to ``agentkv.client.on_request`` (idempotent)."""
        install()
        if self._unsubscribe is None:
            self._unsubscribe = on_request(self.observe)
        return self

    def detach(self) -> None:
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
            if not (url.endswith("/completions") or url in ("completions", "chat/completions")):
                self.counts["ignored"] += 1
                return
            self.capture(request.tag.agent, request.tag.session, request.json_data)
        except Exception as exc:
            self.errors.record("anchor capture", exc)

    def capture(self, agent: str, session: str | None, body: Any, *, now: float | None = None) -> bool:
        """Record one real call of ``agent`` (a chat or completions request body); False if unusable.

        ``body`` is only read: it is serialized here, so later changes to it do not matter.
        """
        snapshot = _snapshot(body)
        if snapshot is None:
            self.counts["ignored"] += 1
            return False
        structure, make_payload, extra, first_role, make_ids = snapshot
        tool_choice = body.get("tool_choice") if structure.kind == "chat" else None
        now = self.clock() if now is None else now
        finding: Divergence | None = None
        with self._lock:
            record = self._agents.get(agent)
            latest = None if record is None else record.latest
            keep = (latest is None or session is None or session != latest.session
                    or latest.structure.model != structure.model or latest.structure.kind != structure.kind)
            self._ids += 1
            capture = _Capture(self._ids, session, now, structure, make_payload() if keep else "", extra, first_role,
                               make_ids() if keep else None, tool_choice)
            if record is None:
                record = self._agents[agent] = _Agent()
                while len(self._agents) > self.max_agents:
                    self._agents.popitem(last=False)
            else:
                self._agents.move_to_end(agent)
            record.calls += 1
            record.last_seen = now
            if record.last_structure is not None and record.last_structure != structure:
                finding = diff_structures(agent, record.last_structure, structure)
            record.last_structure = structure
            latest = record.latest
            if latest is None:
                record.latest, record.sessions = capture, 1
            elif latest.structure.model != structure.model or latest.structure.kind != structure.kind:
                record.latest, record.ref, record.sessions = capture, None, 1  # another model: start over
            elif session is None or session != latest.session:
                record.ref, record.latest = latest, capture
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
            latest, ref, block = record.latest, record.ref, max(1, int(self.block_size or DEFAULT_BLOCK_SIZE))
            key = (latest.id, None if ref is None else ref.id, block, tokenize is None)
            if record.anchor_key == key:
                return record.anchor
        if tokenize is None:
            anchor = self._chat_anchor(agent, latest, block)
        else:
            anchor = self._token_anchor(agent, record, latest, ref, block, tokenize)
        with self._lock:
            if record.latest is latest and record.ref is ref:
                record.anchor, record.anchor_key = anchor, key
        return anchor

    def _chat_anchor(self, agent: str, latest: _Capture, block: int) -> Anchor | None:
        if latest.structure.kind != "chat" or latest.first_role not in _PREFIX_ROLES:
            return None
        payload = _replay_payload(latest)
        return Anchor(agent, latest.structure.model, (), block, "chat", 0, dict(latest.extra), payload)

    def _token_anchor(
        self, agent: str, record: _Agent, latest: _Capture, ref: _Capture | None, block: int, tokenize: Tokenize
    ) -> Anchor | None:
        mine = _tokens_of(latest, tokenize)
        if ref is not None:
            theirs = _tokens_of(ref, tokenize)
            shared = common_prefix(mine, theirs)
            source = "cross-session" if latest.structure.kind == "chat" else "prompt"
            self._check_tokens(agent, record, latest, ref, shared, tokenize)
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


def _snapshot(
    body: Any,
) -> tuple[Structure, Callable[[], str], dict[str, Any], str | None, Callable[[], tuple[int, ...] | None]] | None:
    """(structure, /tokenize payload JSON maker, cache fields, messages[0] role, token-id prompt maker).

    The makers serialize the whole call; they are only called for the calls kept for tokenization
    (the first call of each session), so the long histories of later calls are never copied.
    """
    if not isinstance(body, Mapping):
        return None
    model = body.get("model")
    model = None if model is None else str(model)
    extra = {k: body[k] for k in _CACHE_KEYS if body.get(k) is not None}
    messages = body.get("messages")
    if isinstance(messages, Sequence) and not isinstance(messages, str | bytes) and messages:
        tools = body.get("tools") or []  # None and [] render alike; [] is never sent back (vLLM rejects it)
        tool_json = tuple(_dumps(t) for t in tools)
        options = tuple(
            (k, _dumps(body[k])) for k in (*_CHAT_RENDER_KEYS, *_CACHE_KEYS)
            if body.get(k) is not None and k not in ("add_generation_prompt", "continue_final_message")
        )
        first = messages[0]
        structure = Structure("chat", model, _dumps(first), tool_json, tuple(_tool_name(t) for t in tools), options)

        def chat_payload() -> str:
            payload: dict[str, Any] = {"messages": list(messages)}
            if tools:
                payload["tools"] = list(tools)
            for key in _CHAT_RENDER_KEYS:
                if body.get(key) is not None and key in _TOKENIZE_CHAT_KEYS:
                    payload[key] = body[key]
            return _dumps(payload)

        role = first.get("role") if isinstance(first, Mapping) else None
        return structure, chat_payload, extra, None if role is None else str(role), lambda: None
    prompt = body.get("prompt")
    options = tuple((k, _dumps(body[k])) for k in _CACHE_KEYS if body.get(k) is not None)
    if isinstance(prompt, str):

        def prompt_payload() -> str:
            payload = {"prompt": prompt}
            if body.get("add_special_tokens") is not None:
                payload["add_special_tokens"] = body["add_special_tokens"]
            return _dumps(payload)

        return Structure("completion", model, None, (), (), options), prompt_payload, extra, None, lambda: None
    if isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], int) and not isinstance(prompt[0], bool):

        def ids() -> tuple[int, ...]:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("a token-id prompt must hold integers only")
            return tuple(prompt)

        return Structure("completion", model, None, (), (), options), lambda: "{}", extra, None, ids
    return None
