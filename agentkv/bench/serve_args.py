"""Configuration and command-line options of ``agentkv bench serve`` (no heavy imports)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from agentkv._arguments import at_least, list_of

__all__ = ["FIRST_PROMPT_TOKENS", "MODELS", "RATES", "REPO_ROOT", "ROUTER_VARIANTS", "TURN_TOKENS", "ServeConfig",
           "add_arguments", "build_model", "config_from_args", "router_command", "session_tokens"]

RATES = list_of(at_least(float, 0.0, strict=True))  # --rates: session arrival rates, sessions/s

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS = ("bench", "tiny")  # agentkv.bench.model (prefill costs what serving's does), the tiny test model

# names for routers run with extra arguments: name -> (vllm-router policy, arguments)
ROUTER_VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    # kv_aware plus stickiness on the request's X-Session-ID (idle TTL 600 s)
    "kv_aware+affinity": ("kv_aware", ("--kv-aware-session-affinity-ttl-secs", "600")),
}


# The context a session of the app needs, about (measured with the models' tokenizer on the app's
# sessions; a real run's 8 turns of 24 tokens peaked at 1,832): its first call's prompt (the
# supervisor's anchor and the task), then per turn the reply (--max-tokens at most) and ~130 tokens
# of tool call and result; the last call adds its own reply.
FIRST_PROMPT_TOKENS = 740
TURN_TOKENS = 130


def session_tokens(turns: int, max_tokens: int) -> int:
    """About the most context (prompt and reply) a call of a session of ``turns`` agent turns needs."""
    return FIRST_PROMPT_TOKENS + (turns - 1) * (TURN_TOKENS + max_tokens) + max_tokens


def router_command(name: str) -> tuple[str, tuple[str, ...]]:
    """(vllm-router policy, extra router arguments) of a router name: a policy or a variant."""
    return ROUTER_VARIANTS.get(name, (name, ()))


@dataclass
class ServeConfig:
    rates: list[float] = field(default_factory=lambda: [0.2, 0.4, 0.8])  # sessions per second
    sessions: int = 16  # measured sessions per (server, rate)
    warmup_sessions: int = 4  # per server, before the first rate, not measured
    repeats: int = 1  # sweeps over all rates (alternating server order), pooled per (server, rate)
    block_sessions: int = 4  # sessions per block: the servers alternate block by block (ABAB...)
    swap_cores: bool = True  # swap the two engines' cores halfway through each rate's blocks
    seed: int = 0
    blocks: int = 201  # --num-gpu-blocks-override (usable blocks: one less)
    block_size: int = 32
    max_model_len: int = 2048
    turns: int = 8
    max_tokens: int = 24
    tool_gap: float = 0.3
    concurrency: int = 16  # sessions running at once, at most
    out: Path = Path(".build/bench-serve")
    model: str = "bench"  # one of MODELS
    model_dir: Path | None = None  # default: .build/bench-model or .build/tiny-model
    # scale-out (replicas > 1): each replica gets (blocks - 1) / replicas usable blocks, so the
    # replicas together hold what one server holds; both kinds of replicas run behind each router
    replicas: int = 1
    routers: list[str] = field(default_factory=lambda: ["kv_aware", "consistent_hash", "round_robin"])
    routing_keys: list[str] = field(default_factory=lambda: ["session", "agent"])
    warmup: bool = False  # also run agentkv with the client's warm-up coordinator ("agentkv+warmup")
    untagged: bool = False  # the app is not instrumented: no tags, no X-Session-ID, no events (recognition)

    def __post_init__(self) -> None:
        from agentkv.cluster import POLICIES  # light: no vLLM import
        from agentkv.testing.tiny_model import MAX_POSITION_EMBEDDINGS  # both models' (light: no torch import)

        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose from {', '.join(MODELS)}")
        if self.model_dir is None:
            self.model_dir = REPO_ROOT / ".build" / f"{self.model}-model"
        if self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if unknown := set(self.routers) - set(POLICIES) - set(ROUTER_VARIANTS):
            choices = ", ".join([*POLICIES, *ROUTER_VARIANTS])
            raise ValueError(f"unknown router policy {sorted(unknown)}; choose from {choices}")
        if unknown := set(self.routing_keys) - {"session", "agent"}:
            raise ValueError(f"unknown routing key {sorted(unknown)}; choose from session, agent")
        if self.replicas > 1 and not (self.routers and self.routing_keys):
            raise ValueError("--replicas > 1 needs at least one --router and one --routing-key")
        if len(set(self.routers)) < len(self.routers) or len(set(self.routing_keys)) < len(self.routing_keys):
            raise ValueError("a router or routing key named twice would run one setup twice on the same replicas")
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"--out {self.out} is a file, not a folder")
        if self.max_model_len > MAX_POSITION_EMBEDDINGS:
            raise ValueError(f"--max-model-len {self.max_model_len} is more than the models' "
                             f"{MAX_POSITION_EMBEDDINGS} positions")
        if (self.blocks - 1) // self.replicas * self.block_size < self.max_model_len:  # vLLM would refuse to start
            split = f" split over {self.replicas} replicas" if self.replicas > 1 else ""
            raise ValueError(f"--blocks {self.blocks}{split} leaves less than --max-model-len {self.max_model_len} "
                             f"tokens{' per replica' if split else ''}")
        if (need := session_tokens(self.turns, self.max_tokens)) > self.max_model_len:  # every late call would fail
            most = (self.max_model_len - FIRST_PROMPT_TOKENS - self.max_tokens) // (TURN_TOKENS + self.max_tokens) + 1
            fits = f"at most --turns {most} fit" if most >= 1 else "no turn fits"
            raise ValueError(f"--turns {self.turns} with --max-tokens {self.max_tokens} needs about {need} tokens of "
                             f"context, more than --max-model-len {self.max_model_len} ({fits}; or raise "
                             "--max-model-len, with --blocks to hold it)")

    @property
    def replica_blocks(self) -> int:
        """--num-gpu-blocks-override of each replica (vLLM reserves one block)."""
        return (self.blocks - 1) // self.replicas + 1



def build_model(config: ServeConfig) -> Path:
    """Build (once) the configured model in ``config.model_dir``; return its path."""
    assert config.model_dir is not None
    if config.model == "tiny":
        from agentkv.testing.tiny_model import build_tiny_model

        return build_tiny_model(config.model_dir)
    from agentkv.bench.model import build_bench_model

    return build_bench_model(config.model_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    rates = ",".join(f"{r:g}" for r in d.rates)
    parser.add_argument("--rates", type=RATES, default=list(d.rates),
                        help=f"session arrival rates, sessions/s, comma-separated (default {rates})")
    parser.add_argument("--sessions", type=at_least(int, 1), default=d.sessions,
                        help="measured sessions per server and rate")
    parser.add_argument("--warmup-sessions", type=at_least(int, 0), default=d.warmup_sessions)
    parser.add_argument("--repeats", type=at_least(int, 1), default=d.repeats,
                        help="sweeps over all rates; each (server, rate) pools its repeats (seeds seed, seed+1, ...)")
    parser.add_argument("--block-sessions", type=at_least(int, 1), default=d.block_sessions,
                        help="sessions per block; the servers alternate block by block (default %(default)s)")
    parser.add_argument("--no-swap-cores", action="store_true",
                        help="keep each engine on its core (default: swap them halfway through each rate)")
    parser.add_argument("--model", choices=MODELS, default=d.model,
                        help="bench: a random Llama whose prefill costs what serving's does; tiny: the test model")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--blocks", type=at_least(int, 2), default=d.blocks,
                        help="--num-gpu-blocks-override of both servers")
    parser.add_argument("--max-model-len", type=at_least(int, 1), default=d.max_model_len,
                        help="context of both servers, tokens (default %(default)s); --blocks must hold it")
    parser.add_argument("--turns", type=at_least(int, 1), default=d.turns,
                        help="agent turns per session (default %(default)s; refused when a session's last call "
                             f"would need more than --max-model-len: about {FIRST_PROMPT_TOKENS} + (turns - 1) x "
                             f"({TURN_TOKENS} + --max-tokens) + --max-tokens tokens)")
    parser.add_argument("--max-tokens", type=at_least(int, 1), default=d.max_tokens, help="tokens per reply")
    parser.add_argument("--tool-gap", type=at_least(float, 0.0), default=d.tool_gap,
                        help="seconds each tool step takes")
    parser.add_argument("--concurrency", type=at_least(int, 1), default=d.concurrency,
                        help="max sessions running at once")
    parser.add_argument("--replicas", type=at_least(int, 1), default=d.replicas,
                        help="> 1: also run vanilla and agentkv replicas (sharing --blocks) behind vllm-router")
    parser.add_argument("--router", default=",".join(d.routers),
                        help="routers to compare, comma-separated: vllm-router policies or kv_aware+affinity "
                             "(kv_aware sticky on X-Session-ID) (with --replicas; default %(default)s)")
    parser.add_argument("--routing-key", default=",".join(d.routing_keys),
                        help="what X-Session-ID carries: session and/or agent, comma-separated (default %(default)s;"
                             " round_robin ignores it and runs once)")
    parser.add_argument("--warmup", action="store_true",
                        help="also run agentkv with anchor warm-ups (agentkv+warmup) in every setup")
    parser.add_argument("--untagged", action="store_true",
                        help="send no agentkv headers at all (no tags, no X-Session-ID, no events): the agentkv "
                             "server recognizes agents and sessions itself; adds a confusion table")
    parser.add_argument("--out", type=Path, default=d.out,
                        help="directory for serve.json (rewritten after every block, \"complete\": false until the "
                             "run ends), serve.md and serve.png (at the end)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default OUT/serve.png)")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        rates=list(args.rates),
        sessions=args.sessions,
        warmup_sessions=args.warmup_sessions,
        repeats=args.repeats,
        block_sessions=args.block_sessions,
        swap_cores=not args.no_swap_cores,
        model=args.model,
        seed=args.seed,
        blocks=args.blocks,
        max_model_len=args.max_model_len,
        turns=args.turns,
        max_tokens=args.max_tokens,
        tool_gap=args.tool_gap,
        concurrency=args.concurrency,
        out=args.out,
        replicas=args.replicas,
        routers=_names(args.router),
        routing_keys=_names(args.routing_key),
        warmup=args.warmup,
        untagged=args.untagged,
    )


def _names(text: str) -> list[str]:
    return [name.strip() for name in str(text).split(",") if name.strip()]
