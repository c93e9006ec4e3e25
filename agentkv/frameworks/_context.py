"""The tagging core: the current agent tag, per-session lineage, dispatch hooks, OpenAI header injection.

How a tag reaches the wire: a ``ContextVar`` holds the :class:`~agentkv.protocol.AgentTag` of the
code that is running; :func:`install` wraps the openai SDK's ``SyncAPIClient._prepare_options`` and
``AsyncAPIClient._prepare_options`` (the SDK's documented hook for mutating request options, called
once per attempt for ``create``, streaming and raw responses) so every request sent while a tag is
set carries ``tag.to_headers()``. Framework adapters only have to set the ContextVar at the right
moment (see ``agentkv.frameworks.langgraph`` and ``agentkv.frameworks.autogen``).

Seams for other components (the warm-up coordinator, a client-side TransitionLearner):

* :func:`on_dispatch` -- called once per agent dispatch with a :class:`Dispatch` record;
* :func:`on_dispatch_end` -- called when that dispatch finishes (the pause before the next agent);
* :func:`on_session_end` -- called when an adapter ends a session (invoke/run finished);
* :func:`on_request` -- called for every tagged OpenAI request with a :class:`TaggedRequest`
  (agent, url, JSON body): the raw material for per-agent anchors.

Nothing here may break the user's call: every failure inside agentkv code is caught, counted in
:func:`stats` and logged once per kind.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import logging
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from agentkv.protocol import HEADER_AGENT, HEADER_VLLM_SESSION, MAX_ID_LENGTH, AgentTag

__all__ = [
    "UNSET",
    "Dispatch",
    "ErrorCounter",
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

logger = logging.getLogger("agentkv.frameworks")

_CURRENT: Final[contextvars.ContextVar[AgentTag | None]] = contextvars.ContextVar("agentkv_tag", default=None)

_INVALID_ID_CHARS: Final = re.compile(r"[^A-Za-z0-9._:@/-]")


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()
"""Sentinel: "work it out from the session's lineage" (as opposed to ``None`` = unknown)."""


def sanitize_id(value: object, *, fallback: str = "_") -> str:
    """Make any framework name a valid protocol id (1-128 chars of ``[A-Za-z0-9._:@/-]``).

    Invalid characters become ``_``; names longer than 128 characters are cut and get a short
    hash suffix so that two long names sharing a prefix stay distinct. Valid ids are unchanged.
    """
    text = str(value) if value is not None else ""
    clean = _INVALID_ID_CHARS.sub("_", text) or fallback
    if len(clean) > MAX_ID_LENGTH:
        digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        clean = f"{clean[: MAX_ID_LENGTH - 9]}-{digest}"
    return clean


# --------------------------------------------------------------------------------------
# Error accounting: never raise into the user's code, log each kind once.
# --------------------------------------------------------------------------------------


class ErrorCounter:
    """Counts swallowed errors by kind and logs the first of each kind once."""

    def __init__(self, log: logging.Logger = logger) -> None:
        self.by_kind: Counter[str] = Counter()
        self._log = log
        self._lock = threading.Lock()

    def record(self, kind: str, exc: BaseException | None = None, message: str = "") -> None:
        with self._lock:
            first = self.by_kind[kind] == 0
            self.by_kind[kind] += 1
        if first:
            detail = message or (f"{type(exc).__name__}: {exc}" if exc is not None else "error")
            self._log.warning(
                "agentkv: %s failed (%s); the application is unaffected, further failures are only counted",
                kind,
                detail,
            )

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


ERRORS: Final = ErrorCounter()
_COUNTS: Counter[str] = Counter()


def stats() -> dict[str, Any]:
    """Counters of the client side: tagged requests, dispatches, swallowed errors by kind."""
    return {"counts": dict(_COUNTS), "errors": dict(ERRORS.by_kind), "installed": installed()}


# --------------------------------------------------------------------------------------
# Records and listeners
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dispatch:
    """One agent dispatch: ``agent`` starts running in ``session`` after ``parent``.

    ``parent`` is ``""`` for the first dispatch of a session and ``None`` when unknown; ``step``
    is the dispatch step (LangGraph's superstep, a counter elsewhere). ``framework`` is
    ``"langgraph"``, ``"autogen"`` or ``"manual"``; ``node`` is the framework's own name for the
    dispatched unit (LangGraph node, AutoGen participant) before sanitizing; ``app`` identifies the
    instrumented app (unique per ``instrument()`` call).
    """

    agent: str
    session: str | None
    parent: str | None
    step: int | None
    framework: str = "manual"
    node: str | None = None
    app: str | None = None
    time: float = field(default_factory=time.time)

    @property
    def tag(self) -> AgentTag:
        return AgentTag(self.agent, session=self.session, parent=self.parent, step=self.step)


@dataclass(frozen=True, slots=True)
class TaggedRequest:
    """An OpenAI SDK request that left with agentkv headers (see :func:`on_request`).

    ``json_data`` is the request body as the SDK will send it (``model``, ``messages``, ``tools``,
    ...); it is shared with the SDK, so listeners must not mutate it. ``base_url`` is the client's
    base URL (the vLLM server), ``url`` the path relative to it.
    """

    tag: AgentTag
    method: str
    url: str
    base_url: str
    json_data: Any


_dispatch_listeners: list[Callable[[Dispatch], Any]] = []
_dispatch_end_listeners: list[Callable[[Dispatch], Any]] = []
_session_end_listeners: list[Callable[[str], Any]] = []
_request_listeners: list[Callable[[TaggedRequest], Any]] = []
_listeners_lock = threading.Lock()


def _subscribe(table: list[Any], fn: Callable[..., Any]) -> Callable[[], None]:
    with _listeners_lock:
        table.append(fn)

    def unsubscribe() -> None:
        with _listeners_lock:
            if fn in table:
                table.remove(fn)

    return unsubscribe


def on_dispatch(fn: Callable[[Dispatch], Any]) -> Callable[[], None]:
    """Call ``fn(dispatch)`` on every agent dispatch (all adapters); returns an unsubscribe function.

    Listeners run synchronously on the dispatching thread, before the agent's first LLM request,
    so they must be quick (hand work to a queue/thread). Their exceptions are swallowed and counted.
    """
    return _subscribe(_dispatch_listeners, fn)


def on_dispatch_end(fn: Callable[[Dispatch], Any]) -> Callable[[], None]:
    """Call ``fn(dispatch)`` when a dispatch finishes (LangGraph node run, AutoGen turn, ``agent()`` block).

    The pause before the next agent: the moment to warm its anchor. Same rules as :func:`on_dispatch`.
    """
    return _subscribe(_dispatch_end_listeners, fn)


def dispatch_ended(dispatch: Dispatch) -> None:
    """Adapters call this when a dispatch they recorded finishes."""
    _notify(_dispatch_end_listeners, "dispatch end", dispatch)


def on_session_end(fn: Callable[[str], Any]) -> Callable[[], None]:
    """Call ``fn(session)`` when an adapter ends a session (an invoke/stream/run finished)."""
    return _subscribe(_session_end_listeners, fn)


def on_request(fn: Callable[[TaggedRequest], Any]) -> Callable[[], None]:
    """Call ``fn(request)`` for every OpenAI SDK request sent with agentkv headers (each attempt)."""
    return _subscribe(_request_listeners, fn)


def _notify(table: list[Any], kind: str, *args: Any) -> None:
    if not table:
        return
    with _listeners_lock:
        listeners = list(table)
    for fn in listeners:
        try:
            fn(*args)
        except Exception as exc:
            ERRORS.record(f"{kind} listener", exc)


def learner_listener(learner: Any) -> Callable[[Dispatch], None]:
    """Adapt a ``TransitionLearner`` (anything with ``observe(agent, session, parent)``) to :func:`on_dispatch`."""

    def listener(d: Dispatch) -> None:
        learner.observe(d.agent, d.session, d.parent)

    return listener


# --------------------------------------------------------------------------------------
# Session lineage
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _SessionState:
    last_agent: str | None = None  # None: no dispatch yet in this session
    step: int = 0


class SessionTracker:
    """Per-session lineage: the last agent dispatched and the step counter of each session.

    Shared by every adapter so that mixing (e.g. a LangGraph app calling ``agentkv.agent``) keeps
    one lineage per session. Bounded: the least recently used sessions are forgotten first.
    """

    def __init__(self, max_sessions: int = 100_000) -> None:
        self._sessions: OrderedDict[str, _SessionState] = OrderedDict()
        self._max = max_sessions
        self._lock = threading.Lock()

    def _state(self, session: str) -> _SessionState:
        state = self._sessions.get(session)
        if state is None:
            state = self._sessions[session] = _SessionState()
            while len(self._sessions) > self._max:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(session)
        return state

    def last_agent(self, session: str | None) -> str | None:
        if session is None:
            return None
        with self._lock:
            state = self._sessions.get(session)
            return None if state is None else state.last_agent

    def parent_for(self, session: str | None) -> str | None:
        """The parent a new dispatch in ``session`` would get: last agent, ``""`` if first, None if no session."""
        if session is None:
            return None
        with self._lock:
            state = self._sessions.get(session)
            return "" if state is None or state.last_agent is None else state.last_agent

    def dispatch(
        self,
        agent: str,
        session: str | None,
        *,
        parent: str | _Unset | None = UNSET,
        step: int | _Unset | None = UNSET,
        framework: str = "manual",
        node: str | None = None,
        app: str | None = None,
        notify: bool = True,
    ) -> Dispatch:
        """Record that ``agent`` starts in ``session`` and notify the dispatch listeners.

        ``parent``/``step`` left UNSET are derived from the session (previous agent, or ``""``
        for the first dispatch; previous step + 1). Without a session nothing is tracked: parent
        and step are None unless given.
        """
        with self._lock:
            if session is None:
                parent_v = None if isinstance(parent, _Unset) else parent
                step_v = None if isinstance(step, _Unset) else step
            else:
                state = self._state(session)
                if isinstance(parent, _Unset):
                    parent_v = "" if state.last_agent is None else state.last_agent
                else:
                    parent_v = parent
                step_v: int | None = state.step + 1 if isinstance(step, _Unset) else step
                state.last_agent = agent
                if step_v is not None:
                    state.step = max(state.step, step_v)
        record = Dispatch(agent, session, parent_v, step_v, framework, node, app)
        _COUNTS["dispatches"] += 1
        if notify:
            _notify(_dispatch_listeners, "dispatch", record)
        return record

    def start_session(self, session: str, *, keep_lineage: bool = False) -> None:
        """Begin a new episode of ``session``: the next dispatch is a first dispatch (parent ``""``)."""
        with self._lock:
            state = self._state(session)
            if not keep_lineage:
                state.last_agent = None

    def end_session(self, session: str, *, notify: bool = True) -> None:
        """An episode of ``session`` ended: notify the listeners.

        The lineage is kept so that resuming (a LangGraph interrupt, a new AutoGen run continuing the
        conversation) can continue it; :meth:`start_session` decides whether the next episode does.
        """
        if notify:
            _notify(_session_end_listeners, "session_end", session)

    def forget(self, session: str) -> None:
        with self._lock:
            self._sessions.pop(session, None)

    def __len__(self) -> int:
        return len(self._sessions)


_TRACKER: Final = SessionTracker()


def tracker() -> SessionTracker:
    """The process-wide session tracker shared by all adapters."""
    return _TRACKER


# --------------------------------------------------------------------------------------
# The current tag
# --------------------------------------------------------------------------------------


def current_tag() -> AgentTag | None:
    """The tag that an OpenAI request sent from here would carry (None: untagged)."""
    return _CURRENT.get()


def set_tag(tag: AgentTag | None) -> AgentTag | None:
    """Set the current tag in this context; returns the previous one (restore it with ``set_tag(prev)``)."""
    previous = _CURRENT.get()
    _CURRENT.set(tag)
    return previous


class _TagScope:
    """Sets the current tag for a ``with``/``async with`` block and restores the previous one."""

    def __init__(self, make_tag: Callable[[], AgentTag | None], make_dispatch: Callable[[], Dispatch] | None = None):
        self._make_tag = make_tag
        self._make_dispatch = make_dispatch
        self._token: contextvars.Token[AgentTag | None] | None = None
        self.tag: AgentTag | None = None
        self.dispatch: Dispatch | None = None

    def __enter__(self) -> AgentTag | None:
        install()
        if self._make_dispatch is not None:
            self.dispatch = self._make_dispatch()
            self.tag = self.dispatch.tag
        else:
            self.tag = self._make_tag()
        self._token = _CURRENT.set(self.tag)
        return self.tag

    def __exit__(self, *exc: object) -> None:
        token, self._token = self._token, None
        if token is not None:
            try:
                _CURRENT.reset(token)
            except ValueError:  # exited in another context (e.g. a generator moved across tasks)
                _CURRENT.set(None)
        if self.dispatch is not None:
            dispatch_ended(self.dispatch)

    async def __aenter__(self) -> AgentTag | None:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)


def use_tag(tag: AgentTag | None) -> _TagScope:
    """Send every OpenAI request in this block with ``tag`` (no dispatch is recorded).

    For components that build their own tags, e.g. the warm-up coordinator:
    ``with use_tag(AgentTag("planner", session=s, warmup=True)): client.completions.create(...)``.
    Works as ``with`` and ``async with``.
    """
    return _TagScope(lambda: tag)


def agent(
    name: str,
    session: str | None = None,
    parent: str | _Unset | None = UNSET,
    *,
    step: int | _Unset | None = UNSET,
) -> _TagScope:
    """Run a block as one dispatch of agent ``name``: every OpenAI request inside is tagged.

    ``with agentkv.agent("planner", session="s1"): client.chat.completions.create(...)``
    (or ``async with``). Entering records a dispatch: the parent is the previous agent
    dispatched in ``session`` (``""`` for the first), the step increments, and the
    :func:`on_dispatch` listeners run. ``session=None`` inherits the session of an enclosing
    tag, if any. ``name`` and ``session`` are sanitized to valid protocol ids. The tag is
    visible to code in the same context (threads and asyncio tasks started inside get a copy).
    """

    def make() -> Dispatch:
        sess = session
        if sess is None:
            outer = _CURRENT.get()
            sess = None if outer is None else outer.session
        agent_id = sanitize_id(name)
        sess_id = None if sess is None else sanitize_id(sess)
        par = parent if isinstance(parent, _Unset) or parent in (None, "") else sanitize_id(parent)
        return _TRACKER.dispatch(agent_id, sess_id, parent=par, step=step, framework="manual", node=str(name))

    return _TagScope(lambda: None, make)


# --------------------------------------------------------------------------------------
# openai SDK patch
# --------------------------------------------------------------------------------------

_PATCH_MARK: Final = "__agentkv_wrapped__"
_install_lock = threading.Lock()
_originals: dict[type, Callable[..., Any]] = {}


def _tag_options(client: Any, options: Any) -> None:
    """Add the current tag's headers to ``options`` (a FinalRequestOptions); never raises."""
    tag = _CURRENT.get()
    if tag is None:
        return
    try:
        headers = options.headers
        existing: Mapping[str, Any] = headers if isinstance(headers, Mapping) else {}
        if any(str(k).lower() == HEADER_AGENT.lower() for k in existing):
            return  # the caller tagged this request explicitly: theirs wins
        merged = dict(existing)
        merged.update(tag.to_headers())
        merged.update(routing_header(tag.agent, tag.session))
        options.headers = merged  # a new mapping: the caller's extra_headers stay untouched
        _COUNTS["tagged_requests"] += 1
        if _request_listeners:
            request = TaggedRequest(
                tag=tag,
                method=str(getattr(options, "method", "")),
                url=str(getattr(options, "url", "")),
                base_url=str(getattr(client, "base_url", "")),
                json_data=getattr(options, "json_data", None),
            )
            _notify(_request_listeners, "request", request)
    except Exception as exc:
        ERRORS.record("request tagging", exc)


def _wrap_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _prepare_options(self: Any, options: Any) -> Any:
        options = original(self, options)
        _tag_options(self, options)
        return options

    setattr(_prepare_options, _PATCH_MARK, original)
    return _prepare_options


def _wrap_async(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def _prepare_options(self: Any, options: Any) -> Any:
        options = await original(self, options)
        _tag_options(self, options)
        return options

    setattr(_prepare_options, _PATCH_MARK, original)
    return _prepare_options


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


def install() -> bool:
    """Patch the openai SDK once (idempotent, thread-safe); True when requests can be tagged.

    Wraps ``SyncAPIClient._prepare_options`` and ``AsyncAPIClient._prepare_options``: the original
    runs first, unchanged, then the current tag's headers are added to the prepared options.
    Subclasses (``OpenAI``, ``AzureOpenAI``, ...) reach it through ``super()``. Headers the caller
    set explicitly (``X-AgentKV-Agent`` present) are left alone.
    """
    with _install_lock:
        if _originals:
            return True
        try:
            from openai import _base_client
        except Exception as exc:  # openai missing or broken: tagging is simply off
            ERRORS.record("openai import", exc)
            return False
        targets = [(getattr(_base_client, "SyncAPIClient", None), _wrap_sync)]
        targets.append((getattr(_base_client, "AsyncAPIClient", None), _wrap_async))
        for cls, wrap in targets:
            original = None if cls is None else cls.__dict__.get("_prepare_options")
            if original is None:
                ERRORS.record("openai patch", message=f"{getattr(cls, '__name__', cls)}._prepare_options not found")
                continue
            if getattr(original, _PATCH_MARK, None) is not None:  # patched by another copy of this module
                _originals[cls] = getattr(original, _PATCH_MARK)
                continue
            _originals[cls] = original
            cls._prepare_options = wrap(original)
        return bool(_originals)


def installed() -> bool:
    return bool(_originals)


def uninstall() -> None:
    """Restore the openai SDK's original hooks (mostly for tests)."""
    with _install_lock:
        for cls, original in _originals.items():
            cls._prepare_options = original
        _originals.clear()
