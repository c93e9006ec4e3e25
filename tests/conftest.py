"""Shared pytest configuration for agentkv.

Markers:
    server: starts a real vLLM server (slow, ~30-60 s start-up on CPU).

Tests run in random order (pytest-randomly; the seed is printed at the start and the end of a
run). Two servers are shared by the whole session; a test on them asserts on what changed since
it started (``agentkv.testing.server_stats.StatsSnapshot``). A module whose assertions depend on
everything its server saw uses ``own_agentkv_server``, a server of the module's own.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # also works when run as `pytest` rather than `python -m pytest`
    sys.path.insert(0, str(REPO_ROOT))

from agentkv.testing.servers import running_server, tiny_server_spec  # noqa: E402
from agentkv.testing.vllm_server import VLLMServer  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "server: starts a real vLLM server on 127.0.0.1 (slow)")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    """Repeat the order's seed at the end, where a failure is read (``-q`` hides the header)."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int) and config.pluginmanager.has_plugin("randomly"):
        terminalreporter.write_line(f"test order: reproduce with -p randomly --randomly-seed={seed}")


# ---------------------------------------------------------------------------------------
# Shared fixtures
# ---------------------------------------------------------------------------------------

TINY_MODEL_DIR = REPO_ROOT / ".build" / "tiny-model"  # gitignored, reused across runs


def model_servers(model_dir: Path) -> set[int]:
    """Pids of this machine's processes started with ``--model model_dir``: a vLLM or ``agentkv
    serve`` server on that model, whichever module it runs (to check that a command stopped its own)."""
    import psutil

    pids = set()
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if any(a == "--model" and b == str(model_dir) for a, b in itertools.pairwise(command)):
            pids.add(process.pid)
    return pids


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Random-weight tiny Llama + tokenizer, built once (no download)."""
    from agentkv.testing.tiny_model import build_tiny_model

    return build_tiny_model(TINY_MODEL_DIR)


@pytest.fixture(scope="session")
def vanilla_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A stock vLLM server (block size 32, 80 usable blocks, max_model_len 2048) for the session."""
    yield from running_server(tiny_server_spec(tiny_model_dir, agentkv=False), tmp_path_factory.mktemp("vanilla"))


@pytest.fixture(scope="session")
def agentkv_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The same server started through ``agentkv serve``, shared by the session; it writes a request
    trace (``AGENTKV_TRACE``, its path in the stats document)."""
    log_dir = tmp_path_factory.mktemp("agentkv")
    spec = tiny_server_spec(tiny_model_dir, agentkv=True, env={"AGENTKV_TRACE": str(log_dir / "trace.jsonl")})
    yield from running_server(spec, log_dir)


@pytest.fixture(scope="module")
def own_agentkv_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[VLLMServer]:
    """An ``agentkv serve`` like the shared one, of the requesting module's own (~40 s to start): for
    assertions on what the server learned and counted since it started."""
    log_dir = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    yield from running_server(tiny_server_spec(tiny_model_dir, agentkv=True), log_dir)
