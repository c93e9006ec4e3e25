"""The version gate on a real ``agentkv serve`` whose vLLM reports a release agentkv has not verified
(a ``sitecustomize`` sets ``vllm.__version__`` in every process of the server, the engine's too): it
refuses to start and says why; with ``AGENTKV_ALLOW_LRU_FALLBACK=1`` it serves as plain LRU and
says so, in its log and its stats."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from agentkv.protocol import STATS_PATH
from agentkv.testing.servers import tiny_server_spec
from agentkv.testing.vllm_server import VLLMServer

pytestmark = pytest.mark.server

UNVERIFIED = "0.40.0"


def _unverified_vllm(tmp_path: Path, **env: str) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import vllm\nvllm.__version__ = {UNVERIFIED!r}\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p), **env}


def test_agentkv_serve_refuses_an_unverified_vllm_and_says_why(tiny_model_dir, tmp_path):
    server = VLLMServer(tiny_server_spec(tiny_model_dir, agentkv=True, env=_unverified_vllm(tmp_path)),
                        log_path=tmp_path / "refused.log")
    with pytest.raises(RuntimeError):
        server.start(timeout=240)
    assert not server.running
    assert f"vLLM {UNVERIFIED} is not a supported release (0.32.x, 0.33.x)" in server.log_path.read_text()


def test_with_the_opt_in_it_serves_as_plain_lru_and_says_so(tiny_model_dir, tmp_path):
    env = _unverified_vllm(tmp_path, AGENTKV_ALLOW_LRU_FALLBACK="1")
    with VLLMServer(tiny_server_spec(tiny_model_dir, agentkv=True, env=env), log_path=tmp_path / "lru.log") as server:
        answer = httpx.post(server.base_url + "/v1/completions", timeout=60, trust_env=False,
                            headers={"X-AgentKV-Agent": "planner", "X-AgentKV-Session": "s1"},
                            json={"model": "tiny", "prompt": "plan the work " * 40, "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        stats = httpx.get(server.base_url + STATS_PATH, timeout=30, trust_env=False).json()
    assert stats["enabled"] is False
    assert stats["agents"] == {} or "planner" not in stats["agents"]  # nothing learned
    log = server.log_path.read_text()
    assert "running as plain LRU because AGENTKV_ALLOW_LRU_FALLBACK=1" in log
    assert "survival-scored eviction disabled (plain LRU)" in log
