"""Server-side settings of the agentkv runtime, read from AGENTKV_* environment variables."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from agentkv.graph import LearnerConfig, ReuseConfig

from ._free_queue import DEFAULT_DECAY

__all__ = ["RuntimeConfig", "recognition_on"]


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number") from exc


def recognition_on(env: Mapping[str, str] = os.environ) -> bool:
    """``AGENTKV_RECOGNIZE``: on unless ``0`` or ``off`` (read alike by the engine and the middleware)."""
    return env.get("AGENTKV_RECOGNIZE", "1") not in ("0", "off")


@dataclass(frozen=True)
class RuntimeConfig:
    """Server-side settings, read from AGENTKV_* environment variables (docs/server.md)."""

    enabled: bool = True
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    learner: LearnerConfig = field(default_factory=lambda: LearnerConfig(half_life=5000, session_ttl=600))
    decay: float = DEFAULT_DECAY
    recognize: bool = True  # recognize agents and sessions of untagged requests
    refresh_interval: float = 0.1  # least clock time between two evaluations of the next-use model (s)
    snapshot_path: str | None = None
    snapshot_interval: float = 30.0  # seconds between periodic saves (0: only at shutdown)
    trace_path: str | None = None  # a JSON line per admitted request (server_patch/_trace.py)
    listed_agents: int = 64  # stats and /metrics list the top agents by traffic, the rest as OTHER
    tracked_agents: int = 1024  # per-agent counters kept; later agents are counted as OTHER
    max_peers: int = 32
    peer_weight: float = 4.0  # a peer's counts weigh at most this multiple of the local evidence
    replica: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RuntimeConfig:
        defaults = cls()
        horizon = env.get("AGENTKV_HORIZON")
        reuse = ReuseConfig(
            r_min=_env_float(env, "AGENTKV_R_MIN", defaults.reuse.r_min),
            steps=None if not horizon else int(_env_float(env, "AGENTKV_HORIZON", 0)),
        )
        return cls(
            enabled=env.get("AGENTKV_ENABLED", "1") != "0",
            reuse=reuse,
            decay=_env_float(env, "AGENTKV_DECAY", defaults.decay),
            recognize=recognition_on(env),
            refresh_interval=_env_float(env, "AGENTKV_REFRESH_INTERVAL", defaults.refresh_interval),
            snapshot_path=env.get("AGENTKV_SNAPSHOT") or None,
            snapshot_interval=_env_float(env, "AGENTKV_SNAPSHOT_INTERVAL", defaults.snapshot_interval),
            trace_path=env.get("AGENTKV_TRACE") or None,
            listed_agents=int(_env_float(env, "AGENTKV_STATS_TOP_AGENTS", defaults.listed_agents)),
            max_peers=int(_env_float(env, "AGENTKV_MAX_PEERS", defaults.max_peers)),
            peer_weight=_env_float(env, "AGENTKV_PEER_WEIGHT", defaults.peer_weight),
            replica=env.get("AGENTKV_REPLICA") or defaults.replica,
        )
