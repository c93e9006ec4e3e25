"""The version gate refuses anything it has not verified, loudly."""

import pytest
import vllm
from vllm.v1.core.block_pool import BlockPool

from server_patch._compat import UnsupportedVLLM, check_vllm, gate


def test_supported_vllm_passes():
    assert check_vllm().startswith(("0.32.", "0.33."))
    assert gate().enabled


def test_unsupported_release_is_refused_with_its_version(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    with pytest.raises(UnsupportedVLLM, match=r"vLLM 0\.34\.1 is not a supported release \(0\.32\.x, 0\.33\.x\)"):
        gate()


def test_missing_seam_is_named(monkeypatch):
    monkeypatch.delattr(BlockPool, "cache_full_blocks")
    with pytest.raises(UnsupportedVLLM, match=r"BlockPool\.cache_full_blocks is missing"):
        check_vllm()


def test_opt_in_fallback_runs_as_plain_lru(monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    monkeypatch.setenv("AGENTKV_ALLOW_LRU_FALLBACK", "1")
    result = gate()
    assert not result.enabled and "0.40.0" in result.reason
    assert "running as plain LRU" in caplog.text
