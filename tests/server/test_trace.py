"""``AGENTKV_TRACE``: a real server writes what it admitted, and ``agentkv bench bound`` replays it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest

from agentkv.bench.bound import bound, read_trace
from agentkv.protocol import STATS_PATH, AgentTag
from agentkv.testing.servers import BLOCK_SIZE
from server_patch._trace import RequestTrace

pytestmark = pytest.mark.server


def test_the_trace_holds_each_admitted_request_as_the_server_saw_it(agentkv_server, tmp_path):
    rng = random.Random("trace")
    prompt = [rng.randrange(10, 4000) for _ in range(3 * BLOCK_SIZE + 5)]
    responses = []
    with httpx.Client(base_url=agentkv_server.base_url, timeout=120, trust_env=False) as client:
        path = client.get(STATS_PATH).json()["trace"]["path"]
        for session in ("trace-a", "trace-b"):
            response = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                                   headers=AgentTag("tracer", session, "", 0).to_headers())
            response.raise_for_status()
            responses.append(response.json())
    lines = [json.loads(line) for line in open(path, encoding="utf-8")]
    # the engine runs a request under its response id plus a suffix
    mine = [next(line for line in lines if line["id"].startswith(r["id"])) for r in responses]
    for line, response, session in zip(mine, responses, ("trace-a", "trace-b"), strict=True):
        assert (line["agent"], line["session"], line["warmup"]) == ("tracer", session, False)
        assert line["tokens"] == len(prompt) and len(line["blocks"]) == 3 and line["block_size"] == BLOCK_SIZE
        assert line["hit"] == (response["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0)
    assert mine[1]["blocks"] == mine[0]["blocks"] and mine[1]["hit"] == 3 * BLOCK_SIZE
    own = tmp_path / "mine.jsonl"
    own.write_text("".join(json.dumps(line) + "\n" for line in mine))
    result = bound(read_trace(own))
    assert result.capacity == mine[0]["pool_blocks"]
    assert result.measured == result.lru == result.belady == pytest.approx(3 * BLOCK_SIZE / (2 * len(prompt)))


def test_a_trace_that_cannot_be_written_stops_and_says_why(tmp_path):
    trace = RequestTrace(str(tmp_path / "missing" / "trace.jsonl"))
    trace.admitted("r0", None, 40, 0, [b"\x01" * 32], 16, 100)
    assert trace.written == 0 and trace.error is not None and "No such file" in trace.error


def test_a_trace_stops_growing_at_its_limit(tmp_path):
    trace = RequestTrace(str(tmp_path / "trace.jsonl"), limit=400)
    for index in range(10):
        trace.admitted(f"r{index}", AgentTag("a", "s", "", 0), 40, 0, [b"\x01" * 32, b"\x02" * 32], 16, 100)
    size = (tmp_path / "trace.jsonl").stat().st_size
    assert size <= 400 and trace.written == len(open(tmp_path / "trace.jsonl").readlines()) >= 1
    assert trace.written + trace.dropped == 10 and trace.dropped > 0


def test_the_limit_is_the_files_whoever_wrote_it(tmp_path):
    # a restart on the same path, and the engines of a data-parallel server sharing it
    traces = [RequestTrace(str(tmp_path / "trace.jsonl"), limit=400) for _ in range(3)]
    for index in range(10):
        for trace in traces:
            trace.admitted(f"r{index}", AgentTag("a", "s", "", 0), 40, 0, [b"\x01" * 32, b"\x02" * 32], 16, 100)
    assert (tmp_path / "trace.jsonl").stat().st_size <= 400


def test_the_benchmark_traces_its_agentkv_server_and_reports_the_bound(agentkv_server, tmp_path):
    from agentkv.bench.serve import ServeConfig, bound_lines, server_specs
    from agentkv.bench.serve.run import _bound

    specs = server_specs(ServeConfig(out=tmp_path), tmp_path, trace=tmp_path / "t.jsonl")
    assert specs["agentkv"].env["AGENTKV_TRACE"] == str(tmp_path / "t.jsonl")
    assert "AGENTKV_TRACE" not in specs["vanilla"].env
    with httpx.Client(base_url=agentkv_server.base_url, timeout=120, trust_env=False) as client:
        path = client.get(STATS_PATH).json()["trace"]["path"]
        client.post("/v1/completions", json={"model": "tiny", "prompt": list(range(10, 80)), "max_tokens": 1},
                    headers=AgentTag("tracer", "trace-c", "", 0).to_headers()).raise_for_status()
    figures = _bound(Path(path), print)  # this request and whatever the session's tests sent before
    assert figures is not None and figures["lru"] <= figures["belady"] and figures["trace"] == path
    (line,) = bound_lines({"bound": figures})
    assert f"agentkv bench bound {path}" in line and "under Belady" in line
    assert _bound(tmp_path / "none.jsonl", lambda message: None) is None
