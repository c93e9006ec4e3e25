"""The version gate refuses anything it has not verified, loudly."""

import pytest
import vllm
from vllm.v1.core.block_pool import BlockPool

from server_patch._compat import UnsupportedVLLM, check_vllm, gate, is_supported_release


def test_supported_vllm_passes():
    assert check_vllm().startswith(("0.32.", "0.33."))
    assert gate().enabled


def test_unsupported_release_is_refused_with_its_version(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    with pytest.raises(UnsupportedVLLM, match=r"vLLM 0\.34\.1 is not a supported release \(0\.32\.x, 0\.33\.x\)"):
        gate()


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.2", "0.33.1.post1", "0.32.10+cu128"])
def test_final_releases_of_the_supported_lines_pass(version):
    assert is_supported_release(version)


@pytest.mark.parametrize("version", ["0.33.0rc1", "0.32.0.dev12+gabc", "0.32.x", "0.32.garbage", "0.320.0",
                                     "0.34.0", "0.31.9", "00.32.0", ""])
def test_pre_releases_dev_builds_and_other_lines_are_refused(version, monkeypatch):
    assert not is_supported_release(version)
    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(UnsupportedVLLM, match="is not a supported release"):
        gate()


@pytest.mark.parametrize("value", ["on", "true", "yes", "1"])
def test_the_fallback_switch_reads_every_on_word(value, monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    monkeypatch.setenv("AGENTKV_ALLOW_LRU_FALLBACK", value)
    assert not gate().enabled


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
