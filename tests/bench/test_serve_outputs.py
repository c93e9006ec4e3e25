"""What ``agentkv bench serve`` leaves in its output folder: strict JSON (no bare NaN), rewritten
after every block, so that an interrupted run keeps what it measured; and the sessions it refuses
to plan (longer than the servers' context)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentkv.bench import serve
from agentkv.bench.serve import report as serve_report
from agentkv.bench.serve import run as serve_run
from agentkv.bench.serve_args import REPO_ROOT, ServeConfig, session_tokens
from agentkv.bench.serve_paired import Block, compare


def _strict(text: str) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_figures_without_data_are_written_as_null(tmp_path):
    failed = serve.CallRecord("coder", "s", 0.0, error="APIError: context overflow")
    rows = [serve.RateRun(server, 1.0, 1, 1, [failed], 1.0, 0, 0, ["APIError"], (1.0, 1.0)).row()
            for server in ("vanilla", "agentkv")]
    block = Block.of(serve.RateRun("agentkv", 1.0, 1, 1, [failed], 1.0, 0, 0, [], (1.0, 1.0)))
    result = {"config": {"sessions": 1, "turns": 1, "blocks": 81, "block_size": 32, "tool_gap": 0.3, "seed": 0},
              "rows": rows, "comparisons": [{"rate": 1.0, "setup": "single", "server": "agentkv",
                                             "baseline": "vanilla", **compare([(block, block)])}]}
    serve_report.write_json(result, tmp_path / "serve.json")
    written = _strict((tmp_path / "serve.json").read_text())
    assert written["rows"][0]["ttft_mean_ms"] is None and written["rows"][0]["hit_rate"] is None
    assert written["comparisons"][0]["ttft_mean"] == {"value": None, "low": None, "high": None}
    assert written["rows"][0]["turns"] == 0 and written["config"]["seed"] == 0  # the rest as it was


@pytest.mark.parametrize("stopped", ["while writing", "before the replace"])
def test_a_write_stopped_by_ctrl_c_keeps_the_previous_serve_json_and_leaves_no_temporary_file(
        monkeypatch, tmp_path, stopped):
    path = tmp_path / "serve.json"
    serve_report.write_json({"complete": False, "rows": []}, path)
    write_text = Path.write_text
    temporaries = []

    def half_then_interrupt(self, text, *args, **kwargs):
        temporaries.append(self)
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    def interrupt(*args):
        raise KeyboardInterrupt

    if stopped == "while writing":
        monkeypatch.setattr(Path, "write_text", half_then_interrupt)
    else:
        monkeypatch.setattr(serve_report.os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        serve_report.write_json({"complete": True, "rows": [{"server": "vanilla"}]}, path)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["serve.json"]
    assert _strict(path.read_text()) == {"complete": False, "rows": []}
    # in the output folder, one per process: two runs never write each other's temporary file
    assert temporaries == ([tmp_path / f".serve.json.{os.getpid()}.partial"] if stopped == "while writing" else [])


def test_a_write_removes_the_temporary_files_of_dead_runs_and_keeps_a_live_runs(tmp_path, caplog):
    # a run SIGKILLed between writing its temporary file and the replace: the file stays, its pid names no process
    killed = ("import os, signal, sys; from pathlib import Path; from agentkv.bench.serve import report; "
              "report.os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL); "
              "report.write_json({'complete': False}, Path(sys.argv[1]))")
    dead = subprocess.Popen([sys.executable, "-c", killed, str(tmp_path / "serve.json")], cwd=REPO_ROOT)
    assert dead.wait() == -signal.SIGKILL
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale, running = tmp_path / f".serve.json.{dead.pid}.partial", tmp_path / f".serve.json.{live.pid}.partial"
        # not serve.json's, or no pid in the name: left alone
        others = [tmp_path / f".other.json.{dead.pid}.partial", tmp_path / ".serve.json.abc.partial",
                  tmp_path / f".serve.json.{dead.pid}.partial.bak", tmp_path / f".serve.json.{2 ** 80}.partial"]
        assert stale.exists()
        for path in [running, *others]:
            path.write_text("{")
        with caplog.at_level(logging.WARNING, logger=serve_report.__name__):
            serve_report.write_json({"complete": True, "rows": []}, tmp_path / "serve.json")
            serve_report.write_json({"complete": True, "rows": []}, tmp_path / "serve.json")  # nothing left to remove
    finally:
        live.kill()
        live.wait()
    assert sorted(tmp_path.iterdir()) == sorted([tmp_path / "serve.json", running, *others])
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'serve.json'}: removed 1 temporary files left by runs killed while writing it: {stale.name}"]


def test_a_write_on_windows_leaves_the_temporary_files_of_other_runs_alone(monkeypatch, tmp_path):
    """os.kill(pid, 0) terminates the process on Windows: no pid is checked there."""
    stale = tmp_path / ".serve.json.1.partial"
    stale.write_text("{")

    def kill(pid, sig):
        raise AssertionError(f"os.kill({pid}, {sig})")

    monkeypatch.setattr(serve_report, "os", SimpleNamespace(name="nt", kill=kill, getpid=os.getpid, replace=os.replace))
    serve_report.write_json({"complete": True, "rows": []}, tmp_path / "serve.json")
    assert sorted(tmp_path.iterdir()) == [stale, tmp_path / "serve.json"]


def _fake_blocks(monkeypatch, *, interrupt_at: int | None = None) -> list[str]:
    """Blocks run without servers: each returns a run of one 0.1 s call per session; the call
    numbered ``interrupt_at`` is a Ctrl-C."""
    ran = []

    async def run_rate(app, team, target, *, rate, sessions, seed, prefix, **options):
        if len(ran) == interrupt_at:
            raise KeyboardInterrupt
        ran.append(f"{target.server} {prefix}")
        records = [serve.CallRecord("coder", f"{prefix}-{i}", 0.0, 0.1, 0.3, 100, 60) for i in range(sessions)]
        return serve.RateRun(target.server, rate, sessions, team.turns, records, 1.0, 60, 100, [], (1.0, 1.0))

    monkeypatch.setattr(serve_run, "run_rate", run_rate)
    return ran


def _config(tmp_path) -> ServeConfig:  # two blocks of one session, on two targets: four runs
    return ServeConfig(rates=[1.0], sessions=2, block_sessions=1, warmup_sessions=0, turns=2, untagged=True,
                       out=tmp_path)


_TARGETS = [serve.Target.single("vanilla", "http://127.0.0.1:9"), serve.Target.single("agentkv", "http://127.0.0.1:9")]


def test_a_run_interrupted_after_its_first_block_leaves_that_block_in_serve_json(monkeypatch, tmp_path):
    ran = _fake_blocks(monkeypatch, interrupt_at=1)
    with pytest.raises(KeyboardInterrupt):
        serve.run_benchmark(_config(tmp_path), targets=_TARGETS, log=lambda _: None)
    assert ran == ["vanilla x0-r0-b0"]
    written = _strict((tmp_path / "serve.json").read_text())
    assert written["complete"] is False and written["comparisons"] == []
    assert [(r["server"], r["turns"], r["ttft_mean_ms"]) for r in written["rows"]] == [("vanilla", 1, 100.0)]
    assert written["config"]["sessions"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["serve.json"]  # no temporary file left behind


def test_a_finished_run_says_it_is_complete_in_serve_json(monkeypatch, tmp_path):
    ran = _fake_blocks(monkeypatch)
    result = serve.run_benchmark(_config(tmp_path), targets=_TARGETS, log=lambda _: None)
    assert len(ran) == 4 and result["complete"] is True
    written = _strict((tmp_path / "serve.json").read_text())
    assert written["complete"] is True and [c["blocks"] for c in written["comparisons"]] == [2]
    assert [(r["server"], r["turns"]) for r in written["rows"]] == [("vanilla", 2), ("agentkv", 2)]


def test_a_finished_command_writes_the_complete_serve_json_once(monkeypatch, tmp_path, capsys):
    import agentkv.__main__ as cli

    _fake_blocks(monkeypatch)
    monkeypatch.setattr(serve_run, "_run_benchmark", lambda config, servers, targets, log: serve_run.asyncio.run(
        serve_run._run_async(config, _TARGETS, log)))
    written, write = [], serve_report.write_json

    def write_json(result, path):  # every writer of serve.json goes through report.write_json
        written.append(result["complete"])
        write(result, path)

    monkeypatch.setattr(serve_run, "write_json", write_json)
    monkeypatch.setattr(serve_report, "write_json", write_json)
    cli.main(["bench", "serve", "--untagged", "--rates", "1", "--sessions", "1", "--warmup-sessions", "0",
              "--out", str(tmp_path)])
    assert written == [False, False, True]  # after each server's block, then the result once
    assert _strict((tmp_path / "serve.json").read_text())["complete"] is True
    assert f"json: {tmp_path / 'serve.json'}, md: {tmp_path / 'serve.md'}" in capsys.readouterr().out


def test_an_interrupted_command_says_where_its_blocks_are(monkeypatch, tmp_path, capsys):
    import agentkv.__main__ as cli

    ran = _fake_blocks(monkeypatch, interrupt_at=0)
    monkeypatch.setattr(serve_run, "_run_benchmark", lambda config, servers, targets, log: serve_run.asyncio.run(
        serve_run._run_async(config, _TARGETS, log)))
    argv = ["bench", "serve", "--untagged", "--rates", "1", "--sessions", "1", "--warmup-sessions", "0",
            "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 130 and ran == []
    assert capsys.readouterr().err == "agentkv bench serve: interrupted; no block was measured\n"
    ran = _fake_blocks(monkeypatch, interrupt_at=1)
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 130 and len(ran) == 1
    assert capsys.readouterr().err.endswith(f"the blocks measured so far are in {tmp_path / 'serve.json'}\n")
    # stopped again before its first block: the partial file is the run before's, not this one's
    os.utime(tmp_path / "serve.json", (0, 0))
    ran = _fake_blocks(monkeypatch, interrupt_at=0)
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 130 and ran == []
    assert capsys.readouterr().err == "agentkv bench serve: interrupted; no block was measured\n"


def test_sessions_longer_than_the_servers_context_are_refused_with_one_line():
    import agentkv.__main__ as cli

    assert ServeConfig().turns == 8 and ServeConfig(turns=9).turns == 9  # the default fits, one more too
    with pytest.raises(SystemExit) as exited:  # vLLM refused every call of a session from about the 9th on
        cli.main(["bench", "serve", "--turns", "10"])
    assert str(exited.value.code) == (
        "agentkv bench serve: --turns 10 with --max-tokens 24 needs about 2150 tokens of context, more than "
        "--max-model-len 2048 (at most --turns 9 fit; or raise --max-model-len, with --blocks to hold it)")
    with pytest.raises(ValueError, match=r"--max-tokens 1400 needs about 2140 tokens .* \(no turn fits;"):
        ServeConfig(turns=1, max_tokens=1400)
    assert ServeConfig(turns=20, max_model_len=4096).max_model_len == 4096  # 201 blocks hold 6,400 tokens
    with pytest.raises(ValueError, match="less than --max-model-len 8192"):
        ServeConfig(turns=20, max_model_len=8192)
    with pytest.raises(ValueError, match="more than the models' 8192 positions"):
        ServeConfig(max_model_len=9000, blocks=301)


def test_the_turns_help_states_the_context_estimate_the_check_uses(monkeypatch):
    import argparse

    from agentkv.bench import serve_args

    monkeypatch.setattr(serve_args, "FIRST_PROMPT_TOKENS", 741)  # the estimate's constants, changed
    monkeypatch.setattr(serve_args, "TURN_TOKENS", 131)
    parser = argparse.ArgumentParser()
    serve_args.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "about 741 + (turns - 1) x (131 + --max-tokens) + --max-tokens tokens" in text


def test_the_context_estimate_covers_a_real_runs_longest_calls():
    recorded = json.loads(Path(REPO_ROOT, "benchmarks/results/serve-warmup-session40.json").read_text())
    config = recorded["config"]
    longest = max(call[4] for row in recorded["rows"] for call in row["calls"])  # prompt tokens
    assert (config["turns"], config["max_tokens"], longest) == (8, 24, 1808)
    assert longest + config["max_tokens"] <= session_tokens(config["turns"], config["max_tokens"]) <= 2048
