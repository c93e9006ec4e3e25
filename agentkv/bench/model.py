"""The benchmark model: a random-weight Llama whose prefill costs what serving prefill costs.

The tiny test model (:mod:`agentkv.testing.tiny_model`) is so small that a call's prefill is a
few milliseconds against tens of milliseconds of decoding and per-request overhead, so a prefix
hit cannot show in latency. On a GPU, prefill of a 1.5K-token prompt on an 8B model costs 10-30
decode steps and several times the per-request floor; :func:`bench_shape` picks the shape that
gives this profile on the CPU at hand (one core per server, vLLM CPU in bfloat16; measured:
docs/benchmarks.md, "The benchmark model"). Same tokenizer and chat template as the tiny model,
built locally in well under a minute.

``python -m agentkv.bench.model DIR [--measure]`` builds it and, with ``--measure``, starts a
vanilla vLLM on one core and prints :class:`CostProfile`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from agentkv.testing.tiny_model import ModelShape, build_llama

__all__ = ["FALLBACK_BF16_SHAPE", "NATIVE_BF16_SHAPE", "CostProfile", "bench_shape", "build_bench_model", "main",
           "measure_cost", "native_bf16"]

# Where the CPU multiplies bfloat16 natively (AVX-512 BF16), vLLM CPU runs the linears in oneDNN:
# 768 x 6 layers (head_dim 64; 63 M parameters) costs 260-790 ms per 1K prompt tokens, 12-14 ms
# per decode step and a 32-57 ms per-request floor on one idle core (two CPUs of this kind), so a
# 1.5K-token prefill is ~30-90 decode steps and ~10-20x the floor, the shape of an 8B model on a
# GPU, and the demo's traffic keeps a core about as busy as on the CPUs without it. (512 x 4 had
# the shape too, but a call cost a core ~0.3 s on the slower of the two: a core idle 3/4 of the
# time, unlike a served GPU.)
NATIVE_BF16_SHAPE = ModelShape(hidden_size=768, num_layers=6, num_heads=12, intermediate_size=3072)
# Without it vLLM falls back to torch's bfloat16 matmul, which is slow per token (hidden 512 x 6
# layers: 7.5 s per 1K prompt tokens on a loaded core): 256 x 2 layers (4.2 M parameters) keeps a
# benchmark within minutes there and still costs ~235 decode steps per 1.5K-token prefill.
FALLBACK_BF16_SHAPE = ModelShape(hidden_size=256, num_layers=2, num_heads=4, intermediate_size=1024)


def native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True when the CPU flags name a native bfloat16 matmul (``avx512_bf16`` or ``amx_bf16``)."""
    try:
        flags = set(Path(cpuinfo).read_text(encoding="utf-8", errors="replace").split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def bench_shape() -> ModelShape:
    """The benchmark model's shape on this machine (see ``NATIVE_BF16_SHAPE``, ``FALLBACK_BF16_SHAPE``)."""
    return NATIVE_BF16_SHAPE if native_bf16() else FALLBACK_BF16_SHAPE


def build_bench_model(directory: str | Path, *, seed: int = 0) -> Path:
    """Build (once) the benchmark model for this machine plus tokenizer in ``directory``; return its path."""
    return build_llama(directory, bench_shape(), seed=seed)


@dataclass(frozen=True)
class CostProfile:
    """Medians over the measured calls, milliseconds. ``prefill_ms_per_1k`` excludes the
    per-request overhead (a fully cached repeat of the same prompt is subtracted)."""

    prompt_tokens: int
    cold_ms: float  # a request with no cached prefix, max_tokens 1
    cached_ms: float  # the same prompt again: everything but its last block cached
    decode_ms_per_token: float

    @property
    def prefill_ms_per_1k(self) -> float:
        return (self.cold_ms - self.cached_ms) * 1000 / self.prompt_tokens

    def prefill_in_decode_steps(self, tokens: int = 1536) -> float:
        """How many decode steps the prefill of ``tokens`` prompt tokens costs."""
        return self.prefill_ms_per_1k * tokens / 1000 / self.decode_ms_per_token

    def describe(self) -> str:
        return (f"prefill {self.prefill_ms_per_1k:.0f} ms per 1K tokens (cold {self.cold_ms:.0f} ms, cached "
                f"{self.cached_ms:.0f} ms for {self.prompt_tokens} tokens), decode {self.decode_ms_per_token:.1f} ms"
                f" per token: prefill of 1.5K tokens = {self.prefill_in_decode_steps():.0f} decode steps")


def measure_cost(base_url: str, model: str, *, prompt_tokens: int = 1536, decode_tokens: int = 64,
                 calls: int = 7, vocab_size: int = 4096, seed: int = 0) -> CostProfile:
    """Measure prefill and decode cost on an idle server (``/v1/completions`` with token ids)."""
    rng = random.Random(seed)
    cold, cached, decode = [], [], []
    with httpx.Client(base_url=base_url, timeout=120, trust_env=False) as client:

        def complete(prompt: list[int], max_tokens: int) -> tuple[float, float, float]:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0.0, "stream": True}
            t0 = time.perf_counter()
            first = last = 0.0
            with client.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        last = time.perf_counter()
                        first = first or last
            return t0, first, last

        complete([rng.randrange(16, vocab_size) for _ in range(prompt_tokens)], 1)  # first-call warm-up
        for _ in range(calls):
            prompt = [rng.randrange(16, vocab_size) for _ in range(prompt_tokens)]
            t0, first, _ = complete(prompt, 1)
            cold.append(first - t0)
            t0, first, _ = complete(prompt, 1)
            cached.append(first - t0)
            _, first, last = complete([rng.randrange(16, vocab_size) for _ in range(32)], decode_tokens + 1)
            decode.append((last - first) / decode_tokens)
    return CostProfile(prompt_tokens, statistics.median(cold) * 1000, statistics.median(cached) * 1000,
                       statistics.median(decode) * 1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentkv.bench.model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--measure", action="store_true", help="serve it on one core and measure its cost")
    parser.add_argument("--core", type=int, default=0, help="the core the measuring server runs on")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    model_dir = build_bench_model(args.directory)
    shape = bench_shape()
    native = "native" if shape is NATIVE_BF16_SHAPE else "no native"
    print(f"{model_dir}: hidden {shape.hidden_size} x {shape.num_layers} layers ({native} bfloat16 on this CPU; "
          f"{time.monotonic() - t0:.0f} s)")
    if args.measure:
        from agentkv.bench._defaults import SERVER_ENV
        from agentkv.launcher import ServerProcess, ServerSpec

        spec = ServerSpec(model_dir=model_dir, served_model_name="bench", num_gpu_blocks=201,
                          env={"VLLM_CPU_OMP_THREADS_BIND": str(args.core)})
        with ServerProcess(spec, base_env=SERVER_ENV, isolated=True) as server:
            print(measure_cost(server.base_url, "bench").describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
