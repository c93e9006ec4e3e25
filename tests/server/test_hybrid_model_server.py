"""A hybrid model on real servers: a Llama whose second layer attends through a sliding window,
so vLLM keeps two KV-cache groups (full attention and the window) in one block pool."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentkv.testing.server_stats import StatsSnapshot, cached_tokens
from agentkv.testing.servers import running_server, tiny_server_spec
from agentkv.testing.vllm_server import VLLMServer

pytestmark = pytest.mark.server

BLOCK = 32
ANCHOR_BLOCKS = 8
AGENTS = ("planner", "researcher", "coder", "reviewer", "tester", "writer")
# Two groups of blocks per token; the six anchors take ~60 blocks, each session's latest history
# up to 16 more: four sessions do not fit beside the anchors.
POOL_BLOCKS = 141


@pytest.fixture(scope="module")
def hybrid_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hybrid") / "model"
    shutil.copytree(tiny_model_dir, directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.update(layer_types=["full_attention", "sliding_attention"], sliding_window=2 * BLOCK)
    config_path.write_text(json.dumps(config))
    return directory


def _server(model: Path, log_dir: Path, *, agentkv: bool) -> Iterator[VLLMServer]:
    spec = tiny_server_spec(model, agentkv=agentkv)
    spec.num_gpu_blocks = POOL_BLOCKS
    yield from running_server(spec, log_dir)


@pytest.fixture(scope="module")
def vanilla_hybrid(hybrid_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    yield from _server(hybrid_model_dir, tmp_path_factory.mktemp("vanilla-hybrid"), agentkv=False)


@pytest.fixture(scope="module")
def agentkv_hybrid(hybrid_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    yield from _server(hybrid_model_dir, tmp_path_factory.mktemp("agentkv-hybrid"), agentkv=True)


def _tokens(seed: str, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(count)]


def _calls(turns: int = 72, sessions: int = 4):
    """Sessions passing their work along the six agents in turn; each call adds two blocks to its
    session's conversation (the latest 16 blocks of it are sent)."""
    conversation: dict[int, list[int]] = {s: [] for s in range(sessions)}
    for turn in range(turns):
        s = turn % sessions
        agent = AGENTS[(turn // sessions + s) % len(AGENTS)]
        conversation[s] = (conversation[s] + _tokens(f"hybrid-{turn}", 2 * BLOCK))[-16 * BLOCK:]
        prompt = _tokens(f"hybrid-anchor-{agent}", ANCHOR_BLOCKS * BLOCK) + conversation[s]
        yield agent, f"hybrid-{s}", prompt


def _replay(base_url: str, calls: list[tuple[str, str, list[int]]]) -> list[int]:
    with httpx.Client(base_url=base_url, timeout=120, trust_env=False) as client:
        return [cached_tokens(client, prompt, {"X-AgentKV-Agent": agent, "X-AgentKV-Session": session})
                for agent, session, prompt in calls]


def test_a_sliding_window_model_keeps_every_anchor(vanilla_hybrid, agentkv_hybrid):
    # after a round of four calls per agent (anchors are learned from an agent's second call, the
    # transitions from a few hand-offs), every call finds at least its anchor cached (from call 19
    # on when this was written); vanilla's recency order loses anchors to the conversations
    learned = 4 * len(AGENTS)
    calls = list(_calls())
    vanilla = _replay(vanilla_hybrid.base_url, calls)
    agentkv = _replay(agentkv_hybrid.base_url, calls[:learned])
    # until the model is learned the order is recency's, which may evict an anchor: count from here
    snapshot = StatsSnapshot.take(agentkv_hybrid.base_url)
    agentkv += _replay(agentkv_hybrid.base_url, calls[learned:])
    stats = snapshot.now()
    print(f"\ncached tokens: vanilla {sum(vanilla)}, agentkv {sum(agentkv)}; evictions {stats['evictions']}")
    anchor = ANCHOR_BLOCKS * BLOCK
    assert min(agentkv[learned:]) >= anchor
    assert sum(hit < anchor for hit in vanilla[learned:]) > 0
    assert sum(agentkv) > sum(vanilla)
    assert snapshot.delta("evictions", "anchor", now=stats) == 0 < snapshot.delta("evictions", "history", now=stats)
    # both groups' blocks of an anchor are ranked as anchor: the window's tail beside full attention's
    row = stats["agents"]["planner"]
    assert row["anchor_length_blocks"] == ANCHOR_BLOCKS < row["anchor_blocks"]
