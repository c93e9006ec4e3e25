"""Which server a base URL names."""

from __future__ import annotations

from typing import Final
from urllib.parse import urlsplit, urlunsplit

__all__ = ["same_server", "server_root"]

_LOOPBACK: Final = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def same_server(url_a: str, url_b: str) -> bool:
    """Whether two base URLs name the same server (by host and port; loopback names are equal)."""
    a, b = urlsplit(str(url_a)), urlsplit(str(url_b))
    host_a = "loopback" if (a.hostname or "") in _LOOPBACK else (a.hostname or "")
    host_b = "loopback" if (b.hostname or "") in _LOOPBACK else (b.hostname or "")
    return host_a == host_b and (a.port or _default_port(a.scheme)) == (b.port or _default_port(b.scheme))


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def server_root(url: str) -> str:
    """``http://host:port`` from a base URL that may end in ``/v1``; ValueError unless it is an
    http(s) URL with a host (``localhost:8000`` would name no server: its scheme is ``localhost``)."""
    parts = urlsplit(str(url).strip().rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a server base URL is http(s)://host[:port][/v1], not {url!r}")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))
