"""Helpers for the end-to-end tests against a real ``agentkv serve`` (tiny model, 32-token blocks)."""

from __future__ import annotations

import random
import time
from typing import Any

import httpx

from agentkv.protocol import STATS_MAX_AGE
from agentkv.warmup import WarmupConfig

BLOCK = 32
MAX_PROMPT = 2040  # max_model_len 2048 with max_tokens 1: 64 blocks


def instructions(role: str, run: str, sentences: int = 24) -> str:
    """A long, unique system prompt (its first block already differs between runs and roles)."""
    rng = random.Random(f"{role}-{run}")
    words = ["plan", "check", "write", "verify", "state", "list", "keep", "short", "exact", "steps", "code", "tests"]
    body = " ".join(" ".join(rng.choice(words) for _ in range(9)) + "." for _ in range(sentences))
    return f"[{run}] You are the {role}. {body}"


def fill_cache(base_url: str, seed: str, prompts: int = 2) -> None:
    """Evict what is not protected: untagged prompts of 64 blocks each, unique to ``seed``.

    With 80 usable blocks, the second prompt leaves at most 16 blocks of anything older than the
    first; blocks of ended sessions (retired) and older blocks go first under both policies.
    """
    with httpx.Client(base_url=base_url, trust_env=False, timeout=120) as client:
        for i in range(prompts):
            rng = random.Random(f"fill-{seed}-{i}")
            prompt = [rng.randrange(10, 4000) for _ in range(MAX_PROMPT)]
            client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}).raise_for_status()
    # what a warm-up coordinator knows of the anchors' residency is up to one stats document
    # (STATS_MAX_AGE) and one metrics poll (metrics_interval) old: let it see the eviction
    time.sleep(STATS_MAX_AGE + WarmupConfig().metrics_interval)


def cached_tokens(message: Any) -> int:
    """``cached_tokens`` of a langchain-openai ``AIMessage``."""
    usage = message.response_metadata["token_usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
