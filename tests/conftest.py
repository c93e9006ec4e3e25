"""Shared pytest configuration for agentkv.

Markers:
    server: starts a real vLLM server (slow, ~30-60 s start-up on CPU).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # also works when run as `pytest` rather than `python -m pytest`
    sys.path.insert(0, str(REPO_ROOT))

from agentkv.testing.vllm_server import ServerSpec, VLLMServer  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "server: starts a real vLLM server on 127.0.0.1 (slow)")


# ---------------------------------------------------------------------------------------
# Shared fixtures
# ---------------------------------------------------------------------------------------

TINY_MODEL_DIR = REPO_ROOT / ".build" / "tiny-model"  # gitignored, reused across runs


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Random-weight tiny Llama + tokenizer, built once (no download)."""
    from agentkv.testing.tiny_model import build_tiny_model

    return build_tiny_model(TINY_MODEL_DIR)


# Both servers get the same pool: 80 usable blocks of 32 tokens (block 0 is vLLM's null block).
SERVER_BLOCKS = 81


def _server(spec: ServerSpec, tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[VLLMServer]:
    log_path = tmp_path_factory.mktemp(name) / "vllm.log"
    with VLLMServer(spec, log_path=log_path) as server:
        yield server


@pytest.fixture(scope="session")
def vanilla_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A stock vLLM server (block size 32, 80 usable blocks, max_model_len 2048) for the session."""
    spec = ServerSpec(model_dir=tiny_model_dir, block_size=32, num_gpu_blocks=SERVER_BLOCKS, max_model_len=2048)
    yield from _server(spec, tmp_path_factory, "vanilla-server")


def agentkv_server_process(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, name: str
) -> Iterator[VLLMServer]:
    """An ``agentkv serve`` (scheduler + middleware extension) with the vanilla server's pool; a module
    whose assertions depend on everything a server saw since it started yields its own from this."""
    spec = ServerSpec(model_dir=model_dir, block_size=32, num_gpu_blocks=SERVER_BLOCKS, max_model_len=2048,
                      module="agentkv.serve")
    yield from _server(spec, tmp_path_factory, name)


@pytest.fixture(scope="session")
def agentkv_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The same server started through ``agentkv serve``, shared by the session."""
    yield from agentkv_server_process(tiny_model_dir, tmp_path_factory, "agentkv-server")
