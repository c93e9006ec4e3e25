"""Protocol ids from arbitrary framework names, and the UNSET sentinel."""

from __future__ import annotations

import hashlib
import re
from typing import Final

from agentkv.protocol import MAX_ID_LENGTH

__all__ = ["UNSET", "Unset", "sanitize_id"]

_INVALID_ID_CHARS: Final = re.compile(r"[^A-Za-z0-9._:@/-]")


class Unset:
    """The type of :data:`UNSET` (one instance)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = Unset()
"""Sentinel: "work it out from the session's lineage" (as opposed to ``None`` = unknown)."""


def sanitize_id(value: object, *, fallback: str = "_") -> str:
    """Make any framework name a valid protocol id (1-128 chars of ``[A-Za-z0-9._:@/-]``).

    Invalid characters become ``_``. A name with characters beyond ASCII, and one longer than 128
    characters (then cut), gets a short hash suffix of the whole name, so that names in another
    script (``"研究员"``, ``"审稿人"``) or sharing a long prefix stay distinct. Valid ids are unchanged
    (so sanitizing twice changes nothing).
    """
    text = str(value) if value is not None else ""
    clean = _INVALID_ID_CHARS.sub("_", text) or fallback
    if not text.isascii() or len(clean) > MAX_ID_LENGTH:
        digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        clean = f"{clean[: MAX_ID_LENGTH - 9]}-{digest}"
    return clean
