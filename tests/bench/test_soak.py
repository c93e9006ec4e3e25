"""``agentkv bench soak``: a few seconds of traffic against the shared agentkv server, or one it starts
itself, and the report."""

from __future__ import annotations

import json
import os
import random

import pytest

from agentkv.__main__ import main
from agentkv.bench.soak import SoakConfig, process_rss, run_soak
from agentkv.bench.soak_cases import CASES, STATELESS_CASES, SoakContext
from tests.conftest import TINY_MODEL_DIR, model_servers


def test_every_case_builds_a_request_for_loopback_paths():
    rng = random.Random(0)
    for name, (build, weight, _) in CASES.items():
        request = build(SoakContext("tiny", api_key="k"), rng)
        assert weight > 0 and request.method in ("GET", "POST") and request.path.startswith("/"), name
    assert set(STATELESS_CASES) <= set(CASES)


def test_refuses_anything_but_loopback_and_unknown_cases():
    with pytest.raises(SystemExit, match="only sends to loopback"):
        run_soak(SoakConfig(minutes=0.01), "http://192.0.2.1:8000", None)
    with pytest.raises(ValueError, match="unknown soak cases"):
        run_soak(SoakConfig(minutes=0.01, cases=["nope"]), "http://127.0.0.1:9", None)


def test_cases_that_all_need_a_key_are_refused_without_one_before_anything_starts(capsys):
    with pytest.raises(SystemExit, match="every case of unauthenticated needs --api-key"):
        main(["bench", "soak", "--cases", "unauthenticated", "--minutes", "0.01"])  # no --url: none started


def test_process_rss_reads_proc():
    rss = process_rss(os.getpid())
    assert rss["api_server"] > 0


@pytest.mark.server
def test_soak_command_against_a_real_server(agentkv_server, tmp_path, capsys):
    main(["bench", "soak", "--url", agentkv_server.base_url, "--pid", str(agentkv_server.pid), "--minutes", "0.1",
          "--concurrency", "2", "--cases", ",".join(STATELESS_CASES), "--rss-interval", "2", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "soak.json").read_text())
    printed = capsys.readouterr().out
    assert set(report) == {"url", "seconds", "requests", "statuses", "server_errors", "lost", "lost_by_error",
                           "by_case", "rss", "config"}
    assert 6 <= report["seconds"] < 6 + 70  # the time bound, plus at most one request timeout
    assert report["requests"] > 0
    assert report["requests"] == sum(report["statuses"].values()) + report["lost"]
    assert report["server_errors"] == sum(n for code, n in report["statuses"].items() if int(code) >= 500)
    assert set(report["by_case"]) <= set(STATELESS_CASES)
    assert sum(sum(c.values()) for c in report["by_case"].values()) == report["requests"]
    assert report["by_case"]["valid_untagged"].get("200", 0) > 0
    assert len(report["rss"]) >= 3  # at start, every 2 s, at the end
    for sample in report["rss"]:
        assert sample["processes"]["api_server"] > 0 and len(sample["processes"]) >= 2  # + the EngineCore
        assert sample["total_mb"] == pytest.approx(sum(sample["processes"].values()), abs=0.2)
    assert printed.startswith(f"soak: {report['requests']} requests") and "RSS (MB)" in printed


@pytest.mark.server
def test_soak_with_an_api_key_starts_its_own_keyed_server_and_stops_it(tmp_path, capsys):
    before = model_servers(TINY_MODEL_DIR)
    main(["bench", "soak", "--minutes", "0.1", "--api-key", "soak-key", "--concurrency", "2",
          "--cases", "valid_untagged,control_reads,unauthenticated", "--rss-interval", "2", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["config"]["api_key"] is True and "soak-key" not in json.dumps(report)
    by_case = report["by_case"]
    assert set(by_case["unauthenticated"]) == {"401"}  # no key or a wrong one: refused, every call
    assert by_case["valid_untagged"].get("200", 0) > 0 and by_case["control_reads"].get("200", 0) > 0  # keyed
    assert report["server_errors"] == 0 and report["lost"] == 0
    assert (tmp_path / "agentkv-server.log").stat().st_size > 0  # the started server's log
    assert model_servers(TINY_MODEL_DIR) <= before  # its own server is gone
    assert capsys.readouterr().out.startswith(f"soak: {report['requests']} requests")
