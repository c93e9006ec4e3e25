"""Server-side settings of the agentkv runtime, read from AGENTKV_* environment variables."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from agentkv.graph import LearnerConfig, ReuseConfig
from agentkv.settings import env_number, env_switch, env_text

from ._free_queue import DEFAULT_DECAY

__all__ = ["RuntimeConfig", "recognition_on"]


def recognition_on(env: Mapping[str, str] = os.environ) -> bool:
    """``AGENTKV_RECOGNIZE`` (on unless switched off), read alike by the engine and the middleware."""
    return env_switch(env, "AGENTKV_RECOGNIZE", True)


def _default_replica(snapshot_path: str | None) -> str:
    """This replica's name when ``AGENTKV_REPLICA`` is unset. With a snapshot, ``host-<hash of its
    absolute path>``: a restart restores the same counts under the same name, so the peers replace
    its old export instead of counting that evidence twice (a copy seeding a new replica elsewhere
    gets a name of its own). Without one, ``host-pid``: a restart starts from zero."""
    host = socket.gethostname()
    if snapshot_path is None:
        return f"{host}-{os.getpid()}"
    return f"{host}-{hashlib.sha256(os.fsencode(os.path.abspath(snapshot_path))).hexdigest()[:12]}"


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
    peer_weight: float = 4.0  # the peers' counts (each, and all together) weigh at most this x the local evidence
    replica: str = field(default_factory=lambda: _default_replica(None))

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RuntimeConfig:
        """The settings in ``env``; a value ``agentkv serve`` would refuse raises its SettingError."""
        defaults = cls()
        horizon = env_text(env, "AGENTKV_HORIZON")
        snapshot_path = env_text(env, "AGENTKV_SNAPSHOT")
        reuse = ReuseConfig(
            r_min=env_number(env, "AGENTKV_R_MIN", defaults.reuse.r_min),
            steps=None if horizon is None else int(float(horizon)),
        )
        return cls(
            enabled=env_switch(env, "AGENTKV_ENABLED", True),
            reuse=reuse,
            decay=env_number(env, "AGENTKV_DECAY", defaults.decay),
            recognize=recognition_on(env),
            refresh_interval=env_number(env, "AGENTKV_REFRESH_INTERVAL", defaults.refresh_interval),
            snapshot_path=snapshot_path,
            snapshot_interval=env_number(env, "AGENTKV_SNAPSHOT_INTERVAL", defaults.snapshot_interval),
            trace_path=env_text(env, "AGENTKV_TRACE"),
            listed_agents=int(env_number(env, "AGENTKV_STATS_TOP_AGENTS", defaults.listed_agents)),
            max_peers=int(env_number(env, "AGENTKV_MAX_PEERS", defaults.max_peers)),
            peer_weight=env_number(env, "AGENTKV_PEER_WEIGHT", defaults.peer_weight),
            replica=env_text(env, "AGENTKV_REPLICA") or _default_replica(snapshot_path),
        )
