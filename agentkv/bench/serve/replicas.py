"""``agentkv bench serve --replicas N --router POLICY[,POLICY]``: the serve benchmark scaled out.

Started once, on 127.0.0.1 (docs/benchmarks.md): the two single servers, N vanilla and N agentkv
replicas (``agentkv.cluster.Cluster``) sharing ``--blocks``, and one ``vllm-router`` per policy
in front of each kind, all up before any traffic. The targets: the single servers, then each
policy and routing key for both kinds of replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from agentkv.bench._defaults import SERVER_ENV
from agentkv.bench.serve_args import ServeConfig, build_model, router_command
from agentkv.cluster import Cluster, ClusterConfig
from agentkv.launcher import ServerProcess

from .servers import running, server_specs
from .targets import SERVERS, Target, single_targets

__all__ = ["replica_args", "start_targets", "targets_for"]


def replica_args(config: ServeConfig) -> list[str]:
    """The vLLM arguments of every replica: the single servers' arguments with a share of the blocks."""
    return ["--served-model-name", "tiny", "--dtype", "bfloat16", "--max-model-len", str(config.max_model_len),
            "--block-size", str(config.block_size), "--num-gpu-blocks-override", str(config.replica_blocks),
            "--enforce-eager"]


def targets_for(
    config: ServeConfig, singles: dict[str, str], routers: dict[str, dict[str, str]], replicas: dict[str, list[str]]
) -> list[Target]:
    """``singles``: server kind -> URL; ``routers``: kind -> policy -> router URL; ``replicas``:
    kind -> replica URLs. Singles first, then each policy and key, in the order of ``SERVERS``
    (``agentkv+warmup``, with ``config.warmup``, uses the agentkv replicas and routers)."""
    targets = single_targets(config, singles)
    kinds = SERVERS if config.warmup else SERVERS[:2]
    for policy in config.routers:
        # the key is moot for round robin, and an uninstrumented app sends none (no X-Session-ID)
        keys = config.routing_keys[:1] if policy == "round_robin" or config.untagged else config.routing_keys
        for key in keys:
            for kind in kinds:
                behind = "vanilla" if kind == "vanilla" else "agentkv"
                urls = tuple(replicas[behind])
                targets.append(Target(kind, routers[behind][policy], urls, () if kind == "vanilla" else urls,
                                      f"{policy}/{key}"))
    return targets


@contextlib.contextmanager
def start_targets(config: ServeConfig, *, log: Any = print) -> Iterator[list[Target]]:
    """Start the single servers, both kinds of replicas and every router; yield the targets; stop all."""
    model_dir = build_model(config)
    config.out.mkdir(parents=True, exist_ok=True)
    singles = {name: ServerProcess(spec, log_path=config.out / f"{name}-server.log", base_env=SERVER_ENV, isolated=True)
               for name, spec in server_specs(config, model_dir).items()}
    first, first_args = router_command(config.routers[0])
    clusters = {
        kind: Cluster(ClusterConfig(str(model_dir), replicas=config.replicas, policy=first,
                                    vanilla=kind == "vanilla", vllm_args=replica_args(config),
                                    router_args=list(first_args), name=f"bench-{kind}",
                                    log_dir=config.out / f"{kind}-replicas", env=SERVER_ENV, isolated=True))
        for kind in SERVERS[:2]
    }
    with running([*singles.values(), *clusters.values()]):
        routers = {kind: {config.routers[0]: cluster.url}
                   | {name: cluster.add_router(*router_command(name)) for name in config.routers[1:]}
                   for kind, cluster in clusters.items()}
        log(f"up: single servers ({config.blocks - 1} blocks) " + ", ".join(s.base_url for s in singles.values())
            + f"; {config.replicas} replicas per kind ({config.replica_blocks - 1} blocks each); routers "
            + ", ".join(f"{kind} {policy} {url}" for kind, by in routers.items() for policy, url in by.items()))
        yield targets_for(config, {n: s.base_url for n, s in singles.items()}, routers,
                          {kind: cluster.replica_urls for kind, cluster in clusters.items()})
