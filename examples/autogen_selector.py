"""An AutoGen SelectorGroupChat (planner, coder, reviewer, writer), tagged for agentkv.

    python examples/autogen_selector.py --sessions 2              # local: tiny model + agentkv CPU server
    python examples/autogen_selector.py --base-url http://127.0.0.1:8000/v1 --model tiny

Each participant is an ``AssistantAgent`` with a fixed system message (its anchor). A selector
picks the next speaker: it asks the model, and when the answer does not name exactly one
participant (the tiny random model used for local runs never does) it falls back to a seeded
choice from a small hand-off table, so runs are reproducible. ``agentkv.frameworks.autogen.
instrument(team)`` tags every model call with its agent, session and lineage; the selector's own
call is tagged as agent ``selector`` with the last speaker as parent (it is not a speaker turn: the
server learns it as interposed between turns, and the speaker chain speaker -> next speaker).

Against an agentkv server it ends with the server's view: policy, predictability R, top-1
accuracy, the learned transitions (P >= 0.05) and the prefix-cache hit rate per agent.

Without ``--base-url`` the script builds the tiny model, starts ``agentkv serve`` on 127.0.0.1
and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.messages import BaseChatMessage
from autogen_agentchat.teams import SelectorGroupChat
from autogen_core.models import UserMessage
from autogen_ext.models.openai import OpenAIChatCompletionClient

from agentkv.frameworks import use_tag
from agentkv.frameworks.autogen import instrument, instrumentation
from agentkv.testing.example_cli import example_parser, print_server_view, run_example

AGENTS = {
    "planner": (
        "Breaks the request into steps.",
        "You are the planner of a small software team working on a caching library. Turn the user's request "
        "into a numbered plan of at most five steps; for each step say who does it (coder, reviewer or "
        "writer), what it produces and how we will know it is done. List your assumptions first when the "
        "request is ambiguous. Never write code yourself. Keep the plan under 120 words.",
    ),
    "coder": (
        "Writes and fixes code.",
        "You are the coder. Implement the current step of the plan with the smallest possible change. "
        "Show the change as a unified diff against the file it touches, then say which tests cover it and "
        "what they report. Keep the public interface stable and add a test for every behaviour you change. "
        "If the reviewer asked for changes, address each point in order and say how.",
    ),
    "reviewer": (
        "Reviews changes and runs the tests.",
        "You are the reviewer. Check the latest change for correctness, test coverage and style. Start with "
        "'Verdict: approve' or 'Verdict: request changes', then list your findings, most important first, "
        "each with the file and line. Approve only when the tests pass and every changed behaviour is "
        "covered. Do not rewrite the change yourself.",
    ),
    "writer": (
        "Writes the final answer.",
        "You are the writer. When the reviewer has approved, write the final answer for the user: the "
        "outcome first, then what changed and why, then how it was verified, in at most 100 words. Quote "
        "file names and test results exactly as the team reported them. Never mention the team's internal "
        "discussion. If the work is incomplete, say what is missing.",
    ),
}

# The fallback: who usually speaks after whom (seeded, reproducible).
HANDOFFS = {
    "planner": {"coder": 0.8, "reviewer": 0.1, "writer": 0.1},
    "coder": {"reviewer": 0.8, "planner": 0.1, "writer": 0.1},
    "reviewer": {"coder": 0.6, "writer": 0.3, "planner": 0.1},
    "writer": {"planner": 0.5, "coder": 0.3, "reviewer": 0.2},
}

SELECTOR_PROMPT = (
    "You coordinate a team. Roles:\n{roles}\n\nConversation so far:\n{history}\n\n"
    "Read the conversation, then answer with the name of the one role that should speak next, "
    "chosen from {names}. Answer with the name only."
)

TASKS = [
    "Our cache evicts the wrong block when it is full: test_eviction_order fails. Fix it.",
    "Add a hit-rate counter to BlockCache and document how to read it.",
    "Make the router fall back to the planner for unknown agents, with a test.",
]


class Selector:
    """``selector_func`` for SelectorGroupChat: the model's choice, else a seeded hand-off."""

    def __init__(self, client: OpenAIChatCompletionClient, seed: int) -> None:
        self.client = client
        self.rng = random.Random(seed)
        self.team: SelectorGroupChat | None = None  # set once the team is instrumented
        self.calls = 0  # model calls
        self.usable = 0  # model answers that named exactly one participant

    async def select(self, thread: Sequence[Any]) -> str:
        spoken = [m for m in thread if isinstance(m, BaseChatMessage)]
        if len(spoken) <= 1:
            return "planner"  # the first speaker after the user's task
        previous = spoken[-1].source
        history = "\n".join(f"{m.source}: {m.to_text()[:200]}" for m in spoken[-6:])
        prompt = SELECTOR_PROMPT.format(
            roles="\n".join(f"{name}: {role}" for name, (role, _) in AGENTS.items()), history=history,
            names=", ".join(AGENTS),
        )
        # Tag the selector's own call (instrument() tags the participants' calls for us).
        state = instrumentation(self.team) if self.team is not None else None
        with use_tag(state.selector_tag() if state is not None else None):
            result = await self.client.create([UserMessage(content=prompt, source="user")])
        self.calls += 1
        named = [n for n in AGENTS if n != previous and re.search(rf"\b{n}\b", str(result.content).lower())]
        if len(named) == 1:
            self.usable += 1
            return named[0]
        options = HANDOFFS.get(previous, HANDOFFS["planner"])
        return self.rng.choices(list(options), weights=list(options.values()))[0]


def model_client(base_url: str, model: str, max_tokens: int) -> OpenAIChatCompletionClient:
    return OpenAIChatCompletionClient(
        model=model,
        base_url=base_url,
        api_key="EMPTY",
        max_tokens=max_tokens,
        temperature=0,
        model_info={"vision": False, "function_calling": False, "json_output": False, "family": "unknown",
                    "structured_output": False},
    )


def build_team(base_url: str, model: str = "tiny", *, turns: int = 6, max_tokens: int = 24, seed: int = 0,
               session: Any = None, events_url: str | None = None) -> tuple[SelectorGroupChat, Selector]:
    """The instrumented team (and its selector). ``session``: a session id, or a function giving one per
    conversation (a conversation ends with ``team.reset()``)."""
    client = model_client(base_url, model, max_tokens)
    participants = [
        AssistantAgent(name, model_client=client, description=role, system_message=system)
        for name, (role, system) in AGENTS.items()
    ]
    selector = Selector(client, seed)
    team = SelectorGroupChat(participants, model_client=client, selector_func=selector.select, max_turns=turns)
    instrument(team, session=session, events_url=events_url)  # before the first run
    selector.team = team
    return team, selector


async def run(args: argparse.Namespace, base_url: str, root: str | None) -> None:
    """The sessions, one after another, on the server at ``base_url`` (``root``: agentkv's)."""
    ids = iter(f"autogen-{args.seed}-{i}" for i in range(args.sessions))
    team, selector = build_team(base_url, args.model, turns=args.turns, max_tokens=args.max_tokens, seed=args.seed,
                                session=lambda: next(ids), events_url=root)
    for i in range(args.sessions):
        t0 = time.perf_counter()
        result = await team.run(task=TASKS[i % len(TASKS)])
        speakers = [m.source for m in result.messages if isinstance(m, BaseChatMessage) and m.source != "user"]
        print(f"session {i} ({time.perf_counter() - t0:.1f} s): {' -> '.join(speakers)}")
        await team.reset()
    print(f"selector: {selector.calls} model calls, {selector.usable} usable answers (else: seeded hand-off)")
    if root:
        state = instrumentation(team)
        if state is not None and state.sink is not None:
            await asyncio.to_thread(state.sink.flush)  # session events are posted in the background
        print_server_view(root, [*AGENTS, "selector"])


def main(argv: list[str] | None = None) -> int:
    parser = example_parser(__doc__, sessions=2, turns=6)
    return run_example(parser, run, argv, script=__file__)


if __name__ == "__main__":
    sys.exit(main())
