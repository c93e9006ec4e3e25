"""What a state loaded into an AutoGen team (``team.load_state``) says about the conversation it resumes.

The state is AutoGen's ``TeamState`` (``team.save_state()``, autogen-agentchat 0.4.9+): each agent's state
by name, the manager's under its name, with the conversation's message thread (every team) and, for a
``GraphFlow``, its execution state (``remaining``, ``enqueued_any``, ``ready``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentkv.client import ERRORS

from ._autogen_graph import digraph_of

__all__ = ["LoadedConversation", "LoadedTurn", "loaded_conversation"]


@dataclass(frozen=True, slots=True)
class LoadedTurn:
    node: str  # the participant's name
    step: int  # its rank among the loaded turns, from 1
    message: Any  # the turn's last message (for a GraphFlow, the one its edge conditions were checked on)


@dataclass(frozen=True, slots=True)
class LoadedConversation:
    turns: tuple[LoadedTurn, ...]  # the participants' turns, in order
    graph_at_start: bool  # a GraphFlow whose next speakers are its start nodes (a new or completed graph)


def loaded_conversation(team: Any, state: Mapping[str, Any]) -> LoadedConversation | None:
    """The conversation ``state`` (loaded into ``team``) holds; None, counted, if it cannot be read."""
    try:
        manager = state["agent_states"][team._group_chat_manager_name]
        thread = [team._message_factory.create(message) for message in manager["message_thread"]]
        participants = set(team._participant_names)
        graph = digraph_of(team)
        at_start = graph is not None and _graph_at_start(graph, manager)
    except Exception as exc:  # another AutoGen version or state format: the next speaker is an entry
        ERRORS.record("autogen load", exc)
        return None
    turns: list[LoadedTurn] = []
    for i, message in enumerate(thread):
        source = getattr(message, "source", None)
        ends_a_turn = i + 1 == len(thread) or getattr(thread[i + 1], "source", None) != source
        if source in participants and ends_a_turn:  # a turn's messages are contiguous, its own last
            turns.append(LoadedTurn(source, len(turns) + 1, message))
    return LoadedConversation(tuple(turns), at_start)


def _graph_at_start(graph: Any, manager: Mapping[str, Any]) -> bool:
    """Whether GraphFlow's saved execution state is its initial one (``_reset_execution_state``).

    A node an edge made ready has its activation count or flag used until it runs, so a graph
    midway, even with a start node ready again (a loop back to it), never looks like this.
    """
    return (
        {target: dict(groups) for target, groups in manager["remaining"].items()} == graph.get_remaining_map()
        and not any(flag for groups in manager["enqueued_any"].values() for flag in groups.values())
        and sorted(manager["ready"]) == sorted(graph.get_start_nodes())
    )
