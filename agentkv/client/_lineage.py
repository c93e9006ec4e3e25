"""Per-session lineage shared by every adapter: who ran last in a session, and at which step."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Final

from agentkv._bounded import BoundedDict

from ._errors import count
from ._hooks import DISPATCH, SESSION_END, Dispatch
from ._ids import UNSET, Unset

__all__ = ["SessionTracker", "tracker"]


@dataclass(slots=True)
class _SessionState:
    last_agent: str | None = None  # None: no dispatch yet in this session
    step: int = 0


class SessionTracker:
    """Per-session lineage: the last agent dispatched and the step counter of each session.

    Shared by every adapter so that mixing (e.g. a LangGraph app calling ``agentkv.agent``) keeps
    one lineage per session. Bounded: at most ``max_sessions`` sessions, the least recently
    dispatched (or started) forgotten first. Thread-safe.
    """

    def __init__(self, max_sessions: int = 100_000) -> None:
        self._sessions: BoundedDict[str, _SessionState] = BoundedDict(max_sessions)
        self._lock = threading.Lock()

    def _state(self, session: str) -> _SessionState:
        state = self._sessions.get(session)
        if state is None:
            state = _SessionState()
            self._sessions[session] = state
        else:
            self._sessions.touch(session)
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
        parent: str | Unset | None = UNSET,
        step: int | Unset | None = UNSET,
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
                parent_v = None if isinstance(parent, Unset) else parent
                step_v = None if isinstance(step, Unset) else step
            else:
                state = self._state(session)
                if isinstance(parent, Unset):
                    parent_v = "" if state.last_agent is None else state.last_agent
                else:
                    parent_v = parent
                step_v: int | None = state.step + 1 if isinstance(step, Unset) else step
                state.last_agent = agent
                if step_v is not None:
                    state.step = max(state.step, step_v)
        record = Dispatch(agent, session, parent_v, step_v, framework, node, app)
        count("dispatches")
        if notify:
            DISPATCH.notify(record)
        return record

    def start_session(
        self, session: str, *, keep_lineage: bool = False, after: tuple[str, int] | None = None
    ) -> None:
        """Begin a new episode of ``session``: the next dispatch is a first dispatch (parent ``""``), or,
        ``after=(agent, step)``, follows a turn that ran before the session (e.g. in a saved conversation)."""
        with self._lock:
            state = self._state(session)
            if after is not None:
                state.last_agent, state.step = after[0], max(state.step, after[1])
            elif not keep_lineage:
                state.last_agent = None

    def end_session(self, session: str, *, notify: bool = True) -> None:
        """An episode of ``session`` ended: notify the listeners.

        The lineage is kept so that resuming (a LangGraph interrupt, a new AutoGen run continuing the
        conversation) can continue it; :meth:`start_session` decides whether the next episode does.
        """
        if notify:
            SESSION_END.notify(session)

    def __len__(self) -> int:
        return len(self._sessions)


_TRACKER: Final = SessionTracker()


def tracker() -> SessionTracker:
    """The process-wide session tracker shared by all adapters."""
    return _TRACKER
