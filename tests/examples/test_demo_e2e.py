"""``make demo`` as a user runs it (``python -m agentkv demo``), smaller: it builds the benchmark
model, starts a vanilla vLLM and ``agentkv serve`` itself, runs the LangGraph app on both, prints
the comparison and what the agentkv server learned, and stops both servers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, model_servers

pytestmark = pytest.mark.server


def test_the_demo_runs_end_to_end_and_stops_its_servers(tmp_path):
    run = subprocess.run([sys.executable, "-m", "agentkv", "demo", "--sessions", "3", "--out", str(tmp_path)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, start_new_session=True)
    leftover = model_servers(REPO_ROOT / ".build" / "bench-model")
    for pid in leftover:  # not expected: stop them before failing
        os.killpg(pid, signal.SIGKILL)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for line in ("servers up: vanilla", "hit rate", "mean TTFT", "agentkv server learned: policy"):
        assert line in run.stdout, line
    assert {p.name for p in tmp_path.iterdir()} >= {"serve.json", "serve.md", "serve.png"}  # not the last make demo's
    assert not leftover
