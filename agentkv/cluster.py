"""``agentkv cluster up|down``: N vLLM replicas behind vllm-router, all on loopback.

Each replica is a vLLM OpenAI server (with the agentkv extension, or vanilla for
comparison) publishing KV events over ZMQ, so a KV-aware router sees the real cache
contents whatever the eviction order. agentkv replicas also pull each other's learned
transition counts (``AGENTKV_PEERS``). ``cluster up`` stays in the foreground and stops
everything on Ctrl-C or SIGTERM; ``cluster down`` sends that SIGTERM and then makes sure
every process it recorded is gone. Every process gets the caller's environment (plus
``ClusterConfig.env``); the cluster adds only the replicas' CPU binding and agentkv settings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

from agentkv._arguments import at_least, port_number
from agentkv.launcher import (
    HOST,
    ISOLATED_PREFIXES,
    PORT_RETRIES,
    VLLM_MODULE,
    Command,
    ServerProcess,
    free_port,
    lost_a_port,
)

__all__ = ["POLICIES", "Cluster", "ClusterConfig", "main"]

POLICIES = ("kv_aware", "consistent_hash", "cache_aware", "round_robin")

logger = logging.getLogger("agentkv.cluster")

# agentkv settings that name one server's own file: replicas cannot share them
_ONE_PER_SERVER = {"--agentkv-snapshot": "AGENTKV_SNAPSHOT", "--agentkv-trace": "AGENTKV_TRACE"}


@dataclass
class ClusterConfig:
    """``vllm_args`` go to every replica; they must not set --host or --port. ``env`` is added to
    the caller's environment of every process (replicas and routers); ``isolated``: less the
    caller's agentkv settings and API key (a benchmark's cluster, see ``ServerProcess``). Every
    field after ``model`` is keyword-only: their order is not part of the interface."""

    model: str
    _: KW_ONLY
    replicas: int = 2
    policy: str = "kv_aware"
    vanilla: bool = False
    vllm_args: list[str] = field(default_factory=list)
    router_port: int | None = None
    router_args: list[str] = field(default_factory=list)  # extra arguments of the router ``start`` runs
    sync_interval: float = 5.0
    name: str = "default"
    log_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    isolated: bool = False

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name) or self.name.strip(".") == "":
            raise ValueError(f"--name takes letters, digits, '-', '_' and '.', not {self.name!r}")
        # vLLM takes --flag=value as well as --flag value: one form to read
        self.vllm_args = [part for arg in self.vllm_args
                          for part in (arg.split("=", 1) if arg.startswith("--") and "=" in arg else (arg,))]
        # --agentkv_snapshot is --agentkv-snapshot to ``agentkv serve``, as to vLLM
        flags = {arg.replace("_", "-") if arg.startswith("--") else arg for arg in self.vllm_args}
        if {"--host", "--port"} & set(self.vllm_args):
            raise ValueError("the cluster picks each replica's --host and --port itself")
        inherited = {k: v for k, v in os.environ.items() if not (self.isolated and k.startswith(ISOLATED_PREFIXES))}
        env = {**inherited, **self.env}
        shared = [flag for flag, name in _ONE_PER_SERVER.items()
                  if flag in flags or (env.get(name, "").strip() and not self.vanilla)]
        if shared and self.replicas > 1:
            raise ValueError(f"{' and '.join(shared)} would be one file for {self.replicas} replicas "
                             f"(unset {', '.join(_ONE_PER_SERVER[flag] for flag in shared)} for the cluster)")
        self.check_policy(self.policy)

    def check_policy(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; choose from {', '.join(POLICIES)}")
        if policy == "kv_aware" and "--block-size" not in self.vllm_args:
            raise ValueError("kv_aware routing needs the replicas' --block-size (the router hashes blocks too)")

    def _arg(self, flag: str, default: str) -> str:
        args = self.vllm_args
        return args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else default

    @property
    def served_model_name(self) -> str:
        return self._arg("--served-model-name", self.model)

    @property
    def block_size(self) -> int:
        return int(self._arg("--block-size", "0"))


class Cluster:
    """Replicas first (the router waits for healthy workers), then the router; ``add_router``
    puts more routers (other policies) in front of the same replicas, e.g. to compare policies.

    Invariant: ``processes`` lists everything started: the replicas in index order (a replica
    relaunched on fresh ports takes its predecessor's place), then the routers in start order;
    ``stop`` stops them in reverse order and is idempotent.
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix=f"agentkv-cluster-{config.name}-"))
        self.replica_ports = [free_port() for _ in range(config.replicas)]
        self.replica_urls = [f"http://{HOST}:{port}" for port in self.replica_ports]
        # vLLM's publisher only binds wildcard endpoints and the router only reads tcp://HOST:PORT,
        # so each replica publishes on tcp://*:port and the router subscribes on loopback.
        self.event_ports = [free_port() for _ in range(config.replicas)]
        self.router_port = config.router_port or free_port()
        self.processes: list[ServerProcess] = []

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.router_port}"

    def _replica(self, index: int) -> ServerProcess:
        config = self.config
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.event_ports[index]}"}
        module = VLLM_MODULE if config.vanilla else "agentkv.serve"
        env = _cpu_binding(index, config.replicas, config.env)
        if not config.vanilla:
            peers = [url for i, url in enumerate(self.replica_urls) if i != index]
            env |= {
                "AGENTKV_REPLICA": f"{config.name}-replica-{index}",
                "AGENTKV_PEERS": ",".join(peers),
                "AGENTKV_SYNC_INTERVAL": str(config.sync_interval),
            }

        def argv(port: int) -> list[str]:
            return [sys.executable, "-m", module, "--model", config.model, *config.vllm_args,
                    "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events),
                    "--host", HOST, "--port", str(port)]

        return ServerProcess(Command(argv, env), port=self.replica_ports[index], base_env=config.env,
                             log_path=self.log_dir / f"replica-{index}.log", isolated=config.isolated)

    def _router(self, policy: str, port: int, args: Sequence[str] = ()) -> ServerProcess:
        config = self.config
        binary = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))

        def argv(port: int) -> list[str]:
            # its own Prometheus port: the default (29000) would collide with any other router
            command = [binary, "--host", HOST, "--port", str(port), "--policy", policy,
                       "--worker-urls", *self.replica_urls, "--worker-startup-timeout-secs", "600",
                       "--prometheus-host", HOST, "--prometheus-port", str(free_port())]
            if policy == "kv_aware":
                for url, events_port in zip(self.replica_urls, self.event_ports, strict=True):
                    command += ["--kv-event-source", f"{url}=tcp://{HOST}:{events_port}"]
                command += ["--kv-event-model", config.served_model_name,
                            "--kv-event-block-size", str(config.block_size)]
            return command + list(args)

        return ServerProcess(Command(argv), port=port, base_env=config.env,
                             log_path=self.log_dir / f"router-{policy}-{port}.log", isolated=config.isolated)

    def start(self, timeout: float = 600.0) -> Cluster:
        config = self.config
        try:
            replicas = [self._replica(i) for i in range(config.replicas)]
            for replica in replicas:  # launch together, wait together: start-up overlaps
                self.processes.append(replica.launch())
            for index, replica in enumerate(replicas):
                self._wait_replica(index, replica, timeout)
            self.router_port = self._start_router(config.policy, config.router_args, timeout, self.router_port,
                                                  fixed=config.router_port is not None)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_replica(self, index: int, replica: ServerProcess, timeout: float) -> None:
        """Wait for replica ``index``; relaunch it on fresh ports (at most ``PORT_RETRIES`` times)
        when one of its ports was taken between choosing it and binding it (the replicas start
        together, and each vLLM picks internal ports of its own as it starts)."""
        for attempt in range(PORT_RETRIES + 1):
            try:
                replica.wait_healthy(timeout)
                return
            except RuntimeError as exc:
                if attempt == PORT_RETRIES or not lost_a_port(exc):
                    raise
            logger.warning("agentkv cluster: replica %d lost a port to another process; relaunching", index)
            slot = self.processes.index(replica)
            self.replica_ports[index], self.event_ports[index] = free_port(), free_port()
            self.replica_urls[index] = f"http://{HOST}:{self.replica_ports[index]}"
            replica = self._replica(index)
            self.processes[slot] = replica.launch()

    def add_router(self, policy: str, args: Sequence[str] = (), timeout: float = 120.0) -> str:
        """Start another vllm-router (``policy``, extra router ``args``) in front of the running
        replicas; its URL. Start it before traffic: a ``kv_aware`` router only knows blocks stored
        after it subscribed."""
        self.config.check_policy(policy)
        return f"http://{HOST}:{self._start_router(policy, args, timeout, free_port(), fixed=False)}"

    def _start_router(self, policy: str, args: Sequence[str], timeout: float, port: int, *, fixed: bool) -> int:
        """Start a router on ``port`` and return the port it serves on: unless the port is ``fixed``
        (the user chose it), a launch that lost a port between choosing and binding it is retried on
        a fresh one, at most ``PORT_RETRIES`` times (its Prometheus port is fresh on every launch)."""
        for _ in range(PORT_RETRIES):
            try:
                self.processes.append(self._router(policy, port, args).start(timeout))
                return port
            except RuntimeError as exc:
                if fixed or not lost_a_port(exc):
                    raise
            logger.warning("agentkv cluster: the %s router lost a port to another process; relaunching", policy)
            port = free_port()
        self.processes.append(self._router(policy, port, args).start(timeout))
        return port

    def stop(self) -> None:
        while self.processes:
            self.processes.pop().stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cpu_binding(index: int, replicas: int, env: Mapping[str, str]) -> dict[str, str]:
    """vLLM on CPU binds every server's OpenMP threads to the same cores ("auto"), so co-located
    replicas would share them and leave the rest idle: give replica ``index`` its own slice of
    the cores. Ignored by GPU builds; an explicit VLLM_CPU_OMP_THREADS_BIND (exported, or in
    ``ClusterConfig.env``, passed as ``env``) wins."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or "VLLM_CPU_OMP_THREADS_BIND" in env:
        return {}
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    share = max(1, len(cores) // replicas)
    start = (index * share) % len(cores)
    mine = cores[start : start + share]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine))}


def _state_file(name: str) -> Path:
    return Path(tempfile.gettempdir()) / f"agentkv-cluster-{name}.json"


def _up(args: argparse.Namespace) -> None:
    if not args.vllm_args:
        sys.exit("usage: agentkv cluster up [--replicas N] [--router-policy P] [--vanilla] MODEL [vllm args]")
    model, *vllm_args = args.vllm_args
    try:
        config = ClusterConfig(model, replicas=args.replicas, policy=args.router_policy, vanilla=args.vanilla,
                               vllm_args=vllm_args, router_port=args.port, sync_interval=args.sync_interval,
                               name=args.name)
    except ValueError as exc:  # options that do not combine (e.g. kv_aware without --block-size)
        sys.exit(f"agentkv cluster up: {exc}")
    state = _state_file(config.name)
    if state.exists():
        sys.exit(f"a cluster named {config.name!r} is already up ({state}); run `agentkv cluster down` first")
    stopping = False

    def request_stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    cluster = Cluster(config)
    try:
        cluster.start()
        state.write_text(json.dumps({"pid": os.getpid(), "router": cluster.url, "replicas": cluster.replica_urls,
                                     "pgids": [p.pid for p in cluster.processes], "logs": str(cluster.log_dir)}))
        kind = "vanilla" if config.vanilla else "agentkv"
        print(f"cluster {config.name!r}: {config.replicas} {kind} replicas {' '.join(cluster.replica_urls)} "
              f"behind vllm-router ({config.policy}) at {cluster.url}; logs in {cluster.log_dir}", flush=True)
        while not stopping:
            time.sleep(0.5)
    finally:
        cluster.stop()
        state.unlink(missing_ok=True)


def _down(args: argparse.Namespace) -> None:
    state = _state_file(args.name)
    if not state.exists():
        print(f"no cluster named {args.name!r} is up")
        return
    recorded = json.loads(state.read_text())
    try:
        os.kill(recorded["pid"], signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and _alive(recorded["pid"]):
        time.sleep(0.5)
    for pgid in recorded["pgids"]:  # the foreground process is gone: make sure its children are too
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    state.unlink(missing_ok=True)
    print(f"cluster {args.name!r} stopped")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="agentkv cluster", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start replicas and the router (foreground; Ctrl-C stops)")
    up.add_argument("--replicas", type=at_least(int, 1), default=2)
    up.add_argument("--router-policy", choices=POLICIES, default="kv_aware")
    up.add_argument("--vanilla", action="store_true", help="replicas without the agentkv extension")
    up.add_argument("--port", type=port_number, default=None, help="router port (default: a free one)")
    up.add_argument("--sync-interval", type=at_least(float, 0.0, strict=True), default=5.0,
                    help="seconds between learned-state merges")
    up.add_argument("--name", default="default")
    up.add_argument("vllm_args", nargs=argparse.REMAINDER, help="MODEL and vLLM arguments for every replica")
    up.set_defaults(run=_up)
    down = commands.add_parser("down", help="stop what `cluster up` started")
    down.add_argument("--name", default="default")
    down.set_defaults(run=_down)
    args = parser.parse_args(argv)
    args.run(args)
