"""Where the benchmark's traffic goes: one :class:`Target` per server kind and setup."""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.bench.serve_args import ServeConfig

__all__ = ["SERVERS", "Target", "single_targets"]

SERVERS = ("vanilla", "agentkv", "agentkv+warmup")  # the warm-up variant runs with --warmup


@dataclass(frozen=True)
class Target:
    """One server kind in one setup. ``url`` takes the model calls (a server, or a router);
    ``engines`` are the vLLM servers behind it, whose prefix-cache counters are summed (a router
    has none); ``events`` the agentkv servers that get graph facts and session events (all
    replicas: a router would hand them to one). ``setup`` is ``single`` or ``POLICY/KEY``: a
    router policy and the routing key (``session`` or ``agent``) that ``X-Session-ID`` carries.
    ``agentkv+warmup`` is agentkv with the client's warm-up coordinator sending through ``url``.
    ``suffixed``: a single server's session ids carry a suffix too (see ``session_suffix``)."""

    server: str  # one of SERVERS
    url: str
    engines: tuple[str, ...]
    events: tuple[str, ...] = ()
    setup: str = "single"
    suffixed: bool = False

    @property
    def routing_key(self) -> str:
        return self.setup.partition("/")[2] or "session"

    @property
    def warmup(self) -> bool:
        return self.server == "agentkv+warmup"

    @property
    def session_suffix(self) -> str:
        """Appended to session ids where targets share engines (the setups behind routers, the
        warm-up variant): one workload run twice on one engine must not hit its own history. The
        example quotes such an id in every prompt, so the targets compared with each other (one
        setup's) get suffixes of one length (the kind's index in SERVERS), never only some of them:
        a longer prompt would cost its target hit rate and prefill."""
        if self.setup == "single" and not self.suffixed:
            return ""
        return f"@{self.setup}/{SERVERS.index(self.server)}"

    @classmethod
    def single(cls, server: str, url: str, *, suffixed: bool = False) -> Target:
        return cls(server, url, (url,), () if server == "vanilla" else (url,), suffixed=suffixed)


def single_targets(config: ServeConfig, urls: dict[str, str]) -> list[Target]:
    """The single servers (``urls``: kind -> URL), plus agentkv with warm-ups when ``config.warmup``
    (which shares agentkv's engine: then every single server's session ids are suffixed)."""
    warmup = config.warmup and "agentkv" in urls
    targets = [Target.single(kind, url, suffixed=warmup) for kind, url in urls.items()]
    if warmup:
        targets.append(Target.single("agentkv+warmup", urls["agentkv"], suffixed=True))
    return targets
