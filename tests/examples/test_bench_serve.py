"""``agentkv bench serve`` and ``agentkv demo``: the machinery offline, and a tiny run on the shared servers."""

from __future__ import annotations

import itertools
import json
import math
import uuid
from dataclasses import replace

import pytest

from agentkv.bench import serve
from agentkv.bench.serve_args import ServeConfig

METRICS = """# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 1536.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 64.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 4000.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7e+09
agentkv_prefix_cache_hits_total{agent="coder"} 99.0
"""


def test_prefix_cache_counters_sum_label_sets_and_ignore_others():
    assert serve.prefix_cache_counters(METRICS) == (1600.0, 4000.0)
    assert serve.prefix_cache_counters("") == (0.0, 0.0)


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    times = serve.arrival_times(2.0, 4000, seed=1)
    assert times == serve.arrival_times(2.0, 4000, seed=1) != serve.arrival_times(2.0, 4000, seed=2)
    assert times[0] == 0 and all(b >= a for a, b in itertools.pairwise(times))
    assert times[-1] / (len(times) - 1) == pytest.approx(0.5, rel=0.05)


def _record(agent="coder", start=0.0, ttft=0.1, latency=0.3, prompt=100, cached=60, error=None):
    return serve.CallRecord(agent, "s", start, start + ttft, start + latency, prompt, cached, error)


def test_summarize_percentiles_throughput_and_hit_rates():
    records = [_record(ttft=0.01 * (i + 1), latency=0.1) for i in range(100)] + [_record(error="boom")]
    row = serve.summarize(records, server="agentkv", rate=1.0, wall=10.0, hits=30, queries=120, sessions=4)
    assert row["turns"] == 100 and row["errors"] == 1
    assert row["ttft_mean_ms"] == pytest.approx(505.0)
    assert row["ttft_p50_ms"] == pytest.approx(500.0) and row["ttft_p99_ms"] == pytest.approx(990.0)
    assert row["turn_mean_ms"] == pytest.approx(100.0)
    assert row["throughput"] == pytest.approx(10.0)
    assert row["hit_rate"] == pytest.approx(0.25) and row["usage_hit_rate"] == pytest.approx(0.6)
    empty = serve.summarize([], server="vanilla", rate=1.0, wall=0.0, hits=0, queries=0, sessions=0)
    assert math.isnan(empty["ttft_mean_ms"]) and math.isnan(empty["hit_rate"])


def test_repeats_pool_calls_walls_and_counters():
    def run(ttft, wall, load):
        return serve.RateRun("agentkv", 1.0, 2, 8, [_record(ttft=ttft)] * 8, wall, 300, 400, [], (load, load + 1))

    row = serve.pooled_row([run(0.1, 4.0, 1.0), run(0.3, 4.0, 3.0)])
    assert (row["turns"], row["sessions"], row["blocks"]) == (16, 4, 2)
    assert row["ttft_mean_ms"] == pytest.approx(200.0) and row["throughput"] == pytest.approx(2.0)
    assert row["hit_rate"] == pytest.approx(0.75) and row["offered_turns_per_s"] == 8.0
    assert [r["ttft_mean_ms"] for r in row["runs"]] == pytest.approx([100.0, 300.0])
    assert row["load"] == [1.0, 4.0]


def test_call_timer_records_first_token_end_and_usage():
    from langchain_core.messages import AIMessage
    from langchain_core.outputs import ChatGeneration, LLMResult

    usage = {"input_tokens": 900, "output_tokens": 2, "total_tokens": 902, "input_token_details": {"cache_read": 640}}
    result = LLMResult(generations=[[ChatGeneration(message=AIMessage(content="x", usage_metadata=usage))]])

    timer = serve.CallTimer()
    run = uuid.uuid4()
    timer.on_chat_model_start({}, [], run_id=run, metadata={"langgraph_node": "coder", "thread_id": "t1"})
    timer.on_llm_new_token("", run_id=run)
    first = timer._open[run].first
    timer.on_llm_new_token("x", run_id=run)
    timer.on_llm_end(result, run_id=run)
    failed = uuid.uuid4()
    timer.on_chat_model_start({}, [], run_id=failed, metadata={})
    timer.on_llm_error(RuntimeError("down"), run_id=failed)
    ok, bad = timer.records
    assert (ok.agent, ok.session, ok.prompt_tokens, ok.cached_tokens) == ("coder", "t1", 900, 640)
    assert ok.first == first and ok.start <= ok.first <= ok.end and ok.error is None
    assert bad.error == "RuntimeError: down" and bad.end is None


def test_markdown_table_and_demo_summary():
    from agentkv.demo import summary_table

    rows = [
        serve.RateRun("vanilla", 0.5, 1, 1, [_record(ttft=0.2, cached=60)], 1.0, 1, 4, [], (0.5, 0.7)).row(),
        serve.RateRun("agentkv", 0.5, 1, 1, [_record(ttft=0.1, cached=64)], 1.0, 3, 4, [], (0.7, 0.9)).row(),
    ]
    serve.add_anchor_hits(rows, {"block_size": 32, "agents": {"coder": {"anchor_length_blocks": 2}}})
    assert [r["anchor_hit_rate"] for r in rows] == [0.0, 1.0]  # the 64-token anchor: 60 cached miss it
    # untagged: the server knows the coder as what it recognized it as, most often
    untagged = serve.RateRun("agentkv", 0.5, 1, 1, [_record(ttft=0.1, cached=64)] * 3, 1.0, 3, 4, [], (0.7, 0.9),
                             confusion={"coder": {"fp:1": 2, "fp:2": 1}}).row()
    serve.add_anchor_hits([untagged], {"block_size": 32, "agents": {"fp:1": {"anchor_length_blocks": 2}}})
    assert untagged["anchor_hit_rate"] == 1.0
    table = serve.markdown_table(rows)
    assert table.splitlines()[2].startswith("| 0.5 | vanilla | 25.0% | 0% | 200 ms")
    assert table.splitlines()[3].startswith("| 0.5 | agentkv | 75.0% | 100% | 100 ms")
    assert table.endswith("| 0.50x | 0.7-0.9 |")
    assert "| 0.5 | agentkv | 75.0% | 100% | 100 ms | 100 ms | 300 ms | 1.00 turns/s |" in summary_table(rows)


def test_command_line_reaches_the_benchmark(monkeypatch, tmp_path):
    import agentkv.__main__ as cli

    seen = {}
    monkeypatch.setattr(serve, "main", lambda args: seen.update(config=serve.config_from_args(args)))
    cli.main(["bench", "serve", "--rates", "0.5,2", "--sessions", "3", "--blocks", "161", "--out", str(tmp_path)])
    config = seen["config"]
    assert (config.rates, config.sessions, config.blocks, config.out) == ([0.5, 2.0], 3, 161, tmp_path)


@pytest.mark.server
def test_tiny_benchmark_on_both_servers(vanilla_server, agentkv_server, tmp_path):
    config = ServeConfig(rates=[4.0], sessions=2, warmup_sessions=0, turns=3, tool_gap=0.05, concurrency=2,
                         out=tmp_path)
    result = serve.run_benchmark(config, servers={"vanilla": vanilla_server, "agentkv": agentkv_server})
    rows = {row["server"]: row for row in result["rows"]}
    assert set(rows) == {"vanilla", "agentkv"}
    for row in rows.values():
        assert (row["turns"], row["errors"], row["failed_sessions"]) == (6, 0, 0), row.get("failures")
        assert 0 <= row["hit_rate"] <= 1 and 0 <= row["usage_hit_rate"] <= 1
        assert row["prompt_tokens"] > 6 * 500  # every call carries its agent's anchor
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["ttft_mean_ms"] <= row["turn_mean_ms"]
        assert row["throughput"] > 0
    assert result["agentkv_stats"]["version"] == 1
    paths = serve.write_reports(result, tmp_path)
    assert json.loads((tmp_path / "serve.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    assert "| 4 | agentkv |" in paths["md"].read_text()
    assert paths["png"].stat().st_size > 10_000
    # a second run in the same process (a notebook): every session runs again
    again = serve.run_benchmark(replace(config, turns=2), servers={"vanilla": vanilla_server}, log=lambda _: None)
    assert [(r["turns"], r["errors"], r["failed_sessions"]) for r in again["rows"]] == [(4, 0, 0)]


def test_replica_options_reach_the_config_and_bad_ones_are_refused(monkeypatch, tmp_path):
    import agentkv.__main__ as cli

    seen = {}
    monkeypatch.setattr(serve, "main", lambda args: seen.update(config=serve.config_from_args(args)))
    cli.main(["bench", "serve", "--replicas", "2", "--router", "kv_aware, round_robin", "--routing-key", "agent",
              "--blocks", "181", "--out", str(tmp_path)])
    config = seen["config"]
    assert (config.replicas, config.routers, config.routing_keys) == (2, ["kv_aware", "round_robin"], ["agent"])
    assert config.replica_blocks == 91  # 2 x 90 usable blocks = the single server's 180
    with pytest.raises(ValueError, match="unknown router policy"):
        ServeConfig(routers=["least_loaded"])
    from agentkv.bench.serve_args import router_command

    assert ServeConfig(routers=["kv_aware+affinity"]).routers == ["kv_aware+affinity"]
    assert router_command("kv_aware+affinity") == ("kv_aware", ("--kv-aware-session-affinity-ttl-secs", "600"))
    assert router_command("round_robin") == ("round_robin", ())
    with pytest.raises(ValueError, match="unknown routing key"):
        ServeConfig(routing_keys=["user"])
    with pytest.raises(ValueError, match="less than --max-model-len"):
        ServeConfig(replicas=4, blocks=201)  # 50 blocks x 32 tokens < 2048
    # each would start servers and then fail, or run one setup twice under two names
    with pytest.raises(ValueError, match="at least one --router"):
        ServeConfig(replicas=2, blocks=401, routers=[])
    with pytest.raises(ValueError, match="named twice"):
        ServeConfig(replicas=2, blocks=401, routers=["kv_aware", "kv_aware"])
    with pytest.raises(ValueError, match="named twice"):
        ServeConfig(routing_keys=["agent", "agent"])
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        ServeConfig(out=tmp_path / "a-file")


def test_targets_cover_every_policy_and_key_once_and_events_go_to_every_agentkv_replica():
    from agentkv.bench.serve.replicas import targets_for

    config = ServeConfig(replicas=2, routers=["kv_aware", "round_robin"], routing_keys=["session", "agent"])
    replicas = {"vanilla": ["http://v0", "http://v1"], "agentkv": ["http://a0", "http://a1"]}
    routers = {kind: {p: f"http://{kind}-{p}" for p in config.routers} for kind in replicas}
    targets = targets_for(config, {"vanilla": "http://v", "agentkv": "http://a"}, routers, replicas)
    assert [(t.setup, t.server) for t in targets] == [
        ("single", "vanilla"), ("single", "agentkv"),
        ("kv_aware/session", "vanilla"), ("kv_aware/session", "agentkv"),
        ("kv_aware/agent", "vanilla"), ("kv_aware/agent", "agentkv"),
        ("round_robin/session", "vanilla"), ("round_robin/session", "agentkv"),  # the key is moot: once
    ]
    # an uninstrumented app sends no X-Session-ID: every policy once
    untagged = targets_for(replace(config, untagged=True), {"vanilla": "http://v", "agentkv": "http://a"}, routers,
                           replicas)
    assert [t.setup for t in untagged[2:]] == ["kv_aware/session"] * 2 + ["round_robin/session"] * 2
    by = {(t.setup, t.server): t for t in targets}
    assert by["single", "agentkv"] == serve.Target("agentkv", "http://a", ("http://a",), ("http://a",))
    assert by["single", "vanilla"].events == () and by["kv_aware/agent", "vanilla"].events == ()
    routed = by["kv_aware/agent", "agentkv"]
    assert (routed.url, routed.engines, routed.events) == ("http://agentkv-kv_aware", ("http://a0", "http://a1"),
                                                           ("http://a0", "http://a1"))
    assert (routed.routing_key, by["single", "agentkv"].routing_key) == ("agent", "session")


def test_routed_rows_sum_engines_show_the_replica_share_and_compare_within_a_setup():
    def run(server, setup, ttft, hits, queries):
        return serve.RateRun(server, 1.0, 1, 1, [_record(ttft=ttft)], 1.0, sum(hits), sum(queries), [], (1.0, 1.0),
                             setup, tuple(queries))

    rows = [
        run("vanilla", "single", 0.2, [10], [40]).row(),
        run("agentkv", "single", 0.1, [20], [40]).row(),
        serve.pooled_row([run("vanilla", "kv_aware/session", 0.4, [5, 5], [30, 10]),
                          run("vanilla", "kv_aware/session", 0.4, [5, 5], [10, 30])]),
        run("agentkv", "kv_aware/session", 0.1, [10, 20], [20, 20]).row(),
    ]
    assert "engine_share" not in rows[0] and rows[2]["engine_share"] == [0.5, 0.5]
    assert rows[2]["hit_rate"] == pytest.approx(0.25) and rows[3]["hit_rate"] == pytest.approx(0.75)
    lines = serve.markdown_table(rows).splitlines()
    assert "| setup | server |" in lines[0] and "| replica share |" in lines[0]
    assert lines[1].count("|") == lines[0].count("|")
    assert lines[3].startswith("| 1 | single | agentkv | 50.0% |") and "| 0.50x |" in lines[3]
    assert lines[5].startswith("| 1 | kv_aware/session | agentkv | 75.0% |") and "| 0.25x | 50%/50% |" in lines[5]
    plain = serve.markdown_table(rows[:2]).splitlines()
    assert "setup" not in plain[0] and plain[3].startswith("| 1 | agentkv | 50.0% |")


def test_example_workloads_repeat_the_work_not_the_prompt():
    example = serve.load_example()
    team = example.TeamConfig(base_url="http://127.0.0.1:9/v1", routing="markov")
    tasks = {}

    class Capture:
        async def ainvoke(self, inputs, config):
            tasks[config["configurable"]["thread_id"]] = (inputs["session"], inputs["messages"][0].content)
            return inputs

    import asyncio

    for session in ("x-1", "x-1@kv_aware/agent"):
        asyncio.run(example.run_session(Capture(), session, team, workload="x-1"))
    (plain_workload, plain_text), (routed_workload, routed_text) = tasks["x-1"], tasks["x-1@kv_aware/agent"]
    assert plain_workload == routed_workload == "x-1"  # same routes and tool arguments
    assert plain_text in example.TASKS and routed_text == f"Ticket x-1@kv_aware/agent: {plain_text}"


def test_warmup_variant_shares_agentkv_engines_but_never_its_sessions():
    from agentkv.bench.serve.replicas import targets_for

    config = ServeConfig(replicas=2, routers=["consistent_hash"], routing_keys=["agent"], warmup=True)
    replicas = {"vanilla": ["http://v0", "http://v1"], "agentkv": ["http://a0", "http://a1"]}
    routers = {kind: {"consistent_hash": f"http://{kind}-ch"} for kind in replicas}
    targets = targets_for(config, {"vanilla": "http://v", "agentkv": "http://a"}, routers, replicas)
    assert [(t.setup, t.server) for t in targets] == [
        ("single", "vanilla"), ("single", "agentkv"), ("single", "agentkv+warmup"),
        ("consistent_hash/agent", "vanilla"), ("consistent_hash/agent", "agentkv"),
        ("consistent_hash/agent", "agentkv+warmup"),
    ]
    single, single_warm, routed, routed_warm = targets[1], targets[2], targets[4], targets[5]
    assert (single_warm.url, single_warm.engines, single_warm.warmup) == (single.url, single.engines, True)
    assert (routed_warm.url, routed_warm.events) == (routed.url, routed.events) == ("http://agentkv-ch", ("http://a0", "http://a1"))
    suffixes = [t.session_suffix for t in targets]
    assert len(set(suffixes)) == len(suffixes)  # no two targets share a session (the arms share engines)
    # every prompt quotes its session id: the targets compared with each other have ids of one length
    assert {len(x) for x in suffixes[:3]} == {len("@single/0")} and len({len(x) for x in suffixes[3:]}) == 1
    without = serve.single_targets(ServeConfig(), {"vanilla": "http://v", "agentkv": "http://a"})
    assert [t.session_suffix for t in without] == ["", ""]  # nothing shared: the demo's prompts as they were


@pytest.mark.server
def test_the_warmup_arm_runs_the_coordinator_and_reports_what_it_decided(vanilla_server, agentkv_server, tmp_path):
    config = ServeConfig(rates=[4.0], sessions=3, warmup_sessions=2, turns=4, tool_gap=0.2, concurrency=3,
                         warmup=True, out=tmp_path)
    result = serve.run_benchmark(config, servers={"vanilla": vanilla_server, "agentkv": agentkv_server},
                                 log=lambda _: None)
    rows = {row["server"]: row for row in result["rows"]}
    assert set(rows) == {"vanilla", "agentkv", "agentkv+warmup"}
    assert all((row["turns"], row["errors"]) == (12, 0) for row in rows.values())
    counts = rows["agentkv+warmup"]["warmups"]
    assert "warmups" not in rows["agentkv"]
    decided = counts.get("sent", 0) + sum(n for k, n in counts.items() if k.startswith("skipped_"))
    assert decided > 0 and counts.get("failed", 0) == 0  # every dispatch's decision, counted by its reason
    assert counts.get("sent", 0) == counts.get("server_sent", 0)  # the server received each one the coordinator sent
    # the engine's counters less the warm-ups' own tokens: the real calls' hit rate, as their usage tells
    assert all(row["hit_rate"] == pytest.approx(row["usage_hit_rate"]) for row in rows.values())
    assert {(c["server"], c["baseline"]) for c in result["comparisons"]} == {
        ("agentkv", "vanilla"), ("agentkv+warmup", "vanilla"), ("agentkv+warmup", "agentkv")}
    [line] = serve.warmup_lines(result)
    assert line.startswith(f"agentkv+warmup at 4 sessions/s: warm-ups sent {counts.get('sent', 0)}")


def test_warmup_outcomes_seen_in_other_blocks_are_the_warmup_arms():
    from collections import Counter

    from agentkv.bench.serve.run import _WarmupCredit

    warm, plain = serve.Target("agentkv+warmup", "http://a", ("http://a",)), serve.Target("agentkv", "http://a", ("http://a",))

    def run(target, before, after):
        reads = (None if before is None else Counter(before), None if after is None else Counter(after))
        return serve.RateRun(target.server, 1.0, 1, 1, [], 1.0, 0, 0, [], (1.0, 1.0),
                             warmups={"sent": 0} if target.warmup else None, warmup_reads=reads)

    credit = _WarmupCredit()
    early = run(plain, {}, {"useful": 1})  # the unmeasured warm-up sessions' warm-up: nobody's
    first = run(warm, {"useful": 1}, {"sent": 2, "useful": 2})
    later = run(plain, {"sent": 2, "useful": 2, "wasted": 1}, {"sent": 2, "useful": 3, "wasted": 1})  # expired between
    unread = run(plain, None, {"sent": 2, "useful": 3, "wasted": 1})
    for r in (early, first, later, unread):
        credit.add(warm if r is first else plain, r)
    assert first.warmups == {"sent": 0, "server_sent": 2, "server_useful": 2, "server_wasted": 1}
    assert early.warmups is None and later.warmups is None
    second = run(warm, {"sent": 2, "useful": 3, "wasted": 1}, None)
    credit.add(warm, second)
    assert second.warmups == {"sent": 0, "server_unread": 1}


def test_a_run_whose_calls_all_failed_exits_non_zero(monkeypatch, tmp_path, capsys):
    import agentkv.__main__ as cli
    from agentkv.bench.serve import cli as serve_cli

    def failed(config):
        rows = [serve.RateRun(server, 1.0, 1, 1, [_record(error="401")], 1.0, 0, 0, ["AuthenticationError"],
                              (1.0, 1.0)).row() for server in ("vanilla", "agentkv")]
        return {"config": {"sessions": 1, "turns": 1, "blocks": 81, "block_size": 32, "tool_gap": 0.3, "seed": 0},
                "rows": rows, "comparisons": []}

    monkeypatch.setattr(serve_cli, "run_benchmark", failed)
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "serve", "--model", "tiny", "--out", str(tmp_path)])
    assert exited.value.code == 1
    assert "every call failed on vanilla (single), agentkv (single)" in capsys.readouterr().out


def test_the_demo_says_what_the_server_learned_before_it_can_score_its_predictions():
    from agentkv.demo import _learned

    lines = _learned({"policy": "lru", "predictability": 0.0, "top1_accuracy": None, "evictions": {"anchor": 0}})
    assert lines[0] == "agentkv server learned: policy lru, predictability R 0.00, next-agent top-1 accuracy n/a"
