"""AutoGen AgentChat adapter: ``instrument(team)`` tags every model call with its agent and lineage.

    team = SelectorGroupChat([planner, coder, critic], model_client=client)
    agentkv.frameworks.autogen.instrument(team, events_url="http://127.0.0.1:8000")
    await team.run(task="...")

Seams (autogen-agentchat 0.7.5): each participant's ``_model_client`` and the team's (the selector's,
also its manager's if created already) are replaced by a :class:`TaggedModelClient`; each participant's
``on_messages_stream`` is wrapped to mark a speaker turn (one dispatch per turn, parent = previous
speaker; in a ``GraphFlow``, the speaker whose edge led to it: :mod:`._autogen_graph`); the team's
``run_stream`` is wrapped to open a session (or go on with the team's conversation), ``reset`` and
``load_state`` to end it (:mod:`._autogen_load`: where the loaded conversation goes on). ``instrument``
mutates the team and returns it, so it stays a real team. The selector's own model calls are tagged
``agent="selector"`` and are not dispatches (see docs/frameworks.md, "AutoGen").
"""

from __future__ import annotations

import threading
import uuid
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Final

from autogen_core import AgentId
from autogen_core.models import ChatCompletionClient

from agentkv.client import (
    ERRORS,
    UNSET,
    Dispatch,
    count,
    dispatch_ended,
    install,
    push_tag,
    reset_tag,
    sanitize_id,
    tracker,
)
from agentkv.protocol import AgentTag

from ._autogen_graph import GraphLineage, digraph_of, team_facts
from ._autogen_load import LoadedConversation, loaded_conversation
from ._events import EventSink, SinkHandle, get_sink, session_event

__all__ = ["TaggedModelClient", "TeamInstrumentation", "instrument", "instrumentation", "team_facts"]

_STATE_ATTR: Final = "_agentkv_instrumentation"
_UNHOOKED: Final = ("the team's manager, created before instrument(), cannot be found: the selector's model calls"
                    " stay untagged, and a GraphFlow's run after its graph's end follows the turns before it")
_TEAMS_ATTR: Final = "_agentkv_teams"  # on a participant: the instrumentations of the teams it is in


class TaggedModelClient(ChatCompletionClient):
    """A ``ChatCompletionClient`` that runs every call of ``inner`` under ``tag_factory()``."""

    def __init__(self, inner: ChatCompletionClient, tag_factory: Callable[[], AgentTag | None]) -> None:
        self._inner = inner
        self._tag_factory = tag_factory

    @property
    def inner(self) -> ChatCompletionClient:
        return self._inner

    def _tag(self) -> AgentTag | None:
        try:
            return self._tag_factory()
        except Exception as exc:
            ERRORS.record("autogen tag", exc)
            return None

    async def create(self, messages: Sequence[Any], **kwargs: Any) -> Any:
        token = push_tag(self._tag())
        try:
            return await self._inner.create(messages, **kwargs)
        finally:
            reset_tag(token)

    def create_stream(self, messages: Sequence[Any], **kwargs: Any) -> AsyncGenerator[Any, None]:
        return self._stream(messages, kwargs)

    async def _stream(self, messages: Sequence[Any], kwargs: dict[str, Any]) -> AsyncGenerator[Any, None]:
        tag = self._tag()
        token = push_tag(tag)
        try:
            stream = self._inner.create_stream(messages, **kwargs)
        finally:
            reset_tag(token)
        # Each step of an async generator runs in its consumer's context: set the tag around each step.
        tagged = _run_under(stream, tag, None)
        try:
            async for item in tagged:
                yield item
        finally:
            await tagged.aclose()  # close the inner stream now, not at garbage collection

    async def close(self) -> None:
        await self._inner.close()

    def actual_usage(self) -> Any:
        return self._inner.actual_usage()

    def total_usage(self) -> Any:
        return self._inner.total_usage()

    def count_tokens(self, messages: Sequence[Any], **kwargs: Any) -> int:
        return self._inner.count_tokens(messages, **kwargs)

    def remaining_tokens(self, messages: Sequence[Any], **kwargs: Any) -> int:
        return self._inner.remaining_tokens(messages, **kwargs)

    @property
    def capabilities(self) -> Any:  # deprecated in AutoGen, still abstract
        return self._inner.capabilities

    @property
    def model_info(self) -> Any:
        return self._inner.model_info

    def dump_component(self) -> Any:
        return self._inner.dump_component()

    def __getattr__(self, name: str) -> Any:
        if name in ("_inner", "_tag_factory"):
            raise AttributeError(name)
        return getattr(self._inner, name)


def _unwrap(client: Any) -> Any:
    while isinstance(client, TaggedModelClient):
        client = client.inner
    return client


# --------------------------------------------------------------------------------------
# Instrumentation state
# --------------------------------------------------------------------------------------


class TeamInstrumentation:
    """What :func:`instrument` attached to a team: session, facts, per-agent current tags."""

    def __init__(
        self,
        team: Any,
        *,
        session: str | Callable[[], str] | None,
        selector_name: str,
        sink: EventSink | SinkHandle | None,
    ) -> None:
        self.team_name = str(getattr(team, "name", type(team).__name__))
        self.facts = team_facts(team)
        self.sink = sink
        self.selector = sanitize_id(selector_name)
        self.app_id = f"autogen-{id(team):x}"
        self._session_spec = session
        self.session: str | None = None  # the running session
        self.conversation: str | None = None  # the session of the team's conversation, until reset
        self._loaded: LoadedConversation | None = None  # a state loaded since, for the next conversation
        self._tags: dict[str, AgentTag] = {}
        self._lock = threading.Lock()
        self.speakers: list[tuple[str, str | None, int | None]] = []  # (agent, parent, step) of the last run
        graph = digraph_of(team)
        self.graph = None if graph is None else GraphLineage(graph)  # a GraphFlow's speakers follow its graph
        if self.graph is not None:
            self.graph.follow_resets(team)
        self._manager_to_hook = bool(getattr(team, "_initialized", False))  # created before: not by the factory

    # -- session ---------------------------------------------------------------------

    def _new_session(self) -> str:
        spec = self._session_spec
        if callable(spec):
            return sanitize_id(spec())
        if spec:
            return sanitize_id(spec)
        return uuid.uuid4().hex

    def begin_run(self) -> str | None:
        """A run starts: the team's conversation goes on (its session, its lineage) unless it was
        reset or replaced by a loaded state, which starts a new session (going on after the loaded
        conversation's last turn).

        None, changing nothing, while another run is in progress: AutoGen refuses that run, and
        the running one keeps its session, tags and lineage.
        """
        with self._lock:
            if self.session is not None:
                return None
            going_on = self.conversation is not None
            session = self.conversation if going_on else self._new_session()
            self.session = self.conversation = session
            self._tags.clear()
            loaded, self._loaded = self._loaded, None
            turns = loaded.turns if loaded is not None and not going_on else ()
            after = (sanitize_id(turns[-1].node), turns[-1].step) if turns else None
            if not going_on:
                self.speakers = [] if after is None else [(after[0], None, after[1])]  # its parent: not saved
            if self.graph is not None:
                if not going_on:
                    self.graph.clear()
                    if loaded is not None and not loaded.graph_at_start:
                        self.graph.resume((t.node, t.step, t.message) for t in turns)
                self.graph.begin_run(max((step or 0 for _, _, step in self.speakers), default=0))
        tracker().start_session(session, keep_lineage=going_on, after=after)
        count("autogen_runs")
        if self.sink is not None:
            self.sink.post([self.facts, session_event("session_start", session)])
        return session

    def end_run(self, session: str) -> None:
        """A run ended (done or cancelled): the team keeps its messages, and a next run continues
        them, so the session goes on until ``reset`` (or the server finds it idle)."""
        with self._lock:
            if self.session == session:
                self.session = None
        tracker().end_session(session)  # this run's lineage listeners

    def end_conversation(self, loaded: LoadedConversation | None = None) -> None:
        """The team was reset, or ``loaded`` a state (None if unreadable): its conversation, and so its
        session, is over; the next run starts the loaded one."""
        with self._lock:
            session, self.conversation = self.conversation, None
            self._loaded = loaded
        if session is not None and self.sink is not None:
            self.sink.post([session_event("session_end", session)])

    async def hook_existing_manager(self, team: Any) -> None:
        """Give the manager ``team`` created before it was instrumented (at a run, a ``save_state``...)
        what its factory would have: the tagged selector client, the graph's resets followed.

        Once, before the next run (finding it is asynchronous): the manager is the agent AutoGen's
        own ``run_stream``/``reset``/``save_state`` address in the team's runtime.
        """
        if not self._manager_to_hook:
            return
        self._manager_to_hook = False
        manager_id = AgentId(type=team._group_chat_manager_topic_type, key=team._team_id)
        manager = await team._runtime.try_get_underlying_agent_instance(manager_id)
        client = getattr(manager, "_model_client", None)
        if isinstance(client, ChatCompletionClient):  # AutoGen handed it the team's client at creation
            manager._model_client = TaggedModelClient(_unwrap(client), self.selector_tag)
        if self.graph is not None:
            self.graph.follow(manager)

    # -- tags ------------------------------------------------------------------------

    def begin_turn(self, name: str) -> tuple[AgentTag, Dispatch | None]:
        agent = sanitize_id(name)
        session = self.session
        d: Dispatch | None = None
        if session is None:  # the agent runs outside a team run: tag, but no lineage
            tag = AgentTag(agent)
        else:
            parent, step = self.graph.predecessor(name) if self.graph is not None else (UNSET, UNSET)
            d = tracker().dispatch(agent, session, parent=parent, step=step, framework="autogen", node=name,
                                   app=self.app_id)
            tag = d.tag
            self.speakers.append((d.agent, d.parent, d.step))
        with self._lock:
            self._tags[agent] = tag
        return tag, d

    def end_turn(self, name: str, dispatch: Dispatch, response: Any) -> None:
        """A speaker's turn ended with ``response`` (AutoGen's ``Response``, None if it gave none)."""
        if self.graph is not None and dispatch.step is not None:
            self.graph.turn_ended(name, dispatch.agent, dispatch.step, getattr(response, "chat_message", None))

    def agent_tag(self, name: str) -> AgentTag:
        agent = sanitize_id(name)
        with self._lock:
            tag = self._tags.get(agent)
        if tag is not None and tag.session == self.session:
            return tag
        return AgentTag(agent, session=self.session)

    def selector_tag(self) -> AgentTag:
        """The selector's tag: parent and step of the last speaker, whose turn it closes.

        Not the next speaker's step: calls sharing a step are siblings to the server, while the
        selector sits between two steps. Its retries for one pick share the tag (one call).
        """
        session = self.session
        if session is None:
            return AgentTag(self.selector)
        parent = tracker().parent_for(session)
        step = self.speakers[-1][2] if self.speakers else None
        return AgentTag(self.selector, session=session, parent=parent, step=step or 0)


def instrumentation(team: Any) -> TeamInstrumentation | None:
    """The :class:`TeamInstrumentation` of an instrumented team, else None."""
    return getattr(team, _STATE_ATTR, None)


def _join(participant: Any, state: TeamInstrumentation) -> None:
    """``participant`` takes turns in the team of ``state``.

    An agent may be in several teams (e.g. a team built per request from the same agents): its
    client and turns are wrapped once, and each call is tagged for whichever of its teams is running.
    The teams are held weakly: a team dropped by the app is forgotten.
    """
    teams = getattr(participant, _TEAMS_ATTR, None)
    if teams is None:
        teams = weakref.WeakSet()
        setattr(participant, _TEAMS_ATTR, teams)
        name = str(getattr(participant, "name", ""))
        client = getattr(participant, "_model_client", None)
        if isinstance(client, ChatCompletionClient):
            participant._model_client = TaggedModelClient(_unwrap(client), lambda: _agent_tag(participant, name))
        if hasattr(participant, "on_messages_stream") and name:
            _wrap_turns(participant, name)
    teams.add(state)


def _running_team(participant: Any) -> TeamInstrumentation | None:
    """The team of ``participant`` whose run is in progress (AutoGen runs an agent in one team at a time)."""
    return next((t for t in list(getattr(participant, _TEAMS_ATTR, ())) if t.session is not None), None)


def _agent_tag(participant: Any, name: str) -> AgentTag:
    team = _running_team(participant)
    return AgentTag(sanitize_id(name)) if team is None else team.agent_tag(name)


def _begin_turn(participant: Any, name: str) -> tuple[AgentTag, Dispatch | None, Callable[[Any], None] | None]:
    """The turn's tag, its dispatch and what to call with its last item when it ends (None outside a run)."""
    team = _running_team(participant)
    if team is None:
        return AgentTag(sanitize_id(name)), None, None
    tag, dispatch = team.begin_turn(name)
    return tag, dispatch, None if dispatch is None else lambda last: team.end_turn(name, dispatch, last)


def _wrap_turns(agent: Any, name: str) -> None:
    original = agent.on_messages_stream  # bound method of the agent's class

    def on_messages_stream(messages: Any, cancellation_token: Any) -> AsyncIterator[Any]:
        tag: AgentTag | None = None
        dispatch: Dispatch | None = None
        ended: Callable[[Any], None] | None = None
        try:
            install()  # an SDK imported since the team was wrapped (e.g. anthropic) is tagged too
            tag, dispatch, ended = _begin_turn(agent, name)
        except Exception as exc:
            ERRORS.record("autogen turn", exc)
        return _run_under(original(messages, cancellation_token), tag, dispatch, ended)

    on_messages_stream.__agentkv_original__ = original  # type: ignore[attr-defined]
    agent.on_messages_stream = on_messages_stream


async def _run_under(
    stream: Any, tag: AgentTag | None, dispatch: Dispatch | None, ended: Callable[[Any], None] | None = None
) -> AsyncGenerator[Any, None]:
    """``stream`` with ``tag`` set around each step; then ``dispatch`` ends, and ``ended`` gets the last item."""
    last: Any = None
    try:
        while True:
            token = push_tag(tag)
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                return
            finally:
                reset_tag(token)
            last = item
            yield item
    finally:
        try:
            await _aclose(stream)
        finally:
            if dispatch is not None:
                dispatch_ended(dispatch)
            if ended is not None:
                try:
                    ended(last)
                except Exception as exc:
                    ERRORS.record("autogen turn end", exc)


async def _aclose(stream: Any) -> None:
    """Close an async iterator now (its ``finally`` runs here), not when it is garbage collected."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def _wrap_run(team: Any, state: TeamInstrumentation) -> None:
    original = team.run_stream

    def run_stream(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        return _session_stream(team, state, original, args, kwargs)

    run_stream.__agentkv_original__ = original  # type: ignore[attr-defined]
    team.run_stream = run_stream
    _end_conversation_after(team, "reset", state, lambda: None)
    # named as AutoGen names it, so that ``load_state(state=...)`` is read too
    _end_conversation_after(team, "load_state", state, lambda state: loaded_conversation(team, state))


def _end_conversation_after(team: Any, method: str, state: TeamInstrumentation,
                            loaded: Callable[..., LoadedConversation | None]) -> None:
    """Wrap ``team.<method>`` (``reset``, ``load_state``): once AutoGen has done it, the team's
    conversation is over, and ``loaded`` (given the call's arguments) says what the next run goes on
    after. A call AutoGen refuses (a run in progress, a bad state) raises and changes nothing."""
    original = getattr(team, method)

    async def end_after(*args: Any, **kwargs: Any) -> Any:
        result = await original(*args, **kwargs)
        try:
            state.end_conversation(loaded(*args, **kwargs))
        except Exception as exc:
            ERRORS.record("autogen session end", exc)
        return result

    end_after.__agentkv_original__ = original  # type: ignore[attr-defined]
    setattr(team, method, end_after)


async def _session_stream(
    team: Any, state: TeamInstrumentation, original: Callable[..., Any], args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> AsyncGenerator[Any, None]:
    """Run ``original`` (the team's ``run_stream``) as one run of the team's session.

    Closing this stream closes AutoGen's at once (a run left open keeps the team "already
    running"); a run that did not begin one (refused while another runs) does not end it.
    """
    try:
        await state.hook_existing_manager(team)
    except Exception as exc:  # another AutoGen version; a runtime whose agents run elsewhere
        ERRORS.record("autogen manager", exc, message=f"{_UNHOOKED} ({type(exc).__name__}: {exc})")
    session: str | None = None
    try:
        session = state.begin_run()
    except Exception as exc:
        ERRORS.record("autogen session start", exc)
    inner: Any = None
    try:
        inner = original(*args, **kwargs)
        async for item in inner:
            yield item
    finally:
        try:
            await _aclose(inner)
        finally:
            if session is not None:
                try:
                    state.end_run(session)
                except Exception as exc:
                    ERRORS.record("autogen run end", exc)


def instrument(
    team: Any,
    *,
    session: str | Callable[[], str] | None = None,
    events_url: str | Sequence[str] | None = None,
    selector_name: str = "selector",
) -> Any:
    """Tag every model call of an AutoGen team (``SelectorGroupChat``, round robin, swarm, ``GraphFlow``).

    Best before the team's first run, when AutoGen creates its manager (handing it the selector's
    client; a ``GraphFlow``'s manager is hooked to follow its graph's resets); a manager created
    before is found in the team's runtime at its next run and given the same, or, if it cannot be
    found, an error is counted and the selector's calls stay untagged.
    A session is the team's conversation: a run continues it (AutoGen keeps the messages), and
    ``team.reset()`` ends it, as does ``team.load_state()``, whose conversation is a new session that
    goes on after the loaded one's last turn. ``session``: a fixed session id or a function returning one per
    conversation; default a new id per conversation. ``events_url``: the vLLM server (base URL or
    full events URL), or a list of them (every replica behind a router), for graph facts and
    ``session_start``/``session_end`` events. Returns the same team, instrumented;
    calling it twice is a no-op. Participants that are teams themselves are not descended into;
    agents in several instrumented teams are tagged for whichever of their teams is running.
    """
    install()
    existing = instrumentation(team)
    if existing is not None:
        return team
    sink = get_sink(events_url) if events_url else None
    state = TeamInstrumentation(team, session=session, selector_name=selector_name, sink=sink)
    for participant in getattr(team, "_participants", []):
        _join(participant, state)
    selector_client = getattr(team, "_model_client", None)
    if isinstance(selector_client, ChatCompletionClient):
        team._model_client = TaggedModelClient(_unwrap(selector_client), state.selector_tag)
    _wrap_run(team, state)
    setattr(team, _STATE_ATTR, state)
    if sink is not None:
        sink.post([state.facts])
    return team
