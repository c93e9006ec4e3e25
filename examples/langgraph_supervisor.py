"""A six-agent LangGraph supervisor app (a small software team), tagged for agentkv.

    python examples/langgraph_supervisor.py --sessions 3          # local: tiny model + agentkv CPU server
    python examples/langgraph_supervisor.py --base-url http://127.0.0.1:8000/v1 --model tiny --sessions 3

The team: a supervisor, a planner, a researcher, a coder, a reviewer and a writer. Every agent
has a fixed system prompt and its own tools bound to its model (``ChatOpenAI(...).bind_tools``):
that prefix, its *anchor*, is identical on every call of that agent in every session, and it is
what agentkv keeps in vLLM's prefix cache. All agents of a session share one conversation
history that grows turn by turn.

One agent turn: a streamed model call; then the tool step: the tool calls the model asked for are
executed, or (the tiny random model used for local runs never emits any) one scripted,
deterministic call of one of the agent's tools, whose result joins the history after
``--tool-gap`` seconds, the time a real tool would take. The next agent is the model's choice
(the supervisor's ``transfer_to_*`` call, or the one agent its answer names), else a seeded Markov
chain over the six agents (``agentkv.bench.topologies``, "selector"): runs are reproducible.

Without ``--base-url`` the script builds the tiny model, starts ``agentkv serve`` on 127.0.0.1
and stops it at the end. Against your own vLLM, ``--tool-choice auto`` (the default) needs
``--enable-auto-tool-choice --tool-call-parser ...``; otherwise pass ``--tool-choice none``.
``agentkv.instrument`` is applied whatever the server; graph facts and session events are posted
only when the server answers ``GET /agentkv/v1/stats``, and the run then ends with the server's view:
policy, predictability R, top-1 accuracy, the learned transitions (P >= 0.05) and the prefix-cache
hit rate per agent.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import operator
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

import agentkv
from agentkv._arguments import at_least
from agentkv.bench.topologies import AGENTS, topology
from agentkv.testing.example_cli import example_parser, print_server_view, run_example

# ---------------------------------------------------------------------------------------------
# Tools: small, real and deterministic. Their schemas are part of each agent's anchor.
# ---------------------------------------------------------------------------------------------

DOCS = {
    "design/cache.md": "The prefix cache stores attention keys and values per block of 32 tokens. A block "
    "is reusable only if every block before it is cached too, so evicting a parent orphans its children.",
    "design/routing.md": "The supervisor hands work to one specialist at a time. Each specialist reports "
    "back with a short summary and, when it used a tool, the tool's result.",
    "design/eviction.md": "Least-recently-used eviction drops the system prompt of an agent that sat idle "
    "while others ran, just before that agent is called again.",
    "ops/latency.md": "Time to first token is dominated by prefill of uncached prompt tokens; decoding "
    "cost grows with the number of generated tokens and the batch size.",
    "ops/limits.md": "Requests may carry at most 2048 tokens. Tool results longer than 400 characters "
    "are truncated by the runtime before they are added to the conversation.",
    "style/guide.md": "Write short sentences, lead with the answer, name files and functions exactly, "
    "and never promise behaviour that no test covers.",
}

FILES = {
    "src/cache.py": "class BlockCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n"
    "        self.blocks = {}\n\n    def get(self, key):\n        return self.blocks.get(key)\n\n"
    "    def put(self, key, value):\n        if len(self.blocks) >= self.capacity:\n"
    "            self.blocks.pop(next(iter(self.blocks)))\n        self.blocks[key] = value\n",
    "src/router.py": "def route(agent, history):\n    if not history:\n        return 'planner'\n"
    "    return TABLE.get(agent, 'supervisor')\n",
    "tests/test_cache.py": "from src.cache import BlockCache\n\ndef test_put_get():\n    c = BlockCache(2)\n"
    "    c.put('a', 1)\n    assert c.get('a') == 1\n",
}

_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def _arithmetic(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arithmetic(node.left), _arithmetic(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arithmetic(node.operand))
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result. Supports integers, decimals,
    + - * / // % ** and parentheses; no variables or function calls. Use it for every estimate,
    budget or capacity figure instead of computing in your head."""
    return str(_arithmetic(ast.parse(expression, mode="eval").body))


@tool
def search_docs(query: str, limit: int = 2) -> str:
    """Search the project's design notes, operations notes and style guide by keywords. Returns up to
    `limit` passages, best match first, each with the file it comes from. Use short keyword queries
    such as 'eviction policy' or 'time to first token'."""
    words = set(re.findall(r"[a-z]+", query.lower()))
    ranked = sorted(DOCS.items(), key=lambda kv: (-len(words & set(re.findall(r"[a-z]+", kv[1].lower()))), kv[0]))
    return "\n".join(f"[{name}] {text}" for name, text in ranked[: max(1, min(limit, 3))])


@tool
def read_file(path: str, start_line: int = 1, max_lines: int = 8) -> str:
    """Read lines of a file of the repository under review (paths like 'src/cache.py' or
    'tests/test_cache.py'). Returns the numbered lines, or the list of files when the path is unknown."""
    if path not in FILES:
        return "unknown path; files: " + ", ".join(sorted(FILES))
    lines = FILES[path].splitlines()[max(0, start_line - 1) : max(0, start_line - 1) + max_lines]
    return "\n".join(f"{start_line + i:3d} {line}" for i, line in enumerate(lines))


@tool
def propose_patch(path: str, diff: str) -> str:
    """Check a unified diff against a file of the repository without applying it. Reports whether
    the file exists and how many lines the patch adds and removes; the reviewer applies patches."""
    added = sum(1 for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++"))
    removed = sum(1 for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---"))
    status = "ok" if path in FILES else "new file"
    return f"patch for {path}: {status}, +{added} -{removed} lines"


@tool
def run_tests(target: str = "tests/") -> str:
    """Run the test suite, or one test file, in the sandbox and return the pytest summary line and
    the first failure. Takes about a second; run it after every proposed patch."""
    if "cache" in target:
        return ("tests/test_cache.py::test_put_get PASSED\ntests/test_cache.py::test_eviction_order FAILED: "
                "expected 'b' evicted, got 'a'\n1 failed, 1 passed in 0.41s")
    return "12 passed, 1 skipped in 1.02s"


@tool
def estimate_effort(tasks: list[str]) -> str:
    """Estimate the effort of a list of tasks in hours (0.5 h per task plus 1 h per 'test' or
    'review' mentioned) and return a per-task table and the total."""
    hours = [0.5 + sum(word in task.lower() for word in ("test", "review")) for task in tasks]
    rows = [f"- {task}: {h:g} h" for task, h in zip(tasks, hours, strict=True)]
    return "\n".join([*rows, f"total: {sum(hours):g} h"])


@tool
def style_check(text: str) -> str:
    """Check a draft against the style guide: counts words and sentences, and lists sentences longer
    than 25 words. Returns 'ok' followed by the counts when nothing needs fixing."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
    long = [s[:40] for s in sentences if len(s.split()) > 25]
    verdict = "ok" if not long else "too long: " + "; ".join(long)
    return f"{verdict} ({len(text.split())} words, {len(sentences)} sentences)"


ROLES = {
    "planner": "breaks the task into ordered steps with estimates",
    "researcher": "finds facts in the design and operations notes",
    "coder": "reads the code and proposes patches",
    "reviewer": "runs the tests and reviews patches",
    "writer": "writes the final answer for the user",
}


def _handoff(agent: str) -> BaseTool:
    @tool(f"transfer_to_{agent}", description=f"Hand the conversation to the {agent}, who {ROLES[agent]}.")
    def transfer() -> str:
        return f"Transferred to {agent}."

    return transfer


TOOLS: dict[str, list[BaseTool]] = {
    "supervisor": [_handoff(a) for a in AGENTS if a != "supervisor"],
    "planner": [estimate_effort, calculator, search_docs],
    "researcher": [search_docs, read_file, calculator],
    "coder": [read_file, propose_patch, run_tests],
    "reviewer": [run_tests, read_file, search_docs],
    "writer": [style_check, search_docs],
}

# ---------------------------------------------------------------------------------------------
# System prompts: substantial and fixed, like a real team's.
# ---------------------------------------------------------------------------------------------

SYSTEM_PROMPTS = {
    "supervisor": "You are the supervisor of a five-person software team. You never do the work yourself: "
    "you read the conversation, decide which specialist should act next, and hand over with exactly one "
    "transfer_to_* tool call. Prefer the planner for a new task, the researcher when facts are missing, "
    "the coder when the plan names a change, the reviewer after every patch, and the writer once tests "
    "pass. If a specialist failed or asked a question, route to whoever can unblock them. Keep your "
    "own message to one sentence that states why you chose that specialist. Rules: never "
    "route to the same specialist three times in a row; never end the task before the writer has "
    "answered; if the user changes the task, start again from the planner.",
    "planner": "You are the planner. Turn the user's request into a short numbered plan: at most six "
    "steps, each naming who does it (researcher, coder, reviewer or writer), what it produces and how "
    "we will know it is done. Estimate every step with estimate_effort and add the numbers with the "
    "calculator; never guess totals. When requirements are ambiguous, list your assumptions before the "
    "plan instead of asking the user. Look up constraints in the notes with search_docs before you "
    "commit to a design. Output format: 'Assumptions:' then 'Plan:' then 'Estimate:'. "
    "Do not write code and do not review code; hand those to the coder and the reviewer.",
    "researcher": "You are the researcher. Answer factual questions about the system from the project's "
    "notes and code only: search with search_docs using two or three keywords, open the files they "
    "point to with read_file, and quote the exact sentence or line you rely on, with its file name. "
    "Use the calculator for any number you derive. If the notes do not answer the question, say so "
    "plainly and say what experiment would. Output format: 'Findings:' as a bullet list "
    "of quoted facts with sources, then 'Open questions:'. Never speculate beyond the sources.",
    "coder": "You are the coder. Make the smallest change that satisfies the plan. Read the relevant "
    "files with read_file first, then propose the change as a unified diff with propose_patch, then "
    "run the affected tests with run_tests and report the summary line. Keep the public interface "
    "stable, add a test for every behaviour you change, and never touch unrelated code. Output format: "
    "'Change:' with one sentence, 'Patch:' with the diff, 'Tests:' with the result. "
    "If a test fails, explain the failure in one sentence and propose the fix in the same turn.",
    "reviewer": "You are the reviewer. Check every proposed patch for correctness, tests and style: "
    "run the tests with run_tests, read the changed files with read_file, and compare the behaviour "
    "with the design notes (search_docs). Approve only when the tests pass and every changed "
    "behaviour is covered. Output format: 'Verdict:' approve or request changes, then "
    "'Findings:' as a numbered list, most important first, each with the file and line. Be specific "
    "and brief; do not rewrite the patch yourself.",
    "writer": "You are the writer. Produce the final answer for the user from the team's work: lead "
    "with the outcome, then what changed and why, then how it was verified, in at most 120 words. "
    "Quote file names and test results exactly as the team reported them and check the draft with "
    "style_check before you finish. Use search_docs to confirm any claim about the design. Never mention "
    "internal routing, tools or the team's discussion; the user sees only your answer. "
    "If the work is incomplete, say what is missing instead of inventing results.",
}

TASKS = [
    "Our cache evicts the wrong block when it is full: test_eviction_order fails. Find out why and fix it.",
    "Add a hit-rate counter to BlockCache and document how to read it.",
    "Explain why time to first token doubles after an idle agent is called again, and propose a fix.",
    "Estimate the work to make the router learn which agent runs next, then plan it.",
    "Review the router for unknown agents and make it fall back to the supervisor safely.",
    "Write release notes for the new eviction order, with the test evidence.",
]

# The scripted tool step for models that never call tools: (tool, argument choices).
SCRIPTED: dict[str, tuple[BaseTool, list[dict[str, Any]]]] = {
    "planner": (estimate_effort, [{"tasks": ["find the bug", "patch BlockCache.put", "add a test", "review"]},
                                  {"tasks": ["design counters", "implement", "test the counters"]}]),
    "researcher": (search_docs, [{"query": "eviction policy"}, {"query": "time to first token prefill"},
                                 {"query": "prefix cache block"}]),
    "coder": (read_file, [{"path": "src/cache.py"}, {"path": "src/cache.py", "start_line": 8},
                          {"path": "src/router.py"}]),
    "reviewer": (run_tests, [{"target": "tests/test_cache.py"}, {"target": "tests/"}]),
    "writer": (style_check, [{"text": "The cache now evicts the least recently used block. test_eviction_order "
                              "passes. The change is covered by two tests."}]),
}

# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------

CHAIN = topology("selector")  # every session starts at the supervisor


def markov_next(agent: str, session: str, turn: int, seed: int) -> str:
    """The seeded fallback router: the next agent drawn from the chain's row of ``agent``
    (the supervisor always hands off: its self-loop is dropped)."""
    row = CHAIN.matrix[AGENTS.index(agent)]
    weights = [0.0 if agent == to == "supervisor" else p for to, p in zip(AGENTS, row, strict=True)]
    return random.Random(f"{seed}:{session}:{turn}").choices(AGENTS, weights=weights)[0]


def model_choice(agent: str, reply: AIMessage) -> str | None:
    """The next agent the model asked for, if it named exactly one valid agent."""
    for call in reply.tool_calls:
        target = call["name"].removeprefix("transfer_to_")
        if call["name"].startswith("transfer_to_") and target in AGENTS:
            return target
    if agent == "supervisor" and isinstance(reply.content, str):
        named = {a for a in AGENTS if a != "supervisor" and re.search(rf"\b{a}\b", reply.content.lower())}
        if len(named) == 1:
            return named.pop()
    return None


# ---------------------------------------------------------------------------------------------
# The graph
# ---------------------------------------------------------------------------------------------


class TeamState(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]  # the shared, growing history
    session: str  # the workload: seeds routes and tool arguments
    turn: int
    next: str


@dataclass
class TeamConfig:
    base_url: str  # OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1
    model: str = "tiny"
    api_key: str = "EMPTY"
    max_tokens: int = 24
    turns: int = 8  # agent turns per session
    tool_gap: float = 0.3  # seconds a tool step takes
    seed: int = 0
    tool_choice: str = "auto"  # "none" for a vLLM without --enable-auto-tool-choice
    routing: str = "model"  # "markov": ignore the model's pick (reproducible runs, benchmarks)
    timeout: float = 300.0
    # an httpx.AsyncClient for the calls; by default langchain-openai's, one per base URL for the
    # whole process, bound to the event loop of its first use (a second asyncio.run cannot use it)
    http_async_client: Any = None


def _scripted_call(agent: str, state: TeamState, turn: int, next_agent: str, seed: int) -> dict[str, Any]:
    if agent == "supervisor":
        name, args = f"transfer_to_{next_agent}", {}
    else:
        tool_, choices = SCRIPTED[agent]
        name, args = tool_.name, random.Random(f"{seed}:{state['session']}:{turn}:args").choice(choices)
    return {"name": name, "args": args, "id": f"call-{turn}-0", "type": "tool_call"}


def _run_tool(agent: str, call: dict[str, Any]) -> str:
    tools = {t.name: t for t in TOOLS[agent]}
    try:
        return str(tools[call["name"]].invoke(call["args"]))[:400]
    except Exception as exc:  # a bad call from the model is reported back, as a real runtime would
        return f"error: {type(exc).__name__}: {exc}"[:400]


def _agent_node(agent: str, model: Any, team: TeamConfig) -> Callable[..., Any]:
    async def run(state: TeamState, config: RunnableConfig) -> dict[str, Any]:
        reply = await model.ainvoke([SystemMessage(SYSTEM_PROMPTS[agent]), *state["messages"]], config)
        turn = state["turn"] + 1
        picked = model_choice(agent, reply) if team.routing == "model" else None
        next_agent = picked or markov_next(agent, state["session"], turn, team.seed)
        # The tool step the model did not ask for (the tiny model never does): scripted, deterministic.
        calls = reply.tool_calls or [_scripted_call(agent, state, turn, next_agent, team.seed)]
        reply = AIMessage(content=reply.content, tool_calls=calls, name=agent, id=reply.id,
                          usage_metadata=reply.usage_metadata)
        results = [
            ToolMessage(_run_tool(agent, call), tool_call_id=call["id"], name=call["name"])
            for call in reply.tool_calls
        ]
        await asyncio.sleep(team.tool_gap)  # the tool's own running time
        return {"messages": [reply, *results], "turn": turn, "next": next_agent}

    return run


def chat_model(agent: str, config: TeamConfig) -> Any:
    """The agent's model: streamed (so clients can time the first token), its tools bound."""
    llm = ChatOpenAI(
        model=config.model,
        base_url=config.base_url,
        api_key=config.api_key,
        temperature=0,
        max_tokens=config.max_tokens,
        streaming=True,
        stream_usage=True,
        timeout=config.timeout,
        max_retries=0,
        http_async_client=config.http_async_client,
    )
    return llm.bind_tools(TOOLS[agent], tool_choice=config.tool_choice)


def build_team(config: TeamConfig) -> Any:
    """The compiled (not yet instrumented) LangGraph app."""
    builder = StateGraph(TeamState)
    for agent in AGENTS:
        builder.add_node(agent, _agent_node(agent, chat_model(agent, config), config))

    def route(state: TeamState) -> str:
        return END if state["turn"] >= config.turns else state["next"]

    builder.add_edge(START, "supervisor")
    for agent in AGENTS:
        builder.add_conditional_edges(agent, route, [*AGENTS, END])
    return builder.compile(name="coding-team")


async def run_session(
    team: Any, session: str, config: TeamConfig, callbacks: Sequence[Any] = (), workload: str | None = None
) -> list[AnyMessage]:
    """One session (one LangGraph run, thread ``session``); returns its final history.

    ``workload`` (default ``session``) seeds the task, the routes and the tool arguments: sessions
    with the same workload do the same work. A session whose id differs from its workload quotes
    its id in the task, so two runs of one workload on the same server never share cached history.
    """
    workload = workload or session
    task = TASKS[random.Random(f"{config.seed}:{workload}:task").randrange(len(TASKS))]
    text = task if workload == session else f"Ticket {session}: {task}"
    inputs = {"messages": [HumanMessage(text)], "session": workload, "turn": 0, "next": "supervisor"}
    run_config = {"configurable": {"thread_id": session}, "callbacks": list(callbacks),
                  "recursion_limit": 4 * config.turns + 10}
    state = await team.ainvoke(inputs, run_config)
    return state["messages"]


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, base_url: str, root: str | None) -> None:
    """The sessions, ``--concurrency`` at a time, on the server at ``base_url`` (``root``: agentkv's)."""
    config = TeamConfig(base_url=base_url, model=args.model, max_tokens=args.max_tokens, turns=args.turns,
                        tool_gap=args.tool_gap, seed=args.seed, tool_choice=args.tool_choice,
                        routing=args.routing)
    app = agentkv.instrument(build_team(config), events_url=root)  # tags every request; events only to agentkv
    semaphore = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> None:
        async with semaphore:
            t0 = time.perf_counter()
            messages = await run_session(app, f"session-{args.seed}-{i}", config)
            agents = [m.name for m in messages if isinstance(m, AIMessage)]
            tools = sum(isinstance(m, ToolMessage) for m in messages)
            print(f"session {i} ({time.perf_counter() - t0:.1f} s, {tools} tool calls): {' -> '.join(agents)}")

    await asyncio.gather(*(one(i) for i in range(args.sessions)))
    if root:
        await asyncio.to_thread(app.sink.flush)  # session_end events are posted in the background
        print_server_view(root, AGENTS)


def main(argv: list[str] | None = None) -> int:
    parser = example_parser(__doc__, sessions=3, turns=8)
    parser.add_argument("--concurrency", type=at_least(int, 1), default=1, help="sessions running at once")
    parser.add_argument("--tool-gap", type=at_least(float, 0), default=0.3, help="seconds each tool step takes")
    parser.add_argument("--tool-choice", default="auto", choices=["auto", "none"])
    parser.add_argument("--routing", default="model", choices=["model", "markov"], help="markov: route by the "
                        "seeded chain only, ignoring the model's pick")
    # the local server parses the tiny model's tool calls (the history grows ~150 tokens a turn)
    return run_example(parser, run, argv, script=__file__,
                       server_args=["--enable-auto-tool-choice", "--tool-call-parser", "xlam"])


if __name__ == "__main__":
    sys.exit(main())
