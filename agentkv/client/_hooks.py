"""The hook bus: records of dispatches, requests and responses, and their listeners.

Listeners run synchronously on the thread that produced the record; their exceptions are swallowed,
counted in :data:`~agentkv.client.ERRORS` as ``"<kind> listener"`` and logged once per kind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from agentkv.protocol import AgentTag

from ._errors import ERRORS

__all__ = [
    "Dispatch",
    "Listeners",
    "TaggedRequest",
    "TaggedResponse",
    "dispatch_ended",
    "learner_listener",
    "on_dispatch",
    "on_dispatch_end",
    "on_request",
    "on_session_end",
]

R = TypeVar("R")


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


@dataclass(frozen=True, slots=True)
class TaggedResponse:
    """The answer to one tagged SDK request (see :func:`on_response`).

    ``cached_tokens`` is the server's prefix-cache hit for the prompt (None when unknown: a stream,
    a server without ``--enable-prompt-tokens-details``, a non-JSON body).
    """

    tag: AgentTag
    url: str
    base_url: str
    status: int
    prompt_tokens: int | None
    cached_tokens: int | None
    streamed: bool = False


class Listeners(Generic[R]):
    """The subscribers of one kind of record; :meth:`notify` never raises.

    Invariant: a listener is called for every record notified between its :meth:`subscribe` and
    the call of the unsubscribe function it returned, in subscription order.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: list[Callable[[R], Any]] = []
        self._lock = threading.Lock()

    def subscribe(self, fn: Callable[[R], Any]) -> Callable[[], None]:
        with self._lock:
            self._fns.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._fns:
                    self._fns.remove(fn)

        return unsubscribe

    def __bool__(self) -> bool:
        return bool(self._fns)

    def notify(self, record: R) -> None:
        if not self._fns:
            return
        with self._lock:
            listeners = list(self._fns)
        for fn in listeners:
            try:
                fn(record)
            except Exception as exc:
                ERRORS.record(f"{self.kind} listener", exc)


DISPATCH: Listeners[Dispatch] = Listeners("dispatch")
DISPATCH_END: Listeners[Dispatch] = Listeners("dispatch end")
SESSION_END: Listeners[str] = Listeners("session_end")
REQUEST: Listeners[TaggedRequest] = Listeners("request")
RESPONSE: Listeners[TaggedResponse] = Listeners("response")


def on_dispatch(fn: Callable[[Dispatch], Any]) -> Callable[[], None]:
    """Call ``fn(dispatch)`` on every agent dispatch (all adapters); returns an unsubscribe function.

    Listeners run synchronously on the dispatching thread, before the agent's first LLM request,
    so they must be quick (hand work to a queue/thread). Their exceptions are swallowed and counted.
    """
    return DISPATCH.subscribe(fn)


def on_dispatch_end(fn: Callable[[Dispatch], Any]) -> Callable[[], None]:
    """Call ``fn(dispatch)`` when a dispatch finishes (LangGraph node run, AutoGen turn, ``agent()`` block).

    The pause before the next agent: the moment to warm its anchor. Same rules as :func:`on_dispatch`.
    """
    return DISPATCH_END.subscribe(fn)


def dispatch_ended(dispatch: Dispatch) -> None:
    """Adapters call this when a dispatch they recorded finishes."""
    DISPATCH_END.notify(dispatch)


def on_session_end(fn: Callable[[str], Any]) -> Callable[[], None]:
    """Call ``fn(session)`` when an adapter ends a session (an invoke/stream/run finished)."""
    return SESSION_END.subscribe(fn)


def on_request(fn: Callable[[TaggedRequest], Any]) -> Callable[[], None]:
    """Call ``fn(request)`` for every OpenAI SDK request sent with agentkv headers (each attempt)."""
    return REQUEST.subscribe(fn)


def learner_listener(learner: Any) -> Callable[[Dispatch], None]:
    """Adapt a ``TransitionLearner`` (anything with ``observe(agent, session, parent)``) to :func:`on_dispatch`."""

    def listener(d: Dispatch) -> None:
        learner.observe(d.agent, d.session, d.parent)

    return listener
