"""examples/langgraph_supervisor.py: routing, tools and anchors offline; two sessions on a real agentkv server."""

from __future__ import annotations

import subprocess
import sys

import pytest
from langchain_core.messages import AIMessage
from langchain_core.utils.function_calling import convert_to_openai_tool

from agentkv.bench.topologies import AGENTS
from agentkv.testing.server_stats import StatsSnapshot
from tests.conftest import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "langgraph_supervisor.py"


def planned_path(example, session: str, seed: int, turns: int = 8) -> list[str]:
    """The agents a session visits when the model never names one (the tiny model's case)."""
    agent, path = "supervisor", ["supervisor"]
    for turn in range(1, turns):
        agent = example.markov_next(agent, session, turn, seed)
        path.append(agent)
    return path


def test_fallback_router_is_seeded_and_follows_the_selector_chain(example):
    draws = [example.markov_next("coder", f"s{i}", 1, 0) for i in range(400)]
    assert draws == [example.markov_next("coder", f"s{i}", 1, 0) for i in range(400)]
    assert max(set(draws), key=draws.count) == "reviewer"  # the chain's favourite successor of the coder
    assert set(draws) <= set(AGENTS)


def test_model_choice_takes_handoffs_and_one_named_agent_only(example):
    call = {"name": "transfer_to_coder", "args": {}, "id": "c1", "type": "tool_call"}
    assert example.model_choice("supervisor", AIMessage(content="", tool_calls=[call])) == "coder"
    assert example.model_choice("supervisor", AIMessage(content="The Reviewer should check it.")) == "reviewer"
    assert example.model_choice("supervisor", AIMessage(content="coder or reviewer")) is None
    assert example.model_choice("supervisor", AIMessage(content="wiong pasleant")) is None
    assert example.model_choice("coder", AIMessage(content="the reviewer")) is None  # only the supervisor routes


def test_tools_are_real_and_deterministic(example):
    assert example.calculator.invoke({"expression": "2 * (3 + 4) - 1"}) == "13"
    with pytest.raises(ValueError):
        example.calculator.invoke({"expression": "__import__('os')"})
    assert example.search_docs.invoke({"query": "eviction least recently used"}).startswith("[design/eviction.md]")
    assert "unknown path" in example.read_file.invoke({"path": "nope.py"})
    assert "1 failed" in example.run_tests.invoke({"target": "tests/test_cache.py"})
    assert example.estimate_effort.invoke({"tasks": ["a", "add a test"]}).endswith("total: 2 h")
    assert example.style_check.invoke({"text": "Short. Fine."}).startswith("ok")
    for agent, (tool, choices) in example.SCRIPTED.items():  # the scripted tool step uses the agent's own tools
        assert tool in example.TOOLS[agent]
        for args in choices:
            assert not example._run_tool(agent, {"name": tool.name, "args": args}).startswith("error")


def test_every_agent_has_a_substantial_fixed_anchor(example, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sizes = {}
    for agent in AGENTS:
        tools = [convert_to_openai_tool(t) for t in example.TOOLS[agent]]
        messages = [{"role": "system", "content": example.SYSTEM_PROMPTS[agent]}]
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        assert text == tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)  # byte-identical
        sizes[agent] = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    print(f"\nanchor tokens per agent: {sizes}")
    assert all(400 <= n <= 1000 for n in sizes.values()), sizes
    assert len({example.SYSTEM_PROMPTS[a][:40] for a in AGENTS}) == len(AGENTS)  # distinct from the first block


def test_graph_declares_the_six_agents(example):
    import agentkv

    team = example.TeamConfig(base_url="http://127.0.0.1:9/v1")  # never contacted
    app = agentkv.instrument(example.build_team(team))
    assert app.facts["nodes"] == sorted(AGENTS)
    assert app.facts["entry"] == ["supervisor"]


@pytest.mark.server
def test_two_sessions_on_agentkv_teach_the_server_six_anchors(own_agentkv_server, example):
    # a server of its own: on the shared one other tests' agents of the same names (other prompts)
    # may have agreed on no anchor, and growing one from there takes four sessions of five
    # a seed whose two sessions both visit all six agents, so each agent's anchor is seen in two sessions
    seed = next(
        s for s in range(200)
        if all(set(planned_path(example, f"session-{s}-{i}", s)) == set(AGENTS) for i in range(2))
    )
    snapshot = StatsSnapshot.take(own_agentkv_server.base_url)
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--base-url", own_agentkv_server.base_url + "/v1", "--sessions", "2",
         "--concurrency", "2", "--seed", str(seed), "--tool-choice", "none", "--tool-gap", "0.05",
         "--routing", "markov"],
        capture_output=True, text=True, timeout=300,
    )
    print(run.stdout[-3000:], run.stderr[-3000:])
    assert run.returncode == 0
    assert "agentkv server at" in run.stdout
    for i in range(2):
        path = " -> ".join(planned_path(example, f"session-{seed}-{i}", seed))
        assert f"session {i} " in run.stdout and path in run.stdout

    after = snapshot.now()
    for agent in AGENTS:
        assert snapshot.agent_delta(agent, now=after) > 0, agent
        # the learned anchor: the common block prefix of the agent's calls in two sessions (system + tools)
        assert after["agents"][agent]["anchor_length_blocks"] >= 12, (agent, after["agents"][agent])
    assert snapshot.delta("dispatches", now=after) == 16
    assert snapshot.delta("sessions", "ended", now=after) == 2
    assert set(AGENTS) <= set(after["facts"]["nodes"])
