"""The documented by-hand start (docs/server.md, "By hand"): vLLM's own OpenAI server with the
scheduler and the middleware on its command line and no ``AGENTKV_CONTROL``, so that both sides
derive the control socket from the API server's pid; its settings exported as words, as
``agentkv serve --help`` spells them (``on``), or empty (unset)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentkv.protocol import STATS_PATH, AgentTag
from agentkv.testing.vllm_server import ServerSpec, VLLMServer
from server_patch import MIDDLEWARE, SCHEDULER

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("AGENTKV_CONTROL", raising=False)
        spec = ServerSpec(model_dir=tiny_model_dir, num_gpu_blocks=81,
                          extra_args=["--scheduler-cls", SCHEDULER, "--middleware", MIDDLEWARE],
                          env={"AGENTKV_STRICT": "on", "AGENTKV_ENABLED": "true", "AGENTKV_DECAY": ""})
        with VLLMServer(spec, log_path=tmp_path_factory.mktemp("by-hand") / "vllm.log") as running:
            yield running


def test_without_agentkv_control_both_sides_find_each_other(server: VLLMServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
        for number, agent in enumerate(("planner", "coder")):
            tag = AgentTag(agent, "s", "" if number == 0 else "planner")
            body = {"model": "tiny", "prompt": [11, 12, 13, 14], "max_tokens": 1}
            assert client.post("/v1/completions", json=body, headers=tag.to_headers()).status_code == 200
        stats = client.get(STATS_PATH)
    assert stats.status_code == 200, stats.text  # the middleware reached the engine's control socket
    learned = stats.json()
    after_planner = learned["transitions"]["planner"]
    assert learned["dispatches"] == 2 and max(after_planner, key=after_planner.get) == "coder"


def test_a_switch_exported_as_a_word_is_read_as_agentkv_serve_reads_it(server: VLLMServer) -> None:
    """``AGENTKV_STRICT=on`` (read as off before: only ``1`` was on) answers a malformed tag 400."""
    with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
        body = {"model": "tiny", "prompt": [11, 12, 13, 14], "max_tokens": 1}
        response = client.post("/v1/completions", json=body, headers={"X-AgentKV-Agent": "bad agent"})
    # (no stats read here: a stats document is reused for up to a second, which the other test reads)
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("X-AgentKV-Agent")
