"""``benchmarks/refresh_breakdown.py`` reads the runtime's private state: run it as documented, tiny."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_refresh_breakdown_runs_and_times_every_part():
    done = subprocess.run(
        [sys.executable, "benchmarks/refresh_breakdown.py", "--agents", "4", "--sessions", "10",
         "--steps", "30", "--warmup", "10"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    for part in ("score_reuse, touched sessions only", "queue.set_group_scores", "refresh (all of it)"):
        assert f"| {part} |" in done.stdout, done.stdout
    assert "refresh per engine step" in done.stdout
