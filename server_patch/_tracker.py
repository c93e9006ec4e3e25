"""Which agents and sessions each cached block belongs to."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from agentkv.protocol import AgentTag

__all__ = ["UNTAGGED", "AnchorLengths", "BlockInfo", "BlockTracker"]

UNTAGGED: Hashable = ("untagged",)
_MAX_AGENTS_PER_BLOCK = 16


@dataclass(slots=True)
class BlockInfo:
    """What is known about one cached block.

    A block is an *anchor* (an agent's fixed prefix, reused across sessions) when it lies
    within its agent's learned anchor length or has been seen by two sessions; a block
    seen by one session only is that session's *history*. ``sessions`` never holds more
    than two ids: two already decide the class.
    """

    agents: set[str] = field(default_factory=set)
    sessions: list[str] = field(default_factory=list)
    in_anchor: bool = False
    group: Hashable = UNTAGGED

    @property
    def kind(self) -> str:
        if not self.agents:
            return "untagged"
        return "history" if len(self.sessions) == 1 and not self.in_anchor else "anchor"

    def add(self, tag: AgentTag, in_anchor: bool) -> None:
        self.in_anchor |= in_anchor
        if len(self.agents) < _MAX_AGENTS_PER_BLOCK:
            self.agents.add(tag.agent)
        if tag.session is not None and tag.session not in self.sessions and len(self.sessions) < 2:
            self.sessions.append(tag.session)
        self.group = self._group()

    def _group(self) -> Hashable:
        # The eviction group: blocks in one group share a survival probability.
        kind = self.kind
        if kind == "anchor":
            return ("anchor", frozenset(self.agents))
        return ("history", self.sessions[0], frozenset(self.agents))


class BlockTracker:
    """Maps block_id -> BlockInfo for blocks cached or hit by tagged requests.

    Invariant: an entry describes the block's current content. Newly cached blocks
    replace whatever the id held before (``cached``); prefix hits add to it (``hit``).
    A block id without an entry, or a block without a hash, is untagged.
    """

    def __init__(self) -> None:
        self._info: dict[int, BlockInfo] = {}
        self.evictions: Counter[str] = Counter()

    def cached(self, blocks: Iterable[tuple[int, int]], tag: AgentTag | None, anchor_blocks: int) -> None:
        """Newly cached (position, block_id) pairs of one request."""
        for position, block_id in blocks:
            if tag is None:
                self._info.pop(block_id, None)
            else:
                info = BlockInfo()
                info.add(tag, position < anchor_blocks)
                self._info[block_id] = info

    def hit(self, blocks: Iterable[tuple[int, int]], tag: AgentTag, anchor_blocks: int) -> None:
        """(position, block_id) pairs a request found in the prefix cache."""
        for position, block_id in blocks:
            info = self._info.get(block_id)
            if info is None:
                info = self._info[block_id] = BlockInfo()
            info.add(tag, position < anchor_blocks)

    def group_of(self, block_id: int, has_hash: bool) -> Hashable:
        info = self._info.get(block_id) if has_hash else None
        return UNTAGGED if info is None else info.group

    def evicted(self, block_id: int, *, retired: bool) -> None:
        """Count an eviction by class; blocks of ended sessions count as ``retired``."""
        info = self._info.pop(block_id, None)
        self.evictions["retired" if retired else "untagged" if info is None else info.kind] += 1

    def blocks_by_agent(self) -> dict[str, Counter[str]]:
        """Per agent, how many tracked blocks are anchors and how many history."""
        table: dict[str, Counter[str]] = {}
        for info in self._info.values():
            for agent in info.agents:
                table.setdefault(agent, Counter())[info.kind] += 1
        return table

    def __len__(self) -> int:
        return len(self._info)


class AnchorLengths:
    """Per agent, how many leading blocks its requests share across sessions.

    The anchor of an agent is the prefix every call of it repeats (system prompt, tools,
    examples). It is learned from block hashes: the longest common prefix of the agent's
    latest request and its previous request from *another* session (two calls in one
    session also share that session's history, which is not anchor).
    """

    def __init__(self, max_blocks: int = 1024) -> None:
        self._last: dict[str, tuple[str | None, Sequence[object]]] = {}
        self._length: dict[str, int] = {}
        self._max_blocks = max_blocks

    def observe(self, agent: str, session: str | None, block_hashes: Sequence[object]) -> None:
        hashes = block_hashes[: self._max_blocks]
        previous = self._last.get(agent)
        if previous is not None and (session is None or previous[0] != session):
            common = 0
            for mine, theirs in zip(hashes, previous[1], strict=False):
                if mine != theirs:
                    break
                common += 1
            self._length[agent] = common
        if previous is None or previous[0] != session:
            self._last[agent] = (session, list(hashes))

    def length(self, agent: str) -> int:
        return self._length.get(agent, 0)

    def as_dict(self) -> dict[str, int]:
        return dict(self._length)
