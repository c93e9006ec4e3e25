"""``agentkv bench serve --untagged``: the app runs uninstrumented (no tags, no X-Session-ID, no
events), agentkv recognizes its agents and sessions, and the report carries the confusion table
of true against recognized agents."""

from __future__ import annotations

import httpx
import pytest

from agentkv.bench import serve
from agentkv.bench.serve_args import ServeConfig
from agentkv.protocol import STATS_PATH

pytestmark = pytest.mark.server


def test_an_untagged_run_is_recognized_and_reported_as_a_confusion_table(own_agentkv_server, tmp_path):
    # its own server: no other test's sessions in the stats
    config = ServeConfig(rates=[4.0], sessions=2, warmup_sessions=0, turns=3, tool_gap=0.05, concurrency=2,
                         untagged=True, out=tmp_path)
    result = serve.run_benchmark(config, servers={"agentkv": own_agentkv_server})
    rows = {row["server"]: row for row in result["rows"]}
    assert set(rows) == {"agentkv"} and (rows["agentkv"]["turns"], rows["agentkv"]["errors"]) == (6, 0)
    confusion = rows["agentkv"]["confusion"]
    assert sum(n for recognized in confusion.values() for n in recognized.values()) == 6  # every call counted
    assert "?" not in {f for recognized in confusion.values() for f in recognized}  # and matched to a recognition
    assert serve.confusion_markdown(rows["agentkv"]).startswith("agentkv at 4 sessions/s: true agent (rows)")
    stats = httpx.get(own_agentkv_server.base_url + STATS_PATH, timeout=30, trust_env=False).json()
    recognition = stats["recognition"]
    assert recognition["recognized_requests"] + recognition["unrecognized_requests"] >= 6
    assert stats["sessions"]["ended"] == 0  # no events were posted
