"""The test suite's two kinds of tiny-model servers: vanilla vLLM and ``agentkv serve``.

Both get the same pool (80 usable blocks of 32 tokens; block 0 is vLLM's null block) and
``max_model_len`` 2048, so a test can replay one request stream against both and compare.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from agentkv.testing.vllm_server import ServerSpec, VLLMServer

__all__ = ["BLOCK_SIZE", "SERVER_BLOCKS", "running_server", "tiny_server_spec"]

BLOCK_SIZE = 32
SERVER_BLOCKS = 81


def tiny_server_spec(model_dir: Path, *, agentkv: bool, env: dict[str, str] | None = None,
                     extra_args: list[str] | None = None) -> ServerSpec:
    """The suite's server spec; ``agentkv`` starts it through ``agentkv serve`` (scheduler + middleware)."""
    spec = ServerSpec(model_dir=model_dir, block_size=BLOCK_SIZE, num_gpu_blocks=SERVER_BLOCKS, max_model_len=2048,
                      env=dict(env or {}), extra_args=list(extra_args or []))
    if agentkv:
        spec.module = "agentkv.serve"
    return spec


def running_server(spec: ServerSpec, log_dir: Path) -> Iterator[VLLMServer]:
    """A started server for a pytest fixture to ``yield from``; stopped when the fixture ends."""
    with VLLMServer(spec, log_path=log_dir / "vllm.log") as server:
        yield server
