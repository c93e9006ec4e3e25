"""examples/autogen_selector.py: one session on a real agentkv server, every call tagged."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentkv.testing.server_stats import StatsSnapshot
from tests.conftest import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "autogen_selector.py"
PARTICIPANTS = ("planner", "coder", "reviewer", "writer")


def test_handoff_table_is_a_distribution_over_other_participants():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import autogen_selector as example
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    assert set(example.HANDOFFS) == set(example.AGENTS) == set(PARTICIPANTS)
    for speaker, row in example.HANDOFFS.items():
        assert speaker not in row and set(row) <= set(PARTICIPANTS)
        assert sum(row.values()) == pytest.approx(1.0)


@pytest.mark.server
def test_one_session_on_agentkv(agentkv_server):
    snapshot = StatsSnapshot.take(agentkv_server.base_url)  # the shared server: deltas from here
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--base-url", agentkv_server.base_url + "/v1", "--sessions", "1",
         "--turns", "4"],
        capture_output=True, text=True, timeout=300,
    )
    print(run.stdout[-3000:], run.stderr[-3000:])
    assert run.returncode == 0
    assert "session 0 " in run.stdout and "selector: 3 model calls" in run.stdout

    after = snapshot.now()
    assert snapshot.agent_delta("planner", now=after) > 0  # the first speaker
    assert snapshot.agent_delta("selector", now=after) > 0  # the selector's own calls, tagged
    assert snapshot.delta("dispatches", now=after) >= 4  # 4 speaker turns (+ the selector's tagged calls)
    assert snapshot.delta("sessions", "ended", now=after) == 1
