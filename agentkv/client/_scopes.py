"""Scopes that set the current tag: :func:`agent` (one dispatch) and :func:`use_tag` (a given tag).

Invariant: a scope restores the tag that was current before it when it exits.
"""

from __future__ import annotations

from collections.abc import Callable

from agentkv.protocol import AgentTag

from ._hooks import Dispatch, dispatch_ended
from ._ids import UNSET, Unset, sanitize_id
from ._lineage import tracker
from ._sdk import install
from ._tags import TagToken, current_tag, push_tag, reset_tag

__all__ = ["TagScope", "agent", "use_tag"]


class TagScope:
    """Sets the current tag for a ``with``/``async with`` block and restores the previous one.

    With ``make_dispatch``, entering records a dispatch (its tag becomes current) and exiting
    reports that dispatch ended to the :func:`~agentkv.client.on_dispatch_end` listeners.
    """

    def __init__(self, make_tag: Callable[[], AgentTag | None], make_dispatch: Callable[[], Dispatch] | None = None):
        self._make_tag = make_tag
        self._make_dispatch = make_dispatch
        self._token: TagToken | None = None
        self.tag: AgentTag | None = None
        self.dispatch: Dispatch | None = None

    def __enter__(self) -> AgentTag | None:
        install()
        if self._make_dispatch is not None:
            self.dispatch = self._make_dispatch()
            self.tag = self.dispatch.tag
        else:
            self.tag = self._make_tag()
        self._token = push_tag(self.tag)
        return self.tag

    def __exit__(self, *exc: object) -> None:
        token, self._token = self._token, None
        if token is not None:
            reset_tag(token)
        if self.dispatch is not None:
            dispatch_ended(self.dispatch)

    async def __aenter__(self) -> AgentTag | None:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)


def use_tag(tag: AgentTag | None) -> TagScope:
    """Send every OpenAI request in this block with ``tag`` (no dispatch is recorded).

    For components that build their own tags, e.g. the warm-up coordinator:
    ``with use_tag(AgentTag("planner", session=s, warmup=True)): client.completions.create(...)``.
    Works as ``with`` and ``async with``.
    """
    return TagScope(lambda: tag)


def agent(
    name: str,
    session: str | None = None,
    parent: str | Unset | None = UNSET,
    *,
    step: int | Unset | None = UNSET,
) -> TagScope:
    """Run a block as one dispatch of agent ``name``: every OpenAI request inside is tagged.

    ``with agentkv.agent("planner", session="s1"): client.chat.completions.create(...)``
    (or ``async with``). Entering records a dispatch: the parent is the previous agent
    dispatched in ``session`` (``""`` for the first), the step increments, and the
    :func:`~agentkv.client.on_dispatch` listeners run. ``session=None`` inherits the session of an
    enclosing tag, if any (with none, the server recognizes the session from the prompt). ``name``
    and ``session`` are sanitized to valid protocol ids. The tag is
    visible to code in the same context: asyncio tasks started inside get a copy; a thread does
    not (Python copies no context into threads): run its work in ``contextvars.copy_context().run``.
    """

    def make() -> Dispatch:
        sess = session
        if sess is None:
            outer = current_tag()
            sess = None if outer is None else outer.session
        agent_id = sanitize_id(name)
        sess_id = None if sess is None else sanitize_id(sess)
        par = parent if isinstance(parent, Unset) or parent in (None, "") else sanitize_id(parent)
        return tracker().dispatch(agent_id, sess_id, parent=par, step=step, framework="manual", node=str(name))

    return TagScope(lambda: None, make)
