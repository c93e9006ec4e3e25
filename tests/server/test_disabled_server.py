"""A real ``agentkv serve --agentkv-enabled off`` (the flag sets ``AGENTKV_ENABLED=0``): exact LRU, and
the eviction counters of ``/agentkv/v1/stats`` and ``/metrics`` equal the blocks LRU actually evicted.

The pool has 80 usable blocks of 32 tokens and starts empty. Every prompt is distinct and holds 20
full blocks + 1 token, so a request takes 21 blocks and leaves 20 cached plus 1 hash-less block
(recycled first). LRU arithmetic: requests 1-3 evict nothing, request 4 evicts 1 cached block, and
every later one 20.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentkv.protocol import STATS_MAX_AGE, STATS_PATH, AgentTag
from agentkv.testing.server_stats import cached_tokens
from agentkv.testing.vllm_server import ServerSpec, VLLMServer

pytestmark = pytest.mark.server

BLOCK = 32
FULL_BLOCKS = 20


@pytest.fixture(scope="module")
def disabled_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    spec = ServerSpec(model_dir=tiny_model_dir, block_size=BLOCK, num_gpu_blocks=81, max_model_len=2048,
                      module="agentkv.serve", extra_args=["--agentkv-enabled", "off"])
    with VLLMServer(spec, log_path=tmp_path_factory.mktemp("disabled-server") / "vllm.log") as server:
        yield server


def _prompt(index: int) -> list[int]:
    rng = random.Random(f"disabled-{index}")
    return [100 + index] + [rng.randrange(10, 4000) for _ in range(FULL_BLOCKS * BLOCK)]


def _cached_tokens(client: httpx.Client, index: int) -> int:
    tag = AgentTag("solo", f"s{index}", "", 0)
    return cached_tokens(client, _prompt(index), tag.to_headers())


def _counted(client: httpx.Client) -> tuple[int, float]:
    """(evictions in stats, agentkv_evictions_total summed over classes in /metrics)."""
    time.sleep(STATS_MAX_AGE)  # both serve one document again for up to STATS_MAX_AGE
    stats = client.get(STATS_PATH).json()
    assert stats["policy"] == "lru"
    metrics = sum(float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
                  if line.startswith("agentkv_evictions_total{"))
    return sum(stats["evictions"].values()), metrics


def expected_evictions(requests: int) -> int:
    return 0 if requests <= 3 else 1 + FULL_BLOCKS * (requests - 4)


def test_disabled_server_counts_the_blocks_lru_evicts(disabled_server):
    with httpx.Client(base_url=disabled_server.base_url, timeout=120, trust_env=False) as client:
        assert _cached_tokens(client, 0) == 0
        assert _counted(client) == (0, 0.0)
        for index in range(1, 6):  # requests 2..6
            assert _cached_tokens(client, index) == 0
        assert _counted(client) == (expected_evictions(6), expected_evictions(6)) == (41, 41.0)
        assert _cached_tokens(client, 0) == 0  # the first prompt was evicted: a full miss
        assert _counted(client) == (expected_evictions(7), expected_evictions(7))
        assert _cached_tokens(client, 0) == FULL_BLOCKS * BLOCK  # now it is the most recent: a full hit
        assert _counted(client) == (expected_evictions(7), expected_evictions(7))
