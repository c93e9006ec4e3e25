"""Which agents and sessions each cached block belongs to."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Protocol

from agentkv.graph import UNTAGGED, Anchor, Group, History, LearnerConfig
from agentkv.protocol import AgentTag

__all__ = ["CONVERSATION_PREFIX", "NO_SESSION", "AnchorLengths", "BlockTracker", "merge_group"]

# every agent the model can know: a block shared by more agents than its group names could score
# below a child of an agent left out, and lose a chain its parent before its children
_MAX_AGENTS_PER_BLOCK = LearnerConfig().max_agents
_MAX_INTERNED = 100_000
# The session of what a request outside any session caches beyond its agent's anchor: no session
# id is empty, so none is ever live under it and the model scores it at the floor.
NO_SESSION = ""
# Without recognition, what a call outside any session caches beyond its agent's anchor is history of
# a conversation of its own, "#<n>": no session id has a "#", so none is ever live under it.
CONVERSATION_PREFIX = "#"


class _Block(Protocol):
    """What the tracker reads of a vLLM ``KVCacheBlock``."""

    @property
    def block_id(self) -> int: ...

    @property
    def block_hash(self) -> object: ...

    @property
    def is_null(self) -> bool: ...


def merge_group(group: Anchor | History | None, tag: AgentTag, in_anchor: bool) -> Anchor | History:
    """The eviction group of a block after ``tag``'s request cached or hit it.

    A block is an *anchor* (an agent's fixed prefix, reused across sessions) when it lies
    within its agent's learned anchor length or was seen by two requests of different
    sessions (or of none); otherwise it is its one session's *history*. What a request
    outside any session caches beyond the anchor is history of ``NO_SESSION``: only a repeat
    of the same prompt would reuse it (a warm-up holds nothing but an anchor; without
    recognition it is the call's own conversation instead, ``BlockTracker.untag_sessionless``). Blocks in one
    group share a survival probability; a block shared by several agents keeps them all (up
    to every agent the model can know) and is scored by them all (an anchor by the first use of
    any, a history by its best).
    """
    if group is None:
        agents = frozenset((tag.agent,))
        if in_anchor or tag.warmup:
            return Anchor(agents)
        return History(NO_SESSION if tag.session is None else tag.session, agents)
    agents = group.agents
    if tag.agent not in agents and len(agents) < _MAX_AGENTS_PER_BLOCK:
        agents = agents | {tag.agent}
    if type(group) is Anchor or in_anchor or tag.session is None or tag.session != group.session:
        return Anchor(agents)
    return History(group.session, agents)


class BlockTracker:
    """Maps block_id -> eviction group for blocks cached or hit by tagged requests (and what an
    untagged request caches beyond a session's history: that history).

    Invariant: the entry of a block that holds a hash describes its current content. Newly cached
    blocks replace whatever the id held before (``cached``); prefix hits merge into it (``hit``).
    A block id without an entry, or a block without a hash, is untagged: an evicted block's entry
    stays (nothing reads it while the block holds no hash) until the block is cached again. Groups
    are interned, so tracking allocates nothing per block in the steady state.

    ``untag_sessionless``: what a request outside any session caches or hits beyond its agent's
    anchor never joins ``NO_SESSION``'s history (the floor) or an anchor. For a server without
    recognition: nothing there tells a one-off query from a conversation its agent's next call
    continues, and at the floor a conversation's newest turn went first. A call given a
    ``conversation`` (``AnchorLengths.continuation`` values it) files those blocks as that history,
    and takes over the blocks of earlier conversations it continues; without one they stay untagged.
    """

    def __init__(self, *, untag_sessionless: bool = False) -> None:
        self.untag_sessionless = untag_sessionless
        self._group: dict[int, Anchor | History] = {}
        self._interned: dict[tuple[Anchor | History | None, str, str | None, bool, bool], Anchor | History] = {}
        self.evictions: Counter[str] = Counter()

    def _merge(self, group: Anchor | History | None, tag: AgentTag, in_anchor: bool) -> Anchor | History:
        key = (group, tag.agent, tag.session, in_anchor, tag.warmup)
        merged = self._interned.get(key)
        if merged is None:
            if len(self._interned) > _MAX_INTERNED:
                self._interned.clear()
            merged = self._interned[key] = merge_group(group, tag, in_anchor)
        return merged

    def cached(self, blocks: Sequence[_Block], start: int, end: int, tag: AgentTag | None,
               anchor_blocks: int, conversation: str | None = None) -> None:
        """A request's ``blocks[start:end]`` were newly cached (at those positions of its prompt)."""
        groups = self._group
        if tag is None:
            # an untagged request that continues a session's conversation: its blocks join that
            # history, so that the queue evicts them first (a group's children go first); untagged,
            # they could outscore it (an ended session's) and be left cached behind an evicted
            # parent. Beyond an anchor they stay untagged (at an anchor's value they crowd others out).
            extended = groups.get(blocks[start - 1].block_id) if start > 0 else None
            if not isinstance(extended, History):
                extended = None
            for position in range(start, end):
                block = blocks[position]
                if extended is None or block.is_null:
                    groups.pop(block.block_id, None)
                else:
                    groups[block.block_id] = extended
            return
        # a new block's group depends only on whether it lies in the anchor: two groups per request
        split = min(max(start, anchor_blocks), end)
        if split > start:
            anchor = self._merge(None, tag, True)
            for block in blocks[start:split]:
                if not block.is_null:
                    groups[block.block_id] = anchor
        if split == end:
            return
        if self._untagged_beyond_anchor(tag) and conversation is None:
            for block in blocks[split:end]:
                groups.pop(block.block_id, None)
            return
        history = self._merge(None, tag, False) if conversation is None else self._conversation(conversation, tag)
        for block in blocks[split:end]:
            if not block.is_null:
                groups[block.block_id] = history

    def _untagged_beyond_anchor(self, tag: AgentTag) -> bool:
        return self.untag_sessionless and tag.session is None and not tag.warmup

    def _conversation(self, conversation: str, tag: AgentTag, joined: frozenset[str] = frozenset()) -> History:
        """The history group of ``tag``'s call in its ``conversation``, with the agents of what it continues."""
        agents = joined if tag.agent in joined or len(joined) >= _MAX_AGENTS_PER_BLOCK else joined | {tag.agent}
        return History(conversation, agents)

    def hit(self, blocks: Iterable[_Block], tag: AgentTag, anchor_blocks: int, conversation: str | None = None) -> None:
        """A request found ``blocks`` (its prompt's leading blocks, in order) in the prefix cache."""
        groups = self._group
        previous: Anchor | History | None = None
        in_anchor = True
        merged: Anchor | History | None = None
        untagged = self._untagged_beyond_anchor(tag)
        fresh = True
        for position, block in enumerate(blocks):
            if block.is_null:
                continue
            group = groups.get(block.block_id)
            inside = position < anchor_blocks
            # runs of blocks share one (interned) group: merge once per run
            if fresh or group is not previous or inside is not in_anchor:
                previous, in_anchor, fresh = group, inside, False
                if untagged and not inside and (group is None or _is_conversation(group)):
                    # untagged stays so; an earlier conversation continued is now this call's
                    merged = None if group is None or conversation is None else \
                        self._conversation(conversation, tag, group.agents)
                else:
                    merged = self._merge(group, tag, inside)
            if merged is not None:
                groups[block.block_id] = merged

    def group_of(self, block: _Block) -> Group:
        """The eviction group of a block: untagged unless tracked and still holding a hash."""
        if block.block_hash is None:
            return UNTAGGED
        return self._group.get(block.block_id, UNTAGGED)

    def evicted(self, blocks: Sequence[_Block], runs: Iterable[tuple[object, int]],
                ended: Callable[[str], bool]) -> None:
        """``blocks`` left the free queue, in ``runs`` of (group, count) in their order (None: the
        queue knows no group for them). Those still holding a hash are evicted: counts them by class;
        history of sessions ``ended`` says are over counts as ``retired``.

        Every block of an anchor's or a history's run holds a hash (the queue files a free block
        whose hash is dropped as uncached), so such a run counts whole, without reading its blocks.
        Entries stay: the pool drops an evicted block's hash, which is all ``group_of`` and
        ``blocks_by_agent`` go by, and the block's next caching replaces its entry."""
        evictions = self.evictions
        start = 0
        for group, count in runs:
            if type(group) is History:
                evictions["retired" if ended(group.session) else "history"] += count
            elif type(group) is Anchor:
                evictions["anchor"] += count
            else:
                self._classify_evicted(blocks[start:start + count], ended)
            start += count

    def _classify_evicted(self, blocks: Iterable[_Block], ended: Callable[[str], bool]) -> None:
        """Count the evicted ones of ``blocks`` by their tracked groups."""
        groups, evictions = self._group, self.evictions
        previous: Anchor | History | None = None
        kind, run = "untagged", 0
        for block in blocks:
            if block.block_hash is None:
                continue
            group = groups.get(block.block_id)
            if group is not previous:  # runs of blocks share one (interned) group: classify once per run
                if run:
                    evictions[kind] += run
                previous, run = group, 0
                if group is None:
                    kind = "untagged"
                elif type(group) is History:
                    kind = "retired" if ended(group.session) else "history"
                else:
                    kind = "anchor"
            run += 1
        if run:
            evictions[kind] += run

    def blocks_by_agent(self, holds_hash: Callable[[int], bool]) -> dict[str, Counter[str]]:
        """Per agent, how many tracked blocks are anchors and how many history, of those whose block
        ``holds_hash`` (by id; an evicted block's entry stays until the block is cached again)."""
        table: dict[str, Counter[str]] = {}
        cached = Counter(group for block_id, group in self._group.items() if holds_hash(block_id))
        for group, count in cached.items():  # one pass per distinct (interned) group
            kind = _kind(group)
            for agent in group.agents:
                counts = table.get(agent)
                if counts is None:
                    counts = table[agent] = Counter()
                counts[kind] += count
        return table


def _is_conversation(group: Anchor | History) -> bool:
    return type(group) is History and group.session.startswith(CONVERSATION_PREFIX)


def _kind(group: Anchor | History) -> str:
    return "anchor" if type(group) is Anchor else "history"


class AnchorLengths:
    """Per agent, how many leading blocks its requests share across sessions.

    The anchor of an agent is the prefix every call of it repeats (system prompt, tools,
    examples). It is learned from block hashes: the longest common prefix of the agent's
    latest request and its previous request from *another* session (two calls in one
    session also share that session's history, which is not anchor). A call outside any
    session names none, so it is compared with each of the agent's last ``window`` calls and
    the anchor is the shortest prefix it shares with one of them: two calls that continue one
    conversation share that conversation too, and calls from interleaved conversations rarely
    all continue one; a call that shares nothing (one before a changed system prompt) is not
    counted. Two sessions that happen to open alike (the same task from a short list) share more
    than the anchor, and such pairs must not stretch it (nor what is filed, valued and warmed as
    anchor) unless four of the last five pairs did: the length is the second smallest
    of the agent's last ``agreement`` measurements (the only one while there is one). A
    measurement shorter than the anchor means the prefix changed (a new system prompt, another
    app calling an agent of that name) or the anchor had been stretched: the measurements start
    over from it. The first measurement after a change compares the old prompt with the new; being
    the smallest, it does not count once a second one exists, so two sessions teach a new anchor;
    but an agent whose pairs agreed on none (two measurements of 0: no anchor, or two apps calling
    agents of one name) grows one as a stretch does, once four of the last five pairs share it.
    At most ``max_agents`` agents are remembered; the least recently observed one is forgotten first.

    The same comparison tells which of those calls a call continues (the one it shares most beyond
    the anchor with; none if it shares no more than the anchor): per agent, how often its next call
    continues the conversation of its k-th latest call, what ``continuation`` values that
    conversation's history by (a server without recognition, which sees no session to value it by).
    """

    def __init__(self, max_blocks: int = 1024, max_agents: int = 1024, window: int = 4, agreement: int = 5) -> None:
        self._last: OrderedDict[str, tuple[str | None, Sequence[object]]] = OrderedDict()
        self._sessionless: dict[str, deque[Sequence[object]]] = {}  # the agent's latest calls without a session
        self._conversations: dict[str, deque[str | None]] = {}  # and their conversations (None: not given)
        self._owner: dict[str, str] = {}  # the conversations in those windows -> their agents
        # per agent: its calls measured against its window ([0]) and those that continued its k-th latest call ([k])
        self._continued: dict[str, list[int]] = {}
        self._measured: dict[str, deque[int]] = {}  # the agent's latest measurements, newest last
        self._length: dict[str, int] = {}  # their second smallest, kept: read for every cached run of blocks
        self._max_blocks = max_blocks
        self._max_agents = max_agents
        self._window = window
        self._agreement = agreement

    def observe(self, agent: str, session: str | None, block_hashes: Sequence[object],
                conversation: str | None = None) -> None:
        """One call of ``agent``; ``conversation`` names what a call outside any session caches
        beyond the anchor (``BlockTracker.cached``), if it is to be valued by ``continuation``."""
        hashes = list(block_hashes[: self._max_blocks])  # one copy, kept by _last and the window alike
        previous = self._last.get(agent)
        if session is None:
            recent = self._sessionless.setdefault(agent, deque(maxlen=self._window))
            if previous is not None:
                # the latest call is already in the window when it too named no session
                others = recent if recent and recent[-1] is previous[1] else [*recent, previous[1]]
                shared = [_common_prefix(hashes, other) for other in others]
                self._measure(agent, min((n for n in shared if n), default=0))
                self._count_continued(agent, shared[:len(recent)])
            recent.append(hashes)
            self._enter_window(agent, conversation)
        elif previous is not None and previous[0] != session:
            self._measure(agent, _common_prefix(hashes, previous[1]))
        if previous is None or session is None or previous[0] != session:
            self._last[agent] = (session, hashes)
        self._last.move_to_end(agent)
        if len(self._last) > self._max_agents:
            forgotten, _ = self._last.popitem(last=False)
            self._length.pop(forgotten, None)
            self._measured.pop(forgotten, None)
            self._sessionless.pop(forgotten, None)
            self._continued.pop(forgotten, None)
            for dropped in self._conversations.pop(forgotten, ()):
                self._owner.pop(dropped, None)  # type: ignore[arg-type]

    def _measure(self, agent: str, length: int) -> None:
        measured = self._measured.setdefault(agent, deque(maxlen=self._agreement))
        if length < self._length.get(agent, 0):
            measured.clear()  # the prefix changed, or the anchor had been stretched
        measured.append(length)
        # the second smallest: one measurement across a changed prompt (the first after it, which
        # may find no change when nothing was learned yet) does not hold the anchor down either
        self._length[agent] = sorted(measured)[min(1, len(measured) - 1)]

    def _count_continued(self, agent: str, shared: Sequence[int]) -> None:
        """A call without a session shared ``shared`` blocks with each of its agent's window, oldest first."""
        counts = self._continued.setdefault(agent, [0] * (self._window + 1))
        counts[0] += 1
        beyond = [(n, position) for position, n in enumerate(shared) if n > self._length[agent]]
        if beyond:
            _, position = max(beyond)  # the longest shared, the newest among equals
            counts[len(shared) - position] += 1

    def _enter_window(self, agent: str, conversation: str | None) -> None:
        window = self._conversations.setdefault(agent, deque(maxlen=self._window))
        if len(window) == window.maxlen and (dropped := window[0]) is not None:
            self._owner.pop(dropped, None)
        window.append(conversation)
        if conversation is not None:
            self._owner[conversation] = agent

    def continuation(self, session: str) -> float | None:
        """The chance that the next call of its agent continues ``session``'s conversation, when it
        is one (None: a session): the share of the agent's calls that continued the call as old as it
        is (its k-th latest), 0 once k calls of the agent came after it or while nothing was measured."""
        if not session.startswith(CONVERSATION_PREFIX):
            return None
        agent = self._owner.get(session)
        if agent is None or not (counts := self._continued.get(agent)) or not counts[0]:
            return 0.0
        window = self._conversations[agent]
        age = len(window) - next(i for i in range(len(window) - 1, -1, -1) if window[i] == session)
        return counts[age] / counts[0]

    def length(self, agent: str) -> int:
        return self._length.get(agent, 0)

    def recent(self, count: int) -> list[str]:
        """The ``count`` agents observed most recently, newest first."""
        return list(islice(reversed(self._last), count))

    def anchor_hashes(self, agent: str) -> Sequence[object]:
        """The block hashes of ``agent``'s anchor: its latest session's first ``length`` blocks, or
        while no length is learned all of that first call's (the anchor is a prefix of them)."""
        last = self._last.get(agent)
        if last is None:
            return ()
        length = self.length(agent)
        return last[1][:length] if length else last[1]

    def as_dict(self) -> dict[str, int]:
        return dict(self._length)


def _common_prefix(mine: Sequence[object], theirs: Sequence[object]) -> int:
    common = 0
    for a, b in zip(mine, theirs, strict=False):
        if a != b:
            break
        common += 1
    return common
