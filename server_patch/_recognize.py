"""Recognize the agent and the session of an untagged request from its prompt alone.

Pure Python (no vLLM import): a request is seen as its leading block hashes (opaque,
hashable, chained from the first token, as vLLM's prefix cache computes them) and its
prompt token ids.

* **Agents.** The leading block hashes of every request enter a prefix tree. The
  *preamble* is the chain every agent shares (chat template, shared system text): the
  tree's path from the root while it has a single *frequent* child. Where it first splits
  into several frequent children, each child is an agent's *anchor* and its identity:
  ``fp:`` + a short hash of that block, or the tagged agent name last seen on it (so a
  mixed workload learns one model). Agents sharing a long preamble stay apart (they split
  after it); an anchor whose tail varies (a date, a user name) stays one agent, because
  the identity is the first block after the preamble, before any varying part.
* **Anchor end.** Under an agent's identity block, the first node with two children is
  where its requests stop sharing tokens across sessions; the token offset inside the next
  block is the shortest common prefix of those children's tokens (as the prefix-stability
  lint defines the stable part). What follows is the session's history.
* **Sessions.** ``X-Session-ID`` when present. Otherwise the history after the anchor is
  cut into content-defined chunks (a boundary before every token whose mixed id is 0 mod
  ``chunk``), so two agents that put different anchors in front of the same history cut
  it identically after the first boundary. A request continues the session whose latest
  request's chunks it starts with; otherwise it opens a new session. The parent is the
  session's previous recognized agent.

* **Tagged requests** teach the tree (shape, counts, their agent's name on its anchor block)
  lazily: their leading blocks wait among the latest ``pending_tagged`` and enter the tree, in
  arrival order, just before the next untagged request is recognized. The tree is the one
  eager learning builds, except that of more than ``pending_tagged`` tagged requests in a row
  only the latest count; a server whose clients all send tags never builds a tree.

Bounded: the tree keeps at most ``max_nodes`` nodes and ``max_depth`` blocks per request,
the session table ``max_sessions`` sessions, the head index one entry per session, each
evicting its least recently used entries; at most ``max_history_tokens`` tokens of a
request are chunked. Adversarial prompts only churn these LRU tables, and a request is
labelled only through a block that enough requests share (``min_count``, ``min_share``).
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Recognition", "RecognizeConfig", "Recognizer", "chunk_chain"]

_MIX = 0x9E3779B1  # Knuth's multiplicative hash: spreads token ids before the boundary test
_MAX_CHILDREN = 256  # children kept per tree node for the frequency test (at least 1 / min_share)


@dataclass(frozen=True)
class RecognizeConfig:
    """Caps and thresholds of recognition (defaults fit agents down to 0.5% of the calls, thousands of sessions)."""

    max_nodes: int = 20_000  # prefix-tree nodes (one per distinct leading block)
    max_depth: int = 128  # leading blocks of a request entered in the tree
    max_sessions: int = 4096
    min_count: int = 3  # requests through a block before it can be an agent's anchor
    min_share: float = 0.005  # ... and this share of its parent's requests
    chunk: int = 8  # mean history chunk length in tokens (a power of two)
    max_history_tokens: int = 1024  # history tokens chunked per request
    resplit_every: int = 32  # requests between recomputations of the preamble
    halve_every: int = 20_000  # requests between halvings of the tree's counts (recency)
    recent: int = 2048  # recognitions kept for inspection (``op: recognized``)
    pending_tagged: int = 256  # tagged requests kept until an untagged one needs the tree
    max_quoted_chunks: int = 65_536  # output chunks indexed to find the session an answer is quoted in
    min_quoted_chunks: int = 2  # chunks of one answer a prompt must quote to join its session

    def __post_init__(self) -> None:
        if self.chunk < 2 or self.chunk & (self.chunk - 1):
            raise ValueError("chunk must be a power of two >= 2")
        if min(self.max_nodes, self.max_depth, self.max_sessions, self.min_count, self.resplit_every,
               self.halve_every, self.recent, self.pending_tagged, self.max_quoted_chunks,
               self.min_quoted_chunks) < 1 or not 0.0 <= self.min_share < 1.0:
            raise ValueError("caps and counts must be >= 1 and 0 <= min_share < 1")


@dataclass(frozen=True, slots=True)
class Recognition:
    """What recognition says about one untagged request (``agent`` None: not recognized)."""

    agent: str | None
    session: str | None
    parent: str | None  # "" for a session's first dispatch
    step: int | None  # the session's dispatch counter: a repeated agent keeps its step


class _Node:
    __slots__ = ("branched", "children", "count", "depth", "fan", "key", "name", "parent", "seen", "split", "tokens")

    def __init__(self, key: Hashable, parent: _Node | None, depth: int, tokens: tuple[int, ...]) -> None:
        self.key = key
        self.parent = parent
        self.depth = depth  # block index of this node (the root is -1)
        self.tokens = tokens  # the block's token ids (for the token offset of a split below it)
        self.count = 0
        self.seen = 0  # the recognizer's request counter when a request last passed through it
        self.fan = 0  # distinct children ever created
        self.children: dict[Hashable, _Node] = {}
        self.split: int | None = None  # shortest common token prefix of its children's blocks
        self.name: str | None = None  # the tagged agent last seen through this block
        self.branched = False  # some node at or below it has two children (requests diverge there)


class _Session:
    __slots__ = ("agent", "head", "step")

    def __init__(self) -> None:
        self.agent = ""
        self.step = -1
        self.head: int | None = None  # chunk-chain hash of its latest request's history


def _chunks(tokens: Sequence[int], start: int, limit: int, chunk: int) -> list[bytes]:
    """The closed content-defined chunks of ``tokens[start:start+limit]``, as bytes.

    A boundary precedes every token whose mixed id is 0 mod ``chunk``; the first chunk (from
    ``start`` to the first boundary) and the last (open) one are left out, so the chunks depend
    on the tokens, not on where the window starts or ends.
    """
    window = np.asarray(tokens[start : start + limit], dtype=np.int64)
    cuts = np.flatnonzero((((window * _MIX) >> 7) & (chunk - 1)) == 0).tolist()
    data = window.tobytes()
    return [data[8 * begin : 8 * end] for begin, end in itertools.pairwise(cuts)]


def chunk_chain(tokens: Sequence[int], start: int, limit: int, chunk: int) -> list[int]:
    """Chained hashes of the closed content-defined chunks of ``tokens[start:start+limit]``: any
    start inside the first chunk and any continuation after the end give the same chain. Hashes
    are only comparable within one process (bytes hashing is salted per process)."""
    return _chained(_chunks(tokens, start, limit, chunk))


def _chained(chunks: Sequence[bytes]) -> list[int]:
    out: list[int] = []
    chain = 0
    for data in chunks:
        chain = hash((chain, data))
        out.append(chain)
    return out


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Recognizer:
    """Online agent and session recognition for untagged requests.

    Invariants: ``len(nodes) <= max_nodes``, ``len(sessions) <= max_sessions``,
    ``len(heads) <= len(sessions)``, ``len(_pending) <= pending_tagged``; every node in
    ``nodes`` hangs below the root or below a node that was evicted (then it is never walked
    from the root again and ages out). The
    preamble split node ``_split`` is recomputed every ``resplit_every`` requests.
    """

    def __init__(self, config: RecognizeConfig | None = None) -> None:
        self.config = config or RecognizeConfig()
        self.root = _Node(None, None, -1, ())
        self.nodes: dict[Hashable, _Node] = {}
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self.heads: dict[int, str] = {}
        # (request id, agent, session, prompt tokens) of the latest requests, for inspection
        self.recent: deque[tuple[str, str | None, str | None, int]] = deque(maxlen=self.config.recent)
        # (agent, leading block hashes, their tokens, block size) of tagged requests not yet in the tree
        self._pending: deque[tuple[str, Sequence[Hashable], Sequence[int], int]] = deque(
            maxlen=self.config.pending_tagged)
        self._split: _Node = self.root
        self._seen = 0
        self._session_ids = 0
        # a client's X-Session-ID may be "fs:1" too: recognized ids carry this process's own word
        self._session_prefix = f"fs:{secrets.token_hex(4)}:"
        self.recognized = 0
        self.unrecognized = 0
        self.followed = 0  # requests that continued an earlier request's session
        self.quoting = 0  # ... found by an earlier answer they quote
        # chunk of an answer -> its session: where a prompt that quotes it belongs
        self.quoted: OrderedDict[int, str] = OrderedDict()

    # -- the prefix tree -------------------------------------------------------------------

    def _insert(self, block_hashes: Sequence[Hashable], tokens: Sequence[int], block_size: int) -> list[_Node]:
        """Walk (and extend) the tree along the request's leading blocks; returns its path."""
        nodes, path = self.nodes, []
        self._seen += 1
        tick = self._seen
        parent = self.root
        parent.count += 1
        for depth, key in enumerate(block_hashes[: self.config.max_depth]):
            node = nodes.get(key)
            if node is None:
                block = tuple(tokens[depth * block_size : (depth + 1) * block_size])
                node = nodes[key] = _Node(key, parent, depth, block)
                self._adopt(parent, node)
            node.count += 1
            node.seen = tick
            path.append(node)
            parent = node
        if len(nodes) > self.config.max_nodes:
            self._evict()
        if self._seen % self.config.halve_every == 0:
            self._halve()
        # early on every request may move the preamble; later it is settled and checked now and then
        learning = self._seen < 16 * self.config.resplit_every
        if learning or self._seen % self.config.resplit_every == 0 or (
                self._split is not self.root and self._split.key not in nodes):
            self._split = self._find_split()
        return path

    def _adopt(self, parent: _Node, child: _Node) -> None:
        parent.fan += 1
        if parent.fan == 2:
            node: _Node | None = parent
            while node is not None and not node.branched:
                node.branched = True
                node = node.parent
        if parent.children:
            reference = next(iter(parent.children.values())).tokens
            common = _common(reference, child.tokens)
            parent.split = common if parent.split is None else min(parent.split, common)
        if len(parent.children) < _MAX_CHILDREN:
            parent.children[child.key] = child

    def _evict(self) -> None:
        """Drop the least recently seen eighth of the nodes (amortized O(log n) per node)."""
        by_age = sorted(self.nodes.values(), key=lambda n: n.seen)
        for node in by_age[: max(1, len(by_age) - self.config.max_nodes + self.config.max_nodes // 8)]:
            del self.nodes[node.key]
            if node.parent is not None:
                node.parent.children.pop(node.key, None)
            node.parent = None

    def _halve(self) -> None:
        self.root.count //= 2
        for node in self.nodes.values():
            node.count //= 2

    def _branches(self, parent: _Node) -> list[_Node]:
        """Children of ``parent`` that look like anchors: frequent, and shared by diverging requests
        (a session's history is a chain: each request extends the previous one)."""
        floor = max(self.config.min_count, self.config.min_share * parent.count)
        return [c for c in parent.children.values() if c.count >= floor and c.branched]

    def _find_split(self) -> _Node:
        """The end of the preamble: the first node, from the root, with two anchor-like children."""
        node = self.root
        for _ in range(self.config.max_depth):
            frequent = self._branches(node)
            if len(frequent) != 1:
                return node if len(frequent) >= 2 else self.root
            node = frequent[0]
        return self.root

    @property
    def preamble_blocks(self) -> int:
        return self._split.depth + 1

    def _identity(self, path: list[_Node], named: bool = False) -> _Node | None:
        """The request's anchor block: its first block after the deepest split on its path into
        anchor-like children, if frequent (``named``: the client named the agent, so a rarely
        called one counts too). The first split ends the preamble every agent shares;
        a deeper one ends a preamble only some agents share (a team's), so agents behind the
        same team text stay apart. Below an agent's anchor the children are session histories
        (chains, not anchor-like), which ends the walk."""
        depth = self._split.depth + 1
        if depth >= len(path) or (depth > 0 and path[depth - 1] is not self._split):
            return None
        node = path[depth]
        floor = max(self.config.min_count, self.config.min_share * self._split.count)
        # a named agent's rare block counts once the preamble is known (before, it may be the preamble's)
        if node.count < floor and not (named and len(self._branches(self._split)) >= 2):
            return None
        for here, below in itertools.pairwise(path[depth:]):
            branches = self._branches(here)
            if below not in branches:
                break
            if len(branches) >= 2:
                node = below
        return node

    @staticmethod
    def _label(node: _Node) -> str:
        if node.name is not None:
            return node.name
        digest = hashlib.blake2b(repr(node.key).encode(), digest_size=5).hexdigest()
        node.name = f"fp:{digest}"
        return node.name

    def _history_start(self, path: list[_Node], identity: _Node, block_size: int) -> int:
        """Token offset where the request's history begins: the agent's first split below its anchor block."""
        for node in path[identity.depth :]:
            if node.fan >= 2:
                return (node.depth + 1) * block_size + (node.split or 0)
        return len(path) * block_size

    # -- requests --------------------------------------------------------------------------

    def observe_tagged(self, agent: str, block_hashes: Sequence[Hashable], tokens: Sequence[int],
                       block_size: int) -> None:
        """A tagged request: it will shape the tree and name its anchor block after its agent
        (once an untagged request needs the tree; only its leading blocks are kept until then)."""
        depth = self.config.max_depth
        self._pending.append((agent, block_hashes[:depth], tokens[: depth * block_size], block_size))

    def _learn_tagged(self) -> None:
        """Enter the pending tagged requests in the tree, oldest first."""
        pending = self._pending
        while pending:
            agent, block_hashes, tokens, block_size = pending.popleft()
            identity = self._identity(self._insert(block_hashes, tokens, block_size))
            if identity is not None:
                identity.name = agent

    def recognize(self, request_id: str, block_hashes: Sequence[Hashable], tokens: Sequence[int],
                  block_size: int, session_id: str | None = None, agent: str | None = None) -> Recognition:
        """Recognize one untagged request, or the session of one tagged with ``agent`` alone
        (call once per request, in arrival order)."""
        self._learn_tagged()
        path = self._insert(block_hashes, tokens, block_size)
        identity = self._identity(path, named=agent is not None)
        if identity is None:
            self.unrecognized += 1
            self.recent.append((request_id, None, session_id, len(tokens)))
            return Recognition(None, session_id, None, None)
        if agent is not None:
            identity.name = agent
        agent = self._label(identity)
        if session_id is not None:
            session = session_id
            state = self._session(session)
        else:
            start = self._history_start(path, identity, block_size)
            chunks = _chunks(tokens, start, self.config.max_history_tokens, self.config.chunk)
            chain = _chained(chunks)
            session, state = self._continued(chain, chunks)
            if state.head is not None and self.heads.get(state.head) == session:
                del self.heads[state.head]
            state.head = chain[-1] if chain else None
            if state.head is not None:
                self.heads[state.head] = session
        parent = state.agent
        if agent != state.agent:
            state.step += 1
        state.agent = agent
        self.recognized += 1
        self.recent.append((request_id, agent, session, len(tokens)))
        return Recognition(agent, session, parent, state.step)

    def _session(self, session: str) -> _Session:
        state = self.sessions.get(session)
        if state is None:
            state = self.sessions[session] = _Session()
            while len(self.sessions) > self.config.max_sessions:
                old, dropped = self.sessions.popitem(last=False)
                if dropped.head is not None and self.heads.get(dropped.head) == old:
                    del self.heads[dropped.head]
        else:
            self.sessions.move_to_end(session)
        return state

    def _continued(self, chain: list[int], chunks: Sequence[bytes]) -> tuple[str, _Session]:
        """The session whose latest request's history this one starts with (the longest), else the
        session whose earlier answers this one quotes most, or a new one. The parent is the
        session's latest agent either way: a prompt may quote several earlier answers, and the one
        quoted most (a long one, from turns ago) need not be the latest."""
        for key in reversed(chain):
            session = self.heads.get(key)
            if session is not None and session in self.sessions:
                self.followed += 1
                return session, self._session(session)
        if self.quoted:
            votes: dict[str, int] = {}
            for data in chunks:
                found = self.quoted.get(hash(data))
                if found is not None and found in self.sessions:
                    votes[found] = votes.get(found, 0) + 1
            if votes:
                session, count = max(votes.items(), key=lambda item: item[1])
                if count >= self.config.min_quoted_chunks:
                    self.quoting += 1
                    return session, self._session(session)
        self._session_ids += 1
        session = f"{self._session_prefix}{self._session_ids:x}"
        return session, self._session(session)

    def observe_answer(self, session: str, output_tokens: Sequence[int]) -> None:
        """A recognized request in ``session`` answered ``output_tokens``: a later prompt that
        quotes them (a hand-off: the next agent is given this answer) joins the session."""
        quoted, cap = self.quoted, self.config.max_quoted_chunks
        for data in _chunks(output_tokens, 0, self.config.max_history_tokens, self.config.chunk):
            key = hash(data)
            quoted[key] = session
            quoted.move_to_end(key)
        while len(quoted) > cap:
            quoted.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        return {
            "recognized_requests": self.recognized,
            "unrecognized_requests": self.unrecognized,
            "followed_requests": self.followed,
            "quoting_requests": self.quoting,
            "preamble_blocks": self.preamble_blocks,
            "tree_nodes": len(self.nodes),
            "sessions": len(self.sessions),
            "max_nodes": self.config.max_nodes,
            "max_sessions": self.config.max_sessions,
        }
