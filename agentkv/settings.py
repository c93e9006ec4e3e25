"""agentkv's server settings: one table, read by ``agentkv serve`` as flags and by the server as env vars.

Each setting is a flag ``--agentkv-NAME`` and an environment variable ``AGENTKV_...``; the flag
wins, the variable is the fallback, then the default (docs/server.md describes each one). The
server (``server_patch``) reads only the variables: ``agentkv serve`` validates its flags and
writes them into its own environment before it becomes the vLLM process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from agentkv.protocol import ProtocolError, validate_id

__all__ = ["MAX_HORIZON", "SETTINGS", "Setting", "SettingError", "env_number", "env_switch", "env_text"]

MAX_HORIZON = 128  # dispatches a fixed K may look ahead (a table of K x agents^2 is rebuilt every refresh)


class SettingError(ValueError):
    """A flag or environment value that the setting does not accept; the message names both."""


def _switch(raw: str) -> str:
    value = raw.strip().lower()
    if value in ("on", "1", "true", "yes"):
        return "1"
    if value in ("off", "0", "false", "no"):
        return "0"
    raise ValueError("takes on or off")


def _number(kind: type[int] | type[float], low: float, *, above: bool = False,
            high: float = math.inf) -> Callable[[str], str]:
    """A parser for numbers ``low <= x <= high`` (``low < x`` when ``above``); keeps the text as given."""
    bound = f"> {low:g}" if above else f">= {low:g}"
    if high < math.inf:
        bound += f" and <= {high:g}"
    noun = "an integer" if kind is int else "a number"

    def parse(raw: str) -> str:
        try:
            value = float(raw)  # the server reads every number with float()
        except ValueError:
            raise ValueError(f"takes {noun} {bound}") from None
        if kind is int and not value.is_integer():
            raise ValueError(f"takes {noun} {bound}")
        if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
            raise ValueError(f"takes {noun} {bound}")
        return raw

    return parse


def _text(raw: str) -> str:
    if not raw.strip():
        raise ValueError("takes a non-empty value")
    return raw


def _wire_id(raw: str) -> str:
    """A name the peers take (protocol §1.3): a replica's exported state names it."""
    try:
        return validate_id(raw.strip(), "replica")
    except ProtocolError as exc:
        raise ValueError(str(exc)) from None


def _urls(raw: str) -> str:
    """Comma-separated server base URLs, each kept as ``scheme://host[:port]`` (a ``/v1`` or ``/``
    after it dropped: the peers' routes are read from their root)."""
    roots = []
    for url in (part.strip() for part in raw.split(",")):
        if not url:
            continue
        try:
            parts = urlsplit(url)
            port = parts.port  # raises on a port out of range
        except ValueError as exc:
            raise ValueError(f"takes comma-separated http(s) base URLs ({url}: {exc})") from exc
        path = parts.path.rstrip("/")
        path = path[: -len("/v1")] if path.endswith("/v1") else path
        if parts.scheme not in ("http", "https") or not parts.hostname or port == 0 or path or parts.query:
            which = "" if url == raw.strip() else f" ({url!r} is not one)"
            raise ValueError(f"takes comma-separated http(s) base URLs like http://host:8000{which}")
        roots.append(f"{parts.scheme}://{parts.netloc}")
    return ",".join(roots)


@dataclass(frozen=True)
class Setting:
    """One server setting. Invariant: ``parse`` returns the text the server reads from ``env``
    for every value it accepts, and raises ``ValueError`` (the reason) for every other."""

    name: str
    env: str
    metavar: str
    default: str
    help: str
    parse: Callable[[str], str]

    @property
    def flag(self) -> str:
        return f"--agentkv-{self.name}"

    def value(self, raw: str, *, source: str) -> str:
        """``raw`` as the server's env text; a SettingError naming ``source`` if it is refused."""
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise SettingError(f"{source} {exc}, not {raw!r}") from None

    def checked_env(self, env: Mapping[str, str]) -> str | None:
        """The fallback from ``env`` as the server reads it, validated (SettingError naming the
        variable); None when unset or empty."""
        raw = env.get(self.env)
        if raw is None or not raw.strip():
            return None
        return self.value(raw, source=self.env)


SETTINGS: tuple[Setting, ...] = (
    Setting("enabled", "AGENTKV_ENABLED", "on|off", "on", "off keeps vLLM's own free queue (exact LRU); "
            "stats, eviction counters and learning still run", _switch),
    Setting("horizon", "AGENTKV_HORIZON", "K", "learned", "fixes K, the dispatches looked ahead "
            "(learned: up to 24, until no first use further on is likely)", _number(int, 1, high=MAX_HORIZON)),
    Setting("r-min", "AGENTKV_R_MIN", "R", "0", "below this predictability R every group scores alike: "
            "plain LRU (0: the model ranks from the first tagged request on)", _number(float, 0, high=1)),
    Setting("refresh-interval", "AGENTKV_REFRESH_INTERVAL", "SECONDS", "0.1", "least seconds between two "
            "evaluations of the next-use model (a session event applies at once; shorter while sessions call "
            "faster: a quarter of the learned median gap)", _number(float, 0)),
    Setting("decay", "AGENTKV_DECAY", "LAMBDA", "0.01667 (1/60)", "per time resolution (the learned gap "
            "a tenth of a session's gaps are shorter than), of the recency tie-break between blocks of close value",
            _number(float, 0)),
    Setting("recognize", "AGENTKV_RECOGNIZE", "on|off", "on", "recognize the agents and sessions of "
            "untagged requests", _switch),
    Setting("strict", "AGENTKV_STRICT", "on|off", "off", "on: malformed agentkv metadata is answered 400 "
            "instead of served untagged", _switch),
    Setting("snapshot", "AGENTKV_SNAPSHOT", "PATH", "none", "learned state restored at start, saved "
            "periodically and at shutdown", _text),
    Setting("snapshot-interval", "AGENTKV_SNAPSHOT_INTERVAL", "SECONDS", "30", "seconds between periodic "
            "saves; 0: only at shutdown", _number(float, 0)),
    Setting("trace", "AGENTKV_TRACE", "PATH", "none", "append a JSON line per admitted request (block "
            "hashes, hit tokens; no prompt text), for agentkv bench bound", _text),
    Setting("stats-top-agents", "AGENTKV_STATS_TOP_AGENTS", "N", "64", "agents listed in stats and /metrics "
            "(the rest summed as (other)); also the recent sessions listed", _number(int, 1)),
    Setting("max-peers", "AGENTKV_MAX_PEERS", "N", "32", "replicas whose learned counts are kept",
            _number(int, 1)),
    Setting("peer-weight", "AGENTKV_PEER_WEIGHT", "X", "4", "the merged peers' counts (each peer's, and all "
            "together) weigh at most this multiple of the local evidence", _number(float, 0, above=True)),
    Setting("peer-api-key", "AGENTKV_PEER_API_KEY", "KEY", "this server's key", "key sent to the peers "
            "when pulling their learned counts", _text),
    Setting("peers", "AGENTKV_PEERS", "URL,URL", "none", "base URLs of other replicas whose learned counts "
            "are merged", _urls),
    Setting("sync-interval", "AGENTKV_SYNC_INTERVAL", "SECONDS", "5", "seconds between pulls from the peers",
            _number(float, 0, above=True)),
    Setting("replica", "AGENTKV_REPLICA", "NAME", "host-pid", "this replica's name in exported learned state "
            "(letters, digits, ._:@/-); with a snapshot, host-HASH of its path: kept over restarts", _wire_id),
    Setting("control", "AGENTKV_CONTROL", "ENDPOINT", "a fresh ipc socket", "ZMQ endpoint between the API "
            "server and the EngineCore", _text),
    Setting("allow-lru-fallback", "AGENTKV_ALLOW_LRU_FALLBACK", "on|off", "off", "on: on an unsupported "
            "vLLM, run as plain LRU instead of refusing to start", _switch),
)

_BY_ENV = {setting.env: setting for setting in SETTINGS}


def env_text(env: Mapping[str, str], name: str) -> str | None:
    """Variable ``name`` of ``env`` as its setting accepts it; None when unset or empty; SettingError
    (naming the variable) when refused. The server reads every setting through this, so a server
    started by hand refuses what ``agentkv serve`` refuses."""
    return _BY_ENV[name].checked_env(env)


def env_switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A switch (on/off, 1/0, true/false, yes/no) from ``env``; ``default`` when unset."""
    value = env_text(env, name)
    return default if value is None else value == "1"


def env_number(env: Mapping[str, str], name: str, default: float) -> float:
    """A number from ``env`` within its setting's bounds; ``default`` when unset."""
    value = env_text(env, name)
    return default if value is None else float(value)
