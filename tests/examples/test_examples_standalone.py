"""The examples as their docstrings say to run them: without ``--base-url`` each builds the tiny
model, starts ``agentkv serve`` (the LangGraph one with the xlam tool parser, ``--tool-choice auto``
and ``--routing model``, its defaults), runs against it, prints what the server learned and stops it."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from agentkv.launcher import free_port
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


@pytest.mark.parametrize("script", ["langgraph_supervisor.py", "autogen_selector.py"])
def test_an_example_killed_while_it_runs_stops_its_server(script):
    """SIGTERM (a killed job) or SIGHUP (a closed terminal): the server it started goes too (it runs
    in a session of its own, which the signal's default action left running)."""
    before = model_servers(TINY_MODEL_DIR)
    example = subprocess.Popen([sys.executable, str(REPO_ROOT / "examples" / script), "--sessions", "50"],
                               cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in example.stdout:  # type: ignore[union-attr]
            if "agentkv server at" in line:  # its server is up and serving
                break
        example.send_signal(signal.SIGTERM)
        assert example.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        example.kill()
    assert model_servers(TINY_MODEL_DIR) <= before


@pytest.mark.parametrize(("args", "code", "says"), [
    (["--concurrency", "0"], 2, "must be an integer >= 1"),
    (["--base-url", "127.0.0.1:8000/v1"], 2, "needs its scheme"),
    (["--base-url", f"http://127.0.0.1:{free_port()}/v1", "--sessions", "1"], 1, "cannot reach"),
])
def test_an_examples_bad_arguments_get_a_one_line_answer(args, code, says):
    run = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "langgraph_supervisor.py"), *args],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == code and says in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
