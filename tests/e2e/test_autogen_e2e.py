"""An AutoGen SelectorGroupChat on the real agentkv server, instrumented with events."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("autogen_agentchat")

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.messages import BaseChatMessage
from autogen_agentchat.teams import SelectorGroupChat
from autogen_core.models import ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient

from agentkv.frameworks.autogen import instrument
from agentkv.testing.server_stats import fetch_stats, learned, wait_for

from ._util import instructions

pytestmark = pytest.mark.server


MODEL_INFO = ModelInfo(vision=False, function_calling=False, json_output=False, family="unknown",
                       structured_output=False)


def test_autogen_selector_team_is_learned_by_the_server(own_agentkv_server) -> None:
    # A server of this module's own: what the server learned depends on every agent it saw.
    base = own_agentkv_server.base_url
    run = uuid.uuid4().hex[:8]

    clients: list[OpenAIChatCompletionClient] = []

    def client() -> OpenAIChatCompletionClient:
        clients.append(OpenAIChatCompletionClient(model="tiny", base_url=base + "/v1", api_key="x",
                                                  model_info=MODEL_INFO, max_tokens=1, temperature=0))
        return clients[-1]

    roles = ("planner", "coder", "critic")
    names = [f"{role}_{run}" for role in roles]
    agents = [AssistantAgent(name, model_client=client(), system_message=instructions(role, run), description=role)
              for name, role in zip(names, roles, strict=True)]

    def select(thread: Sequence[Any]) -> str | None:
        speakers = [m.source for m in thread if isinstance(m, BaseChatMessage) and m.source in names]
        if not speakers:
            # The first pick goes to the selector model (its call is tagged). The tiny model cannot
            # name a participant, so AutoGen falls back to the first one: deterministic anyway.
            return None
        return names[(names.index(speakers[-1]) + 1) % len(names)]

    team = SelectorGroupChat(agents, model_client=client(), selector_func=select, max_selector_attempts=1,
                             termination_condition=MaxMessageTermination(4))
    selector = f"selector-{run}"
    session = f"ag-{run}"
    instrument(team, session=session, events_url=base, selector_name=selector)
    before = fetch_stats(base)

    async def converse() -> Any:
        try:
            result = await team.run(task="Write a function that adds two numbers.")
            await team.reset()  # the conversation is over (a run alone is not: the team keeps its messages)
            return result
        finally:  # in this loop: clients left to the collector close their connections on a loop
            for model_client in clients:  # that is gone, inside whichever async test runs then
                await model_client.close()

    result = asyncio.run(converse())
    assert [m.source for m in result.messages] == ["user", *names]
    wait_for(lambda: fetch_stats(base)["sessions"]["ended"] > before["sessions"]["ended"], "the session end")
    after = fetch_stats(base)

    assert {*names, selector} <= set(after["agents"])
    assert all(after["agents"][a]["queries"] > 0 for a in (*names, selector))  # the selector's call is tagged
    assert learned(after, names[0], names[1]) and learned(after, names[1], names[2])
    assert session not in after["sessions"]["current"]
    assert set(names) <= set(after["facts"]["nodes"])
