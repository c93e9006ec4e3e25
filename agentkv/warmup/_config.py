"""The settings of a :class:`~agentkv.warmup.WarmupCoordinator`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ._decision import WarmupPolicy

__all__ = ["WarmupConfig"]


@dataclass(frozen=True, slots=True)
class WarmupConfig:
    """How a warm-up coordinator decides, paces and talks to the server.

    ``model``: the served model name for warm-ups (default: the one the agent's calls used).
    ``r_min``, ``min_probability``, ``max_waiting``, ``max_load``, ``weigh_load``, ``min_free_blocks``: the
    thresholds of :class:`~agentkv.warmup.WarmupPolicy`; ``max_per_second`` and ``burst`` (default
    ``max(1, max_per_second)``): its token bucket. ``metrics_interval`` / ``stats_interval``: at
    most one ``GET /metrics`` / ``GET /agentkv/v1/stats`` per that many seconds. ``useful_window``:
    seconds after which a warm-up whose agent was not called counts as ``unused``. ``queue_size``:
    jobs kept (the oldest dropped when full). ``timeout``: httpx timeout of every request.
    ``block_size``: the server's KV block size (default: from its stats, else 32). ``api_key``:
    sent as vLLM expects it (default ``VLLM_API_KEY``; none when neither is set). ``replicas``:
    behind a router, the URLs of the servers behind it, whose views are read and merged (the
    router would hand each read to one of them); warm-ups still go through the router.
    """

    model: str | None = None
    r_min: float = 0.3
    min_probability: float = 0.0
    max_per_second: float = 2.0
    burst: float | None = None
    max_waiting: int | None = 0
    max_load: int | None = None
    weigh_load: bool = True
    min_free_blocks: int = 0
    metrics_interval: float = 0.5
    stats_interval: float = 2.0
    useful_window: float = 120.0
    queue_size: int = 8
    timeout: float = 10.0
    block_size: int | None = None
    api_key: str | None = None
    replicas: tuple[str, ...] = ()

    def policy(self) -> WarmupPolicy:
        return WarmupPolicy(r_min=self.r_min, min_probability=self.min_probability, max_waiting=self.max_waiting,
                            max_load=self.max_load, weigh_load=self.weigh_load,
                            min_free_blocks=self.min_free_blocks)

    def headers(self) -> dict[str, str]:
        key = os.environ.get("VLLM_API_KEY") if self.api_key is None else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    @property
    def bucket_capacity(self) -> float:
        return self.burst if self.burst is not None else max(1.0, self.max_per_second)
