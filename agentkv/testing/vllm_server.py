"""A real vLLM OpenAI-compatible server on loopback for tests, with the tests' environment.

Usage::

    spec = ServerSpec(model_dir=build_tiny_model(".build/tiny-model"))
    with VLLMServer(spec) as server:
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")

:class:`VLLMServer` is the production :class:`agentkv.launcher.ServerProcess` with
:data:`TEST_ENV` under the spec's own ``env``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from agentkv.launcher import Launchable, ServerProcess, ServerSpec, free_port

__all__ = ["TEST_ENV", "ServerSpec", "VLLMServer", "free_port"]

# No hub access (the tiny model is built locally), a small CPU KV-cache budget, no usage telemetry.
TEST_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


class VLLMServer(ServerProcess):
    """A :class:`ServerProcess` whose child always gets :data:`TEST_ENV` (unless ``base_env`` replaces it)."""

    def __init__(
        self,
        spec: Launchable,
        *,
        port: int | None = None,
        log_path: str | Path | None = None,
        stop_timeout: float = 20.0,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(spec, port=port, log_path=log_path, stop_timeout=stop_timeout,
                         base_env=TEST_ENV if base_env is None else base_env)
