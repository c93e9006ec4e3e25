"""Replays through the real vLLM KVCacheManager: invariants of the engine and the policies."""

from __future__ import annotations

import io
import json

import pytest
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

from agentkv.bench import replay as replay_module
from agentkv.bench._defaults import POLICY_NAMES
from agentkv.bench.plan import TapePlan
from agentkv.bench.policies import POLICIES, AgentKV, KVFlow, ScoredPolicy
from agentkv.bench.replay import Replay, replay
from agentkv.bench.sweep import candidate_capacities, sweep
from agentkv.bench.tape import WorkloadConfig, generate, read_tape, write_tape
from agentkv.bench.workloads import ZOO
from server_patch._free_queue import ScoredFreeBlockQueue
from server_patch._runtime import AgentKVRuntime, RuntimeConfig

NON_PREFETCH = [p for p in POLICY_NAMES if p not in ("belady", "agentkv+warmup")]


@pytest.fixture(scope="module")
def selector() -> TapePlan:
    return TapePlan(generate(WorkloadConfig(topology="selector", sessions=10, seed=2)))


@pytest.fixture(scope="module")
def pipeline() -> TapePlan:
    return TapePlan(generate(WorkloadConfig(topology="pipeline", sessions=10, seed=2)))


def capacity(plan: TapePlan, multiple: float) -> int:
    return int(multiple * plan.max_request_blocks) + 1


class EqualScores(ScoredPolicy):
    """The scored-queue seam with one score for every block: must be vanilla LRU."""

    name = "equal"

    def group_of(self, block):
        return "all"

    def score(self, group):
        return 0.0


def test_policy_names_agree():
    assert set(POLICIES) == set(POLICY_NAMES)


@pytest.mark.parametrize("multiple", [1.5, 2.5])
def test_lru_is_vanilla_vllm(selector, multiple):
    cap = capacity(selector, multiple)
    sim = Replay(selector, POLICIES["lru"](), cap)
    lru = sim.run()
    assert type(sim.pool.free_block_queue) is FreeKVCacheBlockQueue  # nothing installed
    disabled = replay(selector, AgentKV(RuntimeConfig(enabled=False)), cap)
    equal = replay(selector, EqualScores(), cap)
    for other in (disabled, equal):
        assert (other.hit_tokens, other.anchor_hit_tokens, other.evictions, other.makespan_s) == (
            lru.hit_tokens, lru.anchor_hit_tokens, lru.evictions, lru.makespan_s)
    assert lru.requests == len(selector.requests) and lru.prompt_tokens == sum(len(p) for p in selector.prompts)
    assert lru.prefill_tokens == lru.prompt_tokens - lru.hit_tokens


@pytest.mark.parametrize("multiple", [1.5, 2.5, 4.0])
def test_belady_beats_every_demand_policy(selector, pipeline, multiple):
    for plan in (selector, pipeline):
        cap = capacity(plan, multiple)
        oracle = replay(plan, "belady", cap).hit_rate
        for policy in NON_PREFETCH:
            assert oracle >= replay(plan, policy, cap).hit_rate, (plan.tape.name, cap, policy)


def test_agentkv_runs_the_real_server_runtime(pipeline):
    policy = AgentKV()
    sim = Replay(pipeline, policy, capacity(pipeline, 2.5))
    result = sim.run()
    assert isinstance(policy.runtime, AgentKVRuntime)
    assert isinstance(sim.pool.free_block_queue, ScoredFreeBlockQueue)
    assert sim.pool.free_block_queue in policy.runtime.queues
    stats = policy.runtime.stats()
    assert stats["tagged_requests"] == len(pipeline.requests) == result.requests
    assert stats["policy"] == "survival" and stats["predictability"] == pytest.approx(1.0)
    assert stats["agents"]["coder"]["anchor_length_blocks"] == (64 + 1650) // 16
    assert sum(v["queries"] for v in stats["agents"].values()) == result.prompt_tokens
    assert sum(v["hits"] for v in stats["agents"].values()) == result.hit_tokens
    assert result.hit_rate > replay(pipeline, "lru", capacity(pipeline, 2.5)).hit_rate


def test_facts_and_warmup(pipeline):
    cap = capacity(pipeline, 1.5)
    facts = AgentKV(facts=True)
    Replay(pipeline, facts, cap).run()
    assert set(facts.runtime.facts.ended) == {r.session for r in pipeline.requests}
    assert facts.runtime.facts.export()["edges"][0] == ["coder", "reviewer"]
    warm = AgentKV(facts=True, warmup=True)
    result = Replay(pipeline, warm, cap).run()
    assert result.warmups == warm.warmups["issued"] > 0 and result.warmup_tokens > 0
    assert result.computed_tokens == result.prefill_tokens + result.warmup_tokens
    assert warm.runtime.learner.dispatches == len({(r.session, r.step) for r in pipeline.requests})  # never learned
    outcomes = result.policy_stats["warmup_outcomes"]
    assert outcomes["sent"] == result.warmups  # the server counted every warm-up the policy issued
    assert outcomes["sent"] == outcomes["useful"] + outcomes["wasted"] + outcomes["redundant"] + outcomes["pending"]
    assert outcomes["useful"] > 0
    assert "fresh" not in result.policy_stats["warmups"]


def test_ttl_pins_hold_blocks(selector):
    cap = capacity(selector, 2.0)
    pinned = replay(selector, "ttl", cap, ttl=30.0)
    assert pinned.policy_stats["ttl_s"] == 30.0
    assert pinned.mean_wait_s > replay(selector, "lru", cap).mean_wait_s  # hard pins delay admissions


def test_replay_is_deterministic(selector):
    cap = capacity(selector, 2.0)
    for policy in ("agentkv+warmup", "kvflow", "belady"):
        a, b = replay(selector, policy, cap).to_json(), replay(selector, policy, cap).to_json()
        a.pop("wall_s"), b.pop("wall_s")
        assert a == b


def test_preflight_keeps_only_capacities_with_headroom(tmp_path, selector):
    path = tmp_path / "selector.jsonl"
    write_tape(selector.tape, path)
    caps = candidate_capacities(selector, (1.5, 2.5, 5.0))
    assert caps == sorted(caps) and caps[0] - 1 >= selector.max_request_blocks
    report = sweep([str(path)], policies=["lru", "agentkv", "belady"], capacities=caps, margin=10.0, jobs=1,
                   progress=False, skip_dropped=True)
    (tape,) = report["tapes"]
    rate = {(r["capacity"], r["policy"]): r["hit_rate"] for r in report["results"]}
    assert tape["kept"] == [c for c in caps if 100 * (rate[c, "belady"] - rate[c, "lru"]) >= 10.0]
    assert set(tape["kept"]) < set(caps)  # the largest cache holds everything: dropped
    assert {c for c, p in rate if p == "agentkv"} == set(tape["kept"])  # skip_dropped
    none = sweep([str(path)], policies=["lru", "belady"], capacities=caps, margin=100.0, jobs=1, progress=False)
    assert none["tapes"][0]["kept"] == []
    json.dumps(report)  # serialisable


def test_cli_tape_and_replay(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from agentkv.__main__ import main

    tape = tmp_path / "p.jsonl"
    main(["bench", "tape", "--topology", "pipeline", "--sessions", "4", "--seed", "1", "-o", str(tape)])
    out = tmp_path / "out"
    main(["bench", "replay", str(tape), "--policies", "lru,agentkv,belady", "--multipliers", "1.5,3", "--margin", "0",
          "--jobs", "1", "--quiet", "--out", str(out)])
    text = capsys.readouterr().out
    assert "### Pressure preflight" in text and "| agentkv |" in text
    report = json.loads((out / "replay.json").read_text())
    assert {r["policy"] for r in report["results"]} == {"lru", "agentkv", "belady"}
    assert (out / "replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "replay.md").read_text() == text.rstrip("\n") + "\n"


def test_cli_replay_without_tapes_generates_them_and_two_workers_agree_with_one(tmp_path, capsys):
    """No TAPE arguments: one tape per ``--workloads`` entry under OUT/tapes; the default two worker
    processes give the same hit rates as one (block hashes are equal across processes)."""
    pytest.importorskip("matplotlib")
    from agentkv.__main__ import main

    common = ["bench", "replay", "--workloads", "pipeline,teams", "--sessions", "4", "--policies", "lru,agentkv,belady",
              "--multipliers", "2", "--margin", "0", "--quiet"]
    main([*common, "--out", str(tmp_path / "two"), "--plot", str(tmp_path / "plot.png")])
    main([*common, "--jobs", "1", "--out", str(tmp_path / "one")])
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "two" / "tapes").iterdir()) == ["pipeline-s0.jsonl", "teams-s0.jsonl"]
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def hits(out: str) -> dict[tuple[str, str, int], int]:
        report = json.loads((tmp_path / out / "replay.json").read_text())
        return {(r["tape"], r["policy"], r["capacity"]): r["hit_tokens"] for r in report["results"]}

    assert hits("two") == hits("one") and len(hits("one")) == 6


def test_cli_replay_always_runs_the_references(tmp_path, capsys):
    """The report is relative to lru and belady: a policy list without them, and no preflight, still
    gives the full report (it crashed with a KeyError)."""
    pytest.importorskip("matplotlib")
    from agentkv.__main__ import main

    tape = tmp_path / "p.jsonl"
    main(["bench", "tape", "--topology", "pipeline", "--sessions", "4", "--seed", "1", "-o", str(tape)])
    out = tmp_path / "out"
    main(["bench", "replay", str(tape), "--policies", "agentkv", "--multipliers", "1.5", "--no-preflight",
          "--jobs", "1", "--quiet", "--out", str(out)])
    assert "| agentkv |" in capsys.readouterr().out
    report = json.loads((out / "replay.json").read_text())
    assert report["policies"] == ["lru", "belady", "agentkv"]
    assert [r["policy"] for r in report["results"]] == ["lru", "belady", "agentkv"]


def test_cli_replay_refuses_a_request_beyond_any_context_window(tmp_path):
    """A request of 100M tokens (a typo, or a tape from a broken tool): the replay computes every token
    id, so it hung for minutes growing gigabytes; now the reader names the line before any work."""
    from agentkv.__main__ import main
    from agentkv.bench.tape.format import MAX_REQUEST_TOKENS

    header = {"format": "agentkv-tape", "version": 1, "block_size": 16}
    line = {"session": "a", "agent": "x", "parent": "", "output_tokens": 1, "tool_gap": 0}
    tape = tmp_path / "huge.jsonl"
    tape.write_text("\n".join(json.dumps(x) for x in [
        header, {**line, "t": 0, "segments": [["anchor/x", 32]]},
        {**line, "t": 1, "segments": [["anchor/x", 32], ["pasted", 100_000_000]]}]) + "\n")
    with pytest.raises(SystemExit, match=f"line 3: .*at most {MAX_REQUEST_TOKENS:,}"):
        main(["bench", "replay", str(tape), "--policies", "lru", "--jobs", "1", "--quiet", "--out", str(tmp_path)])


def test_capacity_below_the_largest_request_is_refused(selector):
    with pytest.raises(replay_module.CapacityError):
        Replay(selector, POLICIES["lru"](), selector.max_request_blocks)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_tapes_replay_with_their_declared_graph(name):
    plan = TapePlan(generate(WorkloadConfig.named(name, sessions=4, seed=1)))
    graph = plan.tape.header["graph"]
    assert plan.declared_graph() == {a: {b for x, b in graph["edges"] if x == a} for a in graph["nodes"]}
    assert plan.entry_agents() == graph["entry"]
    event = plan.graph_event()
    assert event is not None and event["id"] == f"tape-{name}-s1" and event["nodes"] == graph["nodes"]
    cap = capacity(plan, 2.0)
    rates = {policy: replay(plan, policy, cap).hit_rate for policy in ("lru", "agentkv+facts", "kvflow", "belady")}
    assert all(rates["belady"] >= rate for rate in rates.values()), rates
    facts = AgentKV(facts=True)
    Replay(plan, facts, cap).run()  # the graph event was accepted (install asserts it)
    assert set(facts.runtime.facts.graph.nodes) == set(graph["nodes"])
    ended = {r.session for r in plan.requests if plan.next_in_session[plan.requests.index(r)] is None
             and not r.abandoned}
    assert set(facts.runtime.facts.ended) == ended  # an abandoned session is never ended


def test_abandoned_sessions_stay_live_for_kvflow():
    plan = TapePlan(generate(WorkloadConfig.named("abandoned", sessions=6, seed=0)))
    abandoned = {r.session for r in plan.requests if r.abandoned}
    assert abandoned and abandoned != {r.session for r in plan.requests}
    policy = KVFlow()
    Replay(plan, policy, capacity(plan, 2.0)).run()
    assert set(policy.current) == abandoned  # the app never said these sessions ended


def test_a_graph_with_ids_off_the_wire_is_declared_as_the_clients_send_them():
    lines = [{"format": "agentkv-tape", "version": 1, "block_size": 16, "name": "hand made",
              "graph": {"nodes": ["a", "b c"], "edges": [["a", "b c"], ["b c", "a"], ["a", "a"]], "entry": ["a"]}},
             {"t": 0.0, "session": "s", "agent": "a", "parent": "", "segments": [["anchor/a", 40]],
              "output_tokens": 2, "tool_gap": 0}]
    plan = TapePlan(read_tape(io.StringIO("\n".join(json.dumps(x) for x in lines))))
    assert plan.declared_graph() == {"a": {"a", "b_c"}, "b_c": {"a"}}
    assert plan.graph_event() == {"type": "graph", "id": "tape-hand_made", "nodes": ["a", "b_c"],
                                  "edges": [["b_c", "a"]], "conditional_edges": [["a", "a"], ["a", "b_c"]],
                                  "entry": ["a"]}
    assert replay(plan, "agentkv+facts", 8).requests == 1
