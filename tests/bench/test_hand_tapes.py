"""Tapes written by hand, in shapes the generator never makes, replay (docs/tapes.md format v1);
tapes outside the format fail with one clear line, never a traceback."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest

from agentkv.bench.plan import TapePlan
from agentkv.bench.policies import POLICIES, AgentKV, Belady
from agentkv.bench.replay import Replay, replay
from agentkv.bench.sweep import candidate_capacities
from agentkv.bench.tape import TapeError, read_tape, write_tape

ODD_SHAPES = Path(__file__).parent / "tapes" / "odd-shapes.jsonl"
HEADER = {"format": "agentkv-tape", "version": 1, "block_size": 16}


def _request(t: float = 0.0, agent: str = "x", segments: list | None = None, **extra: object) -> dict:
    return {"t": t, "session": "s", "agent": agent, "parent": "", "segments": segments or [["anchor/x", 40]],
            "output_tokens": 2, "tool_gap": 0, **extra}


def _plan(*lines: dict) -> TapePlan:
    return TapePlan(read_tape(io.StringIO("\n".join(json.dumps(x) for x in lines))))


@pytest.fixture(scope="module")
def odd() -> TapePlan:
    return TapePlan(read_tape(ODD_SHAPES))


def test_default_ids_count_requests_not_lines(odd):
    # the fixture has a blank line after its fifth request; later prompts continue "r<index>/out"
    assert [r.id for r in odd.requests] == [f"r{i}" for i in range(36)]
    outputs = {r.output_key for r in odd.requests}
    assert all(key in outputs for r in odd.requests for key, _ in r.segments if key.endswith("/out"))


def test_odd_shapes_replay_under_every_policy(odd):
    # block size 32, parent "" and no step everywhere, session ids reused after their conversation ended,
    # agent and session ids outside the wire alphabet, equal arrival times, tool gaps 0, one-token outputs
    assert odd.block_size == 32 and odd.max_request_blocks == 11
    rates = {}
    for policy in POLICIES:
        result = replay(odd, policy, 24)
        assert result.requests == 36 and result.prompt_tokens == sum(r.prompt_tokens for r in odd.requests)
        assert 0.0 <= result.anchor_hit_rate <= 1.0 and 0.0 <= result.history_hit_rate <= 1.0
        rates[policy] = result.hit_rate
    assert all(rates["belady"] >= rate for policy, rate in rates.items() if policy != "agentkv+warmup"), rates
    # no pressure: every policy hits the same tokens, and nothing is evicted
    roomy = {policy: replay(odd, policy, 1000) for policy in POLICIES if policy != "agentkv+warmup"}
    assert len({r.hit_tokens for r in roomy.values()}) == 1 and {r.evictions for r in roomy.values()} == {0}


def _app_tape(name: object) -> list[dict]:
    """Two agents calling each other in 12 sessions; ``name(x)`` spells each id."""
    lines: list[dict] = [dict(HEADER, graph={"nodes": [name("Lead Agent"), name("Helper Agent")],
                                             "edges": [[name("Lead Agent"), name("Helper Agent")],
                                                       [name("Helper Agent"), name("Lead Agent")]],
                                             "entry": [name("Lead Agent")]})]
    for s in range(12):
        parent = ""
        for turn in range(6):
            agent = "Lead Agent" if turn % 2 == 0 else "Helper Agent"
            lines.append({"t": 10.0 * s + turn, "session": name(f"user #{s}"), "agent": name(agent),
                          "parent": name(parent), "segments": [[f"anchor/{agent}", 320], [f"s{s}/task", 60]],
                          "output_tokens": 8, "tool_gap": 0.5})
            parent = agent
    return lines


def test_names_outside_the_wire_alphabet_replay_tagged_as_the_clients_send_them(caplog):
    from agentkv.client import sanitize_id

    spelled = _plan(*_app_tape(str))
    sanitized = _plan(*_app_tape(lambda x: sanitize_id(x) if x else x))
    assert {r.agent for r in spelled.requests} == {"Lead_Agent", "Helper_Agent"}
    assert spelled.requests[0].parent == "" and spelled.requests[1].parent == "Lead_Agent"
    assert spelled.graph_event()["nodes"] == ["Lead_Agent", "Helper_Agent"]
    assert "14 agent or session ids outside the wire alphabet" in caplog.text
    for policy in ("agentkv", "agentkv+facts"):
        a, b = AgentKV(facts=policy.endswith("facts")), AgentKV(facts=policy.endswith("facts"))
        first, second = Replay(spelled, a, 40).run(), Replay(sanitized, b, 40).run()
        assert first.hit_tokens == second.hit_tokens and first.evictions == second.evictions
        assert a.runtime.tagged_requests == 72 and set(a.runtime.learner.agents) == {"Lead_Agent", "Helper_Agent"}


def test_a_prompt_longer_than_the_default_model_length_replays():
    plan = _plan(HEADER, _request(segments=[["doc/huge", 70_000]]), _request(t=1.0, segments=[["doc/huge", 70_000]]))
    result = replay(plan, "lru", plan.max_request_blocks + 1)
    assert result.hit_tokens == 70_000 - 16  # vLLM recomputes the last block of a fully cached prompt


def test_a_graph_the_runtime_refuses_is_counted_and_left_out():
    nodes = [f"a{i}" for i in range(70)]  # 4900 edges: more than a graph event may carry
    plan = _plan(dict(HEADER, graph={"nodes": nodes, "edges": [[a, b] for a in nodes for b in nodes],
                                     "entry": nodes}),
                 _request(agent="a0"), _request(t=1.0, agent="a1"))
    policy = AgentKV(facts=True)
    result = Replay(plan, policy, 16).run()
    assert result.requests == 2 and policy.fallbacks["graph_refused"] == 1
    assert not policy.runtime.facts.graph.nodes and "graph_refused" in policy.stats()


BAD_UTF8 = json.dumps(HEADER).encode() + b'\n{"t": 0, "session": "\xff"}\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"format": "agentkv-tape", "version": 1, "block_size": true}', "block_size"),
        (json.dumps(dict(HEADER, workload="mine")) + "\n" + json.dumps(_request()), "workload must be an object"),
        (json.dumps(HEADER) + '\n{"t": NaN, "session": "s", "agent": "x", "parent": "", "segments": [["k", 2]], '
         '"output_tokens": 1, "tool_gap": 0}', "line 2: NaN is not a JSON number"),
        (json.dumps(HEADER) + "\n" + json.dumps(_request(tool_gap=1e400)), "Infinity is not a JSON number"),
        (json.dumps(dict(HEADER, tokens={"offset": 2**70})) + "\n" + json.dumps(_request()), "2\\*\\*31"),
        (json.dumps(dict(HEADER, version=True)) + "\n" + json.dumps(_request()), "unsupported version True"),
        (json.dumps(dict(HEADER, tokens={"vocab": 0})) + "\n" + json.dumps(_request()),
         "tokens.vocab must be an integer >= 1"),
        (json.dumps(HEADER) + "\n" + json.dumps(_request()).replace('"tool_gap": 0', '"tool_gap": 1e400'),
         "finite"),
        (json.dumps(dict(HEADER, graph={"nodes": ["y"], "edges": [], "entry": ["y"]})) + "\n"
         + json.dumps(_request()), r"graph.nodes must list every agent of the tape; missing \['x'\]"),
    ],
)
def test_malformed_hand_written_tapes_name_the_problem(text, message):
    with pytest.raises(TapeError, match=message):
        read_tape(io.StringIO(text))


def test_a_tape_that_is_not_utf8_is_a_tape_error_on_the_line_of_the_bad_byte(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(BAD_UTF8)
    with pytest.raises(TapeError, match="tape line 2: not UTF-8"):
        read_tape(path)


def test_a_tape_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    text = json.dumps(HEADER) + "\n" + json.dumps(_request()) + "\n"
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")
    assert read_tape(marked) == read_tape(plain)


def test_a_header_naming_a_builtin_topology_over_other_agents_replays_on_its_own_agents():
    # a header copied from a generated tape onto another app's agents: the topology's graph holds none of them
    plan = _plan(dict(HEADER, workload={"topology": "pipeline"}), _request(agent="alpha"),
                 _request(t=1.0, agent="beta", parent="alpha"))
    assert plan.topology_name is None and plan.declared_graph() == {a: {"alpha", "beta"} for a in ("alpha", "beta")}
    for name in ("kvflow", "agentkv+facts", "agentkv+warmup"):
        assert replay(plan, name, 16).requests == 2


def test_a_tape_of_small_requests_keeps_its_capacity_multiples():
    plan = _plan(HEADER, _request(segments=[["anchor/x", 8], ["s/x", 2]]),
                 _request(t=1.0, segments=[["anchor/x", 8]]))
    assert plan.max_request_blocks == 1
    # 2, 2, 3 and 5 blocks (rounded up), + the null block
    assert candidate_capacities(plan, (1.5, 2.0, 3.0, 5.0)) == [3, 4, 6]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (json.dumps(HEADER) + "\n{not json\n", "line 2: not JSON"),
        (json.dumps(HEADER) + "\n", "no requests to replay"),
        (json.dumps(HEADER) + "\n" + json.dumps(_request(t=-1.0)), "t >= 0"),
        (json.dumps(dict(HEADER, workload={"time_model": {"prefill_tps": 0}})) + "\n" + json.dumps(_request()),
         "time_model"),
    ],
)
def test_cli_reports_a_bad_tape_in_one_line(tmp_path, content, message):
    from agentkv.__main__ import main

    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "replay", str(path), "--policies", "lru,belady", "--jobs", "1", "--quiet",
              "--out", str(tmp_path / "out")])
    text = str(exit_info.value.code)
    assert text.startswith(f"agentkv bench replay: {path}") and message in text and "\n" not in text


def test_cli_refuses_capacities_below_the_largest_request(tmp_path):
    from agentkv.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "replay", str(ODD_SHAPES), "--capacities", "5,11", "--jobs", "1", "--quiet",
              "--out", str(tmp_path / "out")])
    assert str(exit_info.value.code) == (f"agentkv bench replay: {ODD_SHAPES}: no capacity holds the tape's "
                                         "largest request (11 blocks + the null block)")


def test_cli_says_which_capacities_it_does_not_run_and_runs_each_policy_once(tmp_path, capsys):
    import json

    from agentkv.__main__ import main

    out = tmp_path / "out"
    main(["bench", "replay", str(ODD_SHAPES), "--capacities", "5,40", "--policies", "lru,lru, belady",
          "--no-preflight", "--jobs", "1", "--quiet", "--out", str(out)])
    assert f"{ODD_SHAPES}: capacities 5 cannot hold the tape's largest request" in capsys.readouterr().err
    results = json.loads((out / "replay.json").read_text())["results"]
    assert sorted((r["capacity"], r["policy"]) for r in results) == [(40, "belady"), (40, "lru")]


def test_cli_refuses_an_out_path_that_is_a_file(tmp_path):
    from agentkv.__main__ import main

    taken = tmp_path / "out"
    taken.write_text("")
    with pytest.raises(SystemExit, match=f"--out {taken} is a file, not a directory"):
        main(["bench", "replay", str(ODD_SHAPES), "--jobs", "1", "--quiet", "--out", str(taken)])


def test_a_tape_without_parents_replays_as_the_one_with_them():
    from agentkv.bench.tape import Tape, WorkloadConfig, generate

    tape = generate(WorkloadConfig(topology="pipeline", sessions=6, seed=3))
    bare = Tape(tape.header, [dataclasses.replace(r, parent=None) for r in tape.requests])
    text = io.StringIO()
    write_tape(bare, text)
    assert '"parent"' not in text.getvalue()
    with_parents, without = TapePlan(tape), TapePlan(read_tape(io.StringIO(text.getvalue())))
    assert without.entry_agents() == with_parents.entry_agents() == ["supervisor"]
    cap = 2 * with_parents.max_request_blocks + 1
    assert replay(without, "agentkv", cap).hit_tokens == replay(with_parents, "agentkv", cap).hit_tokens
    assert replay(without, "agentkv", cap).hit_tokens > replay(without, "lru", cap).hit_tokens


def test_a_tape_whose_every_parent_is_empty_is_warned_about(caplog):
    from agentkv.bench import sweep as sweep_module

    sweep_module._PLANS.pop(str(ODD_SHAPES), None)
    with caplog.at_level("WARNING", logger="agentkv.bench.sweep"):
        sweep_module._plan(str(ODD_SHAPES))
    assert f'{ODD_SHAPES}: 34 of 36 requests have parent "" after their session\'s first request' in caplog.text


def test_tapes_without_names_replay_together_named_by_their_files(tmp_path):
    from agentkv.__main__ import main
    from agentkv.bench.sweep import tape_names

    text = "\n".join(json.dumps(x) for x in (HEADER, _request(), _request(t=1.0)))
    paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "more" / "a.jsonl"]
    for path in paths:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert tape_names([str(p) for p in paths], ["tape"] * 3) == ["a-1", "b", "a-2"]
    assert tape_names(["x.jsonl", "y.jsonl"], ["mine", "tape"]) == ["mine", "tape"]  # distinct names stay
    # a third tape's own name reads like a count: the counts go past it
    assert tape_names(["a/x.jsonl", "b/x.jsonl", "c.jsonl"], ["x", "x", "x-1"]) == ["x-2", "x-3", "x-1"]
    main(["bench", "replay", *map(str, paths), "--policies", "lru,agentkv", "--capacities", "8", "--jobs", "1",
          "--quiet", "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert [t["name"] for t in report["tapes"]] == ["a-1", "b", "a-2"]
    assert {r["tape"] for r in report["results"]} == {"a-1", "b", "a-2"} and len(report["results"]) == 9


def test_a_tape_without_steps_counts_a_tool_loop_as_one_dispatch():
    agents = ["a", "a", "b", "a"]  # a's tool loop, then b, then a again
    plain = _plan(HEADER, *(_request(t=float(i), agent=agent) for i, agent in enumerate(agents)))
    stepped = _plan(HEADER, *(_request(t=float(i), agent=agent, step=step)
                              for i, (agent, step) in enumerate(zip(agents, [0, 0, 1, 2], strict=True))))
    assert plain.tape.summary()["dispatches"] == stepped.tape.summary()["dispatches"] == 3


def test_a_graph_may_name_the_agents_as_they_are_sent():
    graph = {"nodes": ["Research_Agent", "Writer"], "edges": [["Research_Agent", "Writer"]],
             "entry": ["Research_Agent"]}
    plan = _plan(dict(HEADER, graph=graph), _request(agent="Research Agent"),
                 _request(t=1.0, agent="Writer", parent="Research Agent"))
    assert plan.declared_graph() == {"Research_Agent": {"Writer"}, "Writer": set()}
    assert replay(plan, "kvflow", 16).requests == 2


def test_a_session_id_may_start_a_new_conversation_after_an_abandoned_one():
    plan = _plan(HEADER, _request(abandoned=True), _request(t=1.0, agent="y"),
                 _request(t=2.0, agent="x", parent="y", abandoned=True))
    assert plan.tape.summary()["abandoned_sessions"] == 2
    for policy in ("lru", "agentkv", "kvflow", "belady"):
        assert replay(plan, policy, 16).requests == 3


def test_names_that_sanitize_alike_are_one_agent_and_the_replay_says_so(caplog):
    plan = _plan(HEADER, _request(agent="Research Agent"), _request(t=1.0, agent="Research_Agent"),
                 _request(t=2.0, agent="Writer", parent="Research Agent"))
    assert {r.agent for r in plan.requests} == {"Research_Agent", "Writer"}
    assert "1 agent or session ids outside the wire alphabet" in caplog.text
    assert "1 of them now equal another id" in caplog.text


def test_unknown_fields_of_a_request_line_are_ignored():
    plain = _plan(HEADER, _request(), _request(t=1.0, agent="y"))
    extra = _plan(HEADER, _request(latency_ms=12, meta={"user": "u"}), _request(t=1.0, agent="y", note=None))
    assert extra.tape.requests == plain.tape.requests
    assert replay(extra, "agentkv", 16).hit_tokens == replay(plain, "agentkv", 16).hit_tokens


def test_belady_is_never_below_lru_when_blocks_are_requeued():
    # blocks whose predicted use passed are re-queued in no chain order: a parent then went before
    # its child (belady 59.1% against lru 61.5% at 34 blocks)
    plan = TapePlan(read_tape(Path(__file__).parent / "tapes" / "belady-requeue.jsonl"))
    for capacity in (34, 45):
        assert replay(plan, "belady", capacity).hit_rate >= replay(plan, "lru", capacity).hit_rate


def test_belady_requeues_no_block_whose_last_filed_use_hit_it():
    # one request at a time, nothing evicted: every use a block is filed under hits it, so none is
    # re-queued (a block's earlier filings each re-queued it again at every later use: a pass over a
    # growing list per request, 12x the replay's time on a zoo tape at 60x its times)
    class Counting(Belady):
        requeued = 0
        scheduling = False

        def before_schedule(self, sim):
            self.scheduling = True
            super().before_schedule(sim)
            self.scheduling = False

        def group_of(self, block):
            self.requeued += self.scheduling
            return super().group_of(block)

    plan = _plan(HEADER, *(_request(t=10.0 * i) for i in range(20)))
    policy = Counting()
    result = replay(plan, policy, 16)
    assert result.hit_tokens == 19 * 32 and result.evictions == 0
    assert policy.requeued == 0


def test_request_ids_named_like_warmups_replay_as_any_others():
    # the replay's warm-ups are requests of their own: a tape's ids "warmup-N" must not meet them
    # (a warm-up took the hashes of the tape's request of its id: a crash, or other figures)
    from agentkv.bench.tape import WorkloadConfig, generate

    tape = generate(WorkloadConfig.named("pipeline", sessions=10, seed=0))
    named = dataclasses.replace(tape, requests=[dataclasses.replace(r, id=f"warmup-{i + 1}", output=r.output_key)
                                                for i, r in enumerate(tape.requests)])
    plain = dataclasses.replace(tape, requests=[dataclasses.replace(r, id=f"x-{i + 1}", output=r.output_key)
                                                for i, r in enumerate(tape.requests)])
    for capacity in (640, 700):
        assert replay(TapePlan(named), "agentkv+warmup", capacity).hit_tokens == \
            replay(TapePlan(plain), "agentkv+warmup", capacity).hit_tokens


def test_a_session_id_used_again_after_parent_empty_is_a_new_conversation():
    plan = _plan(HEADER,
                 _request(t=0.0, agent="a", tool_gap=0.5),
                 _request(t=1.0, agent="b", parent="a", tool_gap=0.5),
                 _request(t=100.0, agent="b"),
                 _request(t=101.0, agent="a", parent="b"))
    assert plan.next_in_session == [1, None, 3, None] and plan.conversation_starts == [0, 2]
    assert not plan.is_tool_call(plan.requests[1])  # the first conversation's last answer called no tool
    # the first dispatch's tool loop (its calls all say parent "") is one conversation
    loop = _plan(HEADER, _request(t=0.0, agent="a"), _request(t=1.0, agent="a"), _request(t=2.0, agent="b", parent="a"))
    assert loop.next_in_session == [1, 2, None] and loop.conversation_starts == [0]
    ended = []

    class Facts(AgentKV):
        def on_session_end(self, sim, session):
            ended.append((round(sim.now, 1), session))

    Replay(plan, Facts(facts=True), 64).run()
    assert [t for t, _ in ended] == [pytest.approx(1.0, abs=0.5), pytest.approx(101.0, abs=0.5)]  # each its end


def test_sessions_whose_ids_sanitize_alike_still_run_side_by_side():
    # "u 1" and "u_1" are one id on the wire, as live; each still waits on its own answers only
    lines = [_request(t=0.0, session="u 1", tool_gap=30.0), _request(t=0.0, session="u_1", tool_gap=30.0),
             _request(t=1.0, session="u 1", parent="x"), _request(t=1.0, session="u_1", parent="x")]
    result = replay(_plan(HEADER, *lines), "lru", 64)
    assert result.makespan_s < 40


def test_a_time_model_with_fields_of_its_own_is_read_for_the_ones_it_knows():
    from agentkv.bench.replay import time_model_of

    header = {**HEADER, "workload": {"time_model": {"prefill_tps": 1000.0, "tpot": 0.01, "overhead": 0.0,
                                                    "gpu": "H100"}}}
    tape = read_tape(io.StringIO(json.dumps(header) + "\n" + json.dumps(_request())))
    assert time_model_of(tape).prefill_tps == 1000.0


def test_a_tape_whose_times_its_tool_gaps_overrun_is_warned_about(tmp_path, caplog):
    from agentkv.bench import sweep as sweep_module

    # each call takes 5 ms + 40 / 10,000 s + 2 x 10 ms; the next comes 1 s later but the tool runs 3 s
    lines = [HEADER] + [_request(t=float(k), parent="" if k == 0 else "x", tool_gap=3.0) for k in range(40)]
    late = tmp_path / "late.jsonl"
    late.write_text("\n".join(json.dumps(x) for x in lines))
    on_time = tmp_path / "on-time.jsonl"
    on_time.write_text("\n".join(json.dumps(x) for x in [HEADER] + [
        _request(t=3.1 * k, parent="" if k == 0 else "x", tool_gap=3.0) for k in range(40)]))
    with caplog.at_level("WARNING", logger="agentkv.bench.sweep"):
        sweep_module._plan(str(late))
        sweep_module._plan(str(on_time))
    # request k arrives at 3.029 k s, 2.029 k s late: all but the first, the last by 79.1 s
    assert f"{late}: 39 of 40 requests arrive after their t with no cache hit and no queue" in caplog.text
    assert "up to 79.1 s later" in caplog.text
    assert str(on_time) not in caplog.text
