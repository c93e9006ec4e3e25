"""Containers with a size cap: a dict that forgets its least recently seen keys first, and a set of
changed keys that gives up listing them past its cap."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, KeysView, MutableMapping
from typing import Generic, TypeVar

__all__ = ["BoundedDict", "ChangeSet"]

K = TypeVar("K")
V = TypeVar("V")


class BoundedDict(MutableMapping[K, V]):
    """A mapping of at most ``cap`` keys, evicting the least recently seen key first.

    Invariant: ``len(self) <= cap`` after every call. A key is *seen* when it is set
    (``d[k] = v``, new or not) or :meth:`touch`-ed; reading (``d[k]``, ``get``, ``in``) does not
    count, so lookups never change which key goes next. Iteration runs from the least to the most
    recently seen key. Not thread-safe: callers that share one hold their own lock.
    """

    __slots__ = ("_cap", "_data")

    def __init__(self, cap: int) -> None:
        if cap < 0:
            raise ValueError(f"cap must be >= 0, not {cap}")
        self._cap = cap
        self._data: OrderedDict[K, V] = OrderedDict()

    @property
    def cap(self) -> int:
        return self._cap

    @cap.setter
    def cap(self, cap: int) -> None:
        """A new cap; the least recently seen keys beyond it go at once."""
        if cap < 0:
            raise ValueError(f"cap must be >= 0, not {cap}")
        self._cap = cap
        while len(self._data) > cap:
            self._data.popitem(last=False)

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    # the Mapping mixins answer a miss by catching a KeyError: ~10x slower on the refresh path
    def __contains__(self, key: object) -> bool:
        return key in self._data

    def get(self, key: K, default: V | None = None) -> V | None:  # type: ignore[override]
        return self._data.get(key, default)

    def keys(self) -> KeysView[K]:
        """A live view of the keys; its ``in`` runs in C (the refresh tests every history group)."""
        return self._data.keys()

    def __setitem__(self, key: K, value: V) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self._cap:
            self._data.popitem(last=False)

    def __delitem__(self, key: K) -> None:
        del self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def touch(self, key: K) -> None:
        """Mark ``key`` as the most recently seen (KeyError if absent)."""
        self._data.move_to_end(key)

    def __repr__(self) -> str:
        return f"BoundedDict(cap={self._cap}, {dict(self._data)!r})"


class ChangeSet(Generic[K]):
    """The keys changed since the last :meth:`take`, up to ``cap`` of them.

    Invariant: ``_changed`` holds every key added since the last ``take``, or is None once more
    than ``cap`` were (a reader that did not ask for a while then takes everything as changed).
    """

    __slots__ = ("_cap", "_changed")

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._changed: set[K] | None = set()

    def add(self, key: K) -> None:
        changed = self._changed
        if changed is not None:
            changed.add(key)
            if len(changed) > self._cap:
                self._changed = None

    def take(self) -> set[K] | None:
        """The keys changed since the last call (None: too many to list); the next call starts afresh."""
        changed, self._changed = self._changed, set()
        return changed
