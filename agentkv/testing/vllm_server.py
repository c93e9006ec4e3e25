"""A real vLLM OpenAI-compatible server on loopback for tests, with the tests' environment.

Usage::

    spec = ServerSpec(model_dir=build_tiny_model(".build/tiny-model"))
    with VLLMServer(spec) as server:
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")

:class:`VLLMServer` is the production :class:`agentkv.launcher.ServerProcess` with
:data:`TEST_ENV` under the spec's own ``env``.
"""

from __future__ import annotations

from agentkv.launcher import ServerProcess, ServerSpec, free_port

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
    """A :class:`ServerProcess` whose child gets :data:`TEST_ENV` unless ``base_env`` replaces it."""

    default_env = TEST_ENV
