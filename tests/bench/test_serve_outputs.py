"""What ``agentkv bench serve`` leaves in its output folder: strict JSON (no bare NaN)."""

from __future__ import annotations

import json

from agentkv.bench import serve
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
    written = _strict(serve.write_reports(result, tmp_path)["json"].read_text())
    assert written["rows"][0]["ttft_mean_ms"] is None and written["rows"][0]["hit_rate"] is None
    assert written["comparisons"][0]["ttft_mean"] == {"value": None, "low": None, "high": None}
    assert written["rows"][0]["turns"] == 0 and written["config"]["seed"] == 0  # the rest as it was
