"""The benchmark model's shape, build marker and cost arithmetic (no server, no build)."""

from __future__ import annotations

import json

import pytest

from agentkv.bench.model import FALLBACK_BF16_SHAPE, NATIVE_BF16_SHAPE, CostProfile, bench_shape, native_bf16
from agentkv.testing.tiny_model import MARKER_NAME, TINY_SHAPE, ModelShape, _marker, is_complete


def test_shapes_have_a_head_dim_the_cpu_attention_supports():
    assert NATIVE_BF16_SHAPE.hidden_size // NATIVE_BF16_SHAPE.num_heads == 64
    assert FALLBACK_BF16_SHAPE.hidden_size // FALLBACK_BF16_SHAPE.num_heads == 64
    assert TINY_SHAPE.hidden_size // TINY_SHAPE.num_heads == 32
    with pytest.raises(ValueError, match="head_dim 256/5"):
        ModelShape(hidden_size=256, num_layers=1, num_heads=5, intermediate_size=64)
    with pytest.raises(ValueError, match="head_dim 96/6"):
        ModelShape(hidden_size=96, num_layers=1, num_heads=6, intermediate_size=64)  # 16: not supported


def test_a_build_counts_as_complete_only_for_its_own_shape(tmp_path):
    (tmp_path / MARKER_NAME).write_text(json.dumps(_marker(0, 4096, NATIVE_BF16_SHAPE)))
    assert is_complete(tmp_path, shape=NATIVE_BF16_SHAPE)
    assert not is_complete(tmp_path)  # the tiny shape
    assert not is_complete(tmp_path, shape=FALLBACK_BF16_SHAPE)  # a build for another CPU is rebuilt
    assert not is_complete(tmp_path, shape=NATIVE_BF16_SHAPE, seed=1)


def test_the_shape_follows_the_cpus_bfloat16_support(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n")
    assert not native_bf16(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_fp16\n")
    assert native_bf16(cpuinfo)
    cpuinfo.write_text("flags\t\t: fpu amx_bf16 amx_tile\n")
    assert native_bf16(cpuinfo)
    assert not native_bf16(tmp_path / "absent")
    assert bench_shape() == (NATIVE_BF16_SHAPE if native_bf16() else FALLBACK_BF16_SHAPE)


def test_cost_profile_arithmetic():
    cost = CostProfile(prompt_tokens=1536, cold_ms=330.0, cached_ms=30.0, decode_ms_per_token=10.0)
    assert cost.prefill_ms_per_1k == pytest.approx(300 * 1000 / 1536)
    assert cost.prefill_in_decode_steps() == pytest.approx(30.0)
    assert cost.describe().endswith("prefill of 1.5K tokens = 30 decode steps")
