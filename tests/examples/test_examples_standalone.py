"""The examples as their docstrings say to run them: without ``--base-url`` each builds the tiny
model, starts ``agentkv serve`` (the LangGraph one with the xlam tool parser, ``--tool-choice auto``
and ``--routing model``, its defaults), runs against it, prints what the server learned and stops it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, TINY_MODEL_DIR, model_servers

pytestmark = pytest.mark.server


@pytest.mark.parametrize(("script", "args", "learned"), [
    ("langgraph_supervisor.py", ["--sessions", "1", "--turns", "3", "--tool-gap", "0"], "server: policy"),
    ("autogen_selector.py", ["--sessions", "1"], "| selector |"),
])
def test_an_example_without_base_url_serves_itself_and_stops(script, args, learned):
    before = model_servers(TINY_MODEL_DIR)
    run = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / script), *args], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "agentkv server at" in run.stdout and learned in run.stdout
    assert model_servers(TINY_MODEL_DIR) <= before  # its own server is gone
