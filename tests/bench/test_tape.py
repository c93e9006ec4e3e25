"""Tapes: the format, the token-id function and the workload generator (no vLLM)."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import re
from collections import Counter

import numpy as np
import pytest

from agentkv.bench._defaults import TOPOLOGY_NAMES, WORKLOAD_NAMES
from agentkv.bench.tape import (
    Tape,
    TapeError,
    TapeRequest,
    WorkloadConfig,
    generate,
    measured_predictability,
    read_tape,
    segment_kind,
    segment_tokens,
    write_tape,
)
from agentkv.bench.topologies import AGENTS, TOPOLOGIES, topology
from agentkv.bench.workloads import WORKLOADS, ZOO, AgentSpec, AppSpec, ToolGap, declared_graph


def test_token_function_is_the_documented_counter_mode_hash():
    key = "anchor/coder"
    expected = [int.from_bytes(hashlib.blake2b(f"{key}:{i}".encode(), digest_size=8).digest()[:4], "big") % 30_000
                + 1_000 for i in range(40)]
    assert segment_tokens(key, 40) == expected
    assert segment_tokens(key, 7) == expected[:7]  # a longer span of a key extends the shorter one
    assert segment_tokens("anchor/writer", 40) != expected
    assert all(5 <= t < 12 for t in segment_tokens("x", 100, vocab=7, offset=5))
    assert segment_kind("anchor/team") == "anchor" and segment_kind("s0001/3.0/out") == "history"


def test_round_trip_and_determinism(tmp_path):
    tape = generate(WorkloadConfig(topology="debate", sessions=5, seed=3))
    path = tmp_path / "t.jsonl"
    write_tape(tape, path)
    again = read_tape(path)
    assert again.header == json.loads(json.dumps(tape.header))
    assert again.requests == tape.requests
    buffer = io.StringIO()
    write_tape(generate(WorkloadConfig(topology="debate", sessions=5, seed=3)), buffer)
    assert buffer.getvalue() == path.read_text()  # same seed, same bytes
    other = io.StringIO()
    write_tape(generate(WorkloadConfig(topology="debate", sessions=5, seed=4)), other)
    assert other.getvalue() != buffer.getvalue()


def test_a_hand_written_tape_reads():
    lines = [
        {"format": "agentkv-tape", "version": 1, "block_size": 16},
        {"t": 0.0, "session": "a", "agent": "coder", "parent": "", "segments": [["anchor/coder", 40], ["a/task", 9]],
         "output_tokens": 5, "tool_gap": 1.5},
        {"t": 2.0, "session": "a", "agent": "reviewer", "parent": "coder",
         "segments": [["anchor/reviewer", 30], ["a/task", 9], ["r0/out", 5]], "output_tokens": 3, "tool_gap": 0},
    ]
    tape = read_tape(io.StringIO("\n".join(json.dumps(x) for x in lines) + "\n"))
    assert [r.id for r in tape.requests] == ["r0", "r1"]  # default ids: r<request index>
    assert tape.requests[0].output_key == "r0/out"
    assert tape.requests[1].prompt_tokens == 44
    assert tape.tokens("a/task", 9) == segment_tokens("a/task", 9)


def test_an_empty_segment_adds_no_token():
    """A span of 0 tokens (a tool that returned nothing) is legal and leaves the prompt as it is."""
    lines = [
        {"format": "agentkv-tape", "version": 1, "block_size": 16},
        {"t": 0.0, "session": "a", "agent": "coder", "segments": [["anchor/coder", 40], ["a/tool", 0], ["a/task", 9]],
         "output_tokens": 5, "tool_gap": 0},
    ]
    tape = read_tape(io.StringIO("\n".join(json.dumps(x) for x in lines)))
    assert tape.requests[0].segments == (("anchor/coder", 40), ("a/task", 9))
    assert tape.requests[0].prompt_tokens == 49


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([{"format": "other"}], "header"),
        ([{"format": "agentkv-tape", "version": 2, "block_size": 16}], "version"),
        ([{"format": "agentkv-tape", "version": 1, "block_size": 16}, {"t": 0}], "missing field"),
        ([{"format": "agentkv-tape", "version": 1, "block_size": 16},
          {"t": 1.0, "session": "a", "agent": "x", "parent": "", "segments": [["k", -1]], "output_tokens": 1,
           "tool_gap": 0}], "segment"),
        ([{"format": "agentkv-tape", "version": 1, "block_size": 16},
          {"t": 1.0, "session": "a", "agent": "x", "parent": "", "segments": [["k", 0]], "output_tokens": 1,
           "tool_gap": 0}], "at least one token"),
        ([{"format": "agentkv-tape", "version": 1, "block_size": 16},
          {"t": 1.0, "session": "a", "agent": "x", "parent": "", "segments": [["k", 2]], "output_tokens": 1,
           "tool_gap": 0},
          {"t": 0.5, "session": "b", "agent": "x", "parent": "", "segments": [["k", 2]], "output_tokens": 1,
           "tool_gap": 0}], "back in time"),
        ([{"format": "agentkv-tape", "version": 1, "block_size": 16},  # an integer no float holds
          {"t": 10**400, "session": "a", "agent": "x", "parent": "", "segments": [["k", 2]], "output_tokens": 1,
           "tool_gap": 0}], "finite"),
    ],
)
def test_malformed_tapes_name_the_line(lines, message):
    with pytest.raises(TapeError, match=message):
        read_tape(io.StringIO("\n".join(json.dumps(x) for x in lines)))


def test_topology_names_agree():
    assert TOPOLOGY_NAMES == TOPOLOGIES


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_generator_predictability_and_anchor_share(name):
    tape = generate(WorkloadConfig(topology=name, sessions=150, seed=1))
    r = measured_predictability(tape)
    # sessions restart at the supervisor, so the sampled chain is not quite stationary:
    # debate reads ~0.81 for its 0.78
    assert r == pytest.approx(topology(name).target_r, abs=0.05)
    assert 0.53 <= tape.summary()["anchor_share"] <= 0.62


def test_sessions_grow_their_history_and_respect_gaps():
    tape = generate(WorkloadConfig(topology="selector", sessions=6, seed=0, tool_loop=True))
    for requests in tape.sessions().values():
        assert requests[0].parent == ""
        for before, after in itertools.pairwise(requests):
            history_before = [s for s in before.segments if segment_kind(s[0]) == "history"]
            history_after = [s for s in after.segments if segment_kind(s[0]) == "history"]
            # the session history only grows, by the output (and tool result) of the previous call
            assert history_after[: len(history_before)] == history_before
            assert history_after[len(history_before)] == (before.output_key, before.output_tokens)
            assert after.t >= before.t + before.tool_gap
            if after.step == before.step:  # a tool-loop call: same agent, same parent, after a tool
                assert (after.agent, after.parent) == (before.agent, before.parent)
                assert history_after[len(history_before) + 1][0].endswith("/tool")
            else:
                assert after.parent == before.agent
    steps = [(r.session, r.step) for r in tape.requests]
    assert len(set(steps)) < len(steps)  # the tool loop happened


def test_request_lines_are_the_documented_fields():
    tape = generate(WorkloadConfig(topology="pipeline", sessions=2, seed=0))
    line = tape.requests[0].to_json()
    assert set(line) == {"id", "t", "session", "agent", "parent", "step", "segments", "output", "output_tokens",
                         "tool_gap"}
    assert isinstance(tape, Tape) and isinstance(tape.requests[0], TapeRequest)
    assert tape.header["workload"]["topology"] == "pipeline"
    assert tape.header["summary"]["requests"] == len(tape.requests)


# -- the workload zoo ----------------------------------------------------------------------


def _bytes(tape: Tape) -> str:
    buffer = io.StringIO()
    write_tape(tape, buffer)
    return buffer.getvalue()


def test_workload_names_agree():
    assert WORKLOAD_NAMES == WORKLOADS == (*TOPOLOGIES, *ZOO)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_workloads_are_seeded_round_trip_and_declare_their_graph(name, tmp_path):
    tape = generate(WorkloadConfig.named(name, sessions=12, seed=5))
    assert _bytes(generate(WorkloadConfig.named(name, sessions=12, seed=5))) == _bytes(tape)  # same seed, same bytes
    other = generate(WorkloadConfig.named(name, sessions=12, seed=6))
    # another seed draws other sessions and another instance (anchor sizes, tool use)
    assert [r.segments for r in other.requests[:3]] != [r.segments for r in tape.requests[:3]]
    assert other.header["workload"]["apps"] != tape.header["workload"]["apps"]
    path = tmp_path / "t.jsonl"
    write_tape(tape, path)
    again = read_tape(path)
    assert again.header == tape.header and again.requests == tape.requests
    assert tape.name == f"{name}-s5" and tape.header["target_predictability"] is None
    graph = tape.header["graph"]
    assert graph == declared_graph(WorkloadConfig.named(name, seed=5).resolved_apps())
    nodes, edges = set(graph["nodes"]), {tuple(e) for e in graph["edges"]}
    wire = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")
    assert all(wire.fullmatch(x) for x in nodes | {r.session for r in tape.requests})
    for request in tape.requests:
        assert request.agent in nodes
        if request.parent:
            assert (request.parent, request.agent) in edges or request.parent == request.agent
        else:
            assert request.agent in graph["entry"]


def test_teams_sessions_stay_within_two_teams():
    tape = generate(WorkloadConfig.named("teams", sessions=80, seed=0))
    (app,) = tape.header["workload"]["apps"]
    assert len(app["agents"]) == 27 and len(app["teams"]) == 5
    assert len({a["anchor_tokens"] for a in app["agents"]}) > 20  # per-agent anchor sizes vary
    team_of = {agent: i for i, team in enumerate(app["teams"]) for agent in team}
    spans = []
    for requests in tape.sessions().values():
        assert 10 <= len({r.step for r in requests}) <= 25
        assert requests[0].agent == "director"
        spans.append(len({team_of[r.agent] for r in requests if r.agent in team_of}))
    assert set(spans) == {1, 2}
    assert 0.25 <= spans.count(2) / len(spans) <= 0.55  # two teams allowed in 55%; most of those use both
    first = tape.requests[0]
    team = app["teams"][team_of[first.agent]] if first.agent in team_of else None
    assert team is None and [k for k, _ in first.segments[:2]] == ["anchor/org", "anchor/director"]


def test_multi_app_interleaves_a_pipeline_and_a_random_team():
    tape = generate(WorkloadConfig.named("multi-app", sessions=60, seed=0))
    ring = [f"etl.{a}" for a in ("extract", "parse", "enrich", "check", "load")]
    apps = {}
    for session, requests in tape.sessions().items():
        (app,) = {r.agent.split(".")[0] for r in requests}  # a session belongs to one app
        apps[session] = app
        agents = [r.agent for r in requests]
        if app == "etl":
            assert agents == [ring[i % 5] for i in range(len(agents))]
            assert all(k.startswith(("anchor/etl", f"{session}/")) for r in requests for k, _ in r.segments)
        else:
            assert all(a != b for a, b in itertools.pairwise(agents))  # uniform over the other five
    assert 0.35 <= list(apps.values()).count("etl") / len(apps) <= 0.65
    order = [apps[r.session] for r in tape.requests]
    assert sum(a != b for a, b in itertools.pairwise(order)) > len(apps)  # sessions of both apps interleave


def test_heavy_tools_gaps_and_loops():
    tape = generate(WorkloadConfig.named("heavy-tools", sessions=60, seed=0))
    assert tape.header["workload"]["tool_loop"] and tape.header["workload"]["max_tool_calls"] == 5
    gaps = np.array([r.tool_gap for r in tape.requests if r.tool_gap not in (0.0, 0.3)])
    assert len(gaps) > 0.6 * len(tape.requests)  # most calls end in a tool call
    assert 3.0 <= float(np.median(gaps)) <= 9.0
    assert float(np.quantile(gaps, 0.95)) >= 20.0 and gaps.max() <= 60.0 and gaps.min() >= 0.3
    calls = Counter((r.session, r.step) for r in tape.requests)
    assert max(calls.values()) == 5 and sum(n >= 3 for n in calls.values()) >= 0.2 * len(calls)


def test_abandoned_sessions_are_marked_on_their_last_request():
    tape = generate(WorkloadConfig.named("abandoned", sessions=200, seed=0))
    sessions = tape.sessions()
    abandoned = {s for s, requests in sessions.items() if requests[-1].abandoned}
    assert 0.24 <= len(abandoned) / len(sessions) <= 0.36  # abandon = 0.3
    assert all(not r.abandoned for requests in sessions.values() for r in requests[:-1])
    assert tape.summary()["abandoned_sessions"] == len(abandoned)
    lengths = {s: len({r.step for r in requests}) for s, requests in sessions.items()}
    assert np.mean([lengths[s] for s in abandoned]) < 0.6 * np.mean([n for s, n in lengths.items()
                                                                     if s not in abandoned])
    # the line carries "abandoned": true exactly on the abandoned requests
    assert [r.to_json().get("abandoned", False) for r in tape.requests] == [r.abandoned for r in tape.requests]


@pytest.mark.parametrize("name", ZOO)
def test_two_seeds_are_alike(name):
    a, b = (generate(WorkloadConfig.named(name, sessions=60, seed=s)).summary() for s in (0, 1))
    assert abs(a["anchor_share"] - b["anchor_share"]) <= 0.1
    assert abs(a["predictability"] - b["predictability"]) <= 0.1
    assert a["requests"] == pytest.approx(b["requests"], rel=0.25)


def test_topology_tapes_declare_the_topology_graph():
    tape = generate(WorkloadConfig(topology="pipeline", sessions=2, seed=0))
    assert tape.header["graph"] == {"nodes": list(AGENTS), "entry": ["supervisor"],
                                    "edges": [[a, AGENTS[(i + 1) % 6]] for i, a in enumerate(AGENTS)]}
    assert WorkloadConfig.named("pipeline") == WorkloadConfig(topology="pipeline")


def test_a_custom_app_needs_no_named_workload():
    app = AppSpec("duo", (AgentSpec("a", 40, 0.0), AgentSpec("b", 30, 1.0, ToolGap(1.0, 0.1, 0.5, 2.0))),
                  ((0.0, 1.0), (1.0, 0.0)), (1.0, 0.0), dispatches=(2, 2))
    tape = generate(WorkloadConfig(topology="duo", sessions=3, seed=0, apps=(app,)))
    assert [r.agent for r in tape.requests if r.session == "s0000"] == ["a", "b"]
    assert tape.header["graph"] == {"nodes": ["a", "b"], "edges": [["a", "b"], ["b", "a"]], "entry": ["a"]}
    with pytest.raises(ValueError, match="row-stochastic"):
        AppSpec("bad", (AgentSpec("a", 4, 0.0),), ((0.5,),), (1.0,))
    with pytest.raises(ValueError, match="unknown workload"):
        WorkloadConfig(topology="nope")


_HEADER = {"format": "agentkv-tape", "version": 1, "block_size": 16}
_LINE = {"session": "a", "agent": "x", "parent": "", "segments": [["k", 2]], "output_tokens": 1, "tool_gap": 0}


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([_HEADER, {**_LINE, "t": 0.0, "abandoned": True}, {**_LINE, "t": 1.0, "parent": "x"}],
         "not its conversation's last"),
        ([_HEADER, {**_LINE, "t": 0.0, "abandoned": "yes"}], "abandoned must be"),
        ([_HEADER, {**_LINE, "t": 0.0, "id": "q"}, {**_LINE, "t": 1.0, "id": "q"}], "line 3: duplicate id 'q'"),
        ([_HEADER, {**_LINE, "t": 0.0, "segments": [["k", 2**20 - 4], ["q", 4]]}], "at most 1,048,576"),
        ([{**_HEADER, "graph": {"nodes": ["x"], "edges": [["x", "y"]]}}], "only name graph.nodes"),
        ([{**_HEADER, "graph": {"nodes": "x"}}], "graph must be"),
        ([{**_HEADER, "graph": {"nodes": ["x"], "edges": [["x"]]}}], "pairs"),
    ],
)
def test_malformed_zoo_fields_name_the_line(lines, message):
    with pytest.raises(TapeError, match=message):
        read_tape(io.StringIO("\n".join(json.dumps(x) for x in lines)))


def test_cli_writes_a_zoo_tape(tmp_path, capsys):
    from agentkv.__main__ import main

    path = tmp_path / "a.jsonl"
    main(["bench", "tape", "--workload", "abandoned", "--sessions", "6", "--seed", "2", "-o", str(path)])
    assert _bytes(read_tape(path)) == _bytes(generate(WorkloadConfig.named("abandoned", sessions=6, seed=2)))
    assert "sessions abandoned" in capsys.readouterr().err
