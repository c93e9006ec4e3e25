"""A tape prepared for replay: token ids, vLLM block hashes, segment kinds, future uses and the app's graph."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import BlockHash, hash_block_tokens
from vllm.v1.request import Request

from agentkv.client import sanitize_id

from .tape import Tape, TapeRequest, segment_kind
from .topologies import AGENTS, TOPOLOGIES, topology

__all__ = ["TapePlan", "wire_ids"]

_log = logging.getLogger("agentkv.bench")

# The parent of a tape's first block (vLLM's NONE_HASH is random per process unless
# PYTHONHASHSEED is set; a constant root keeps block hashes identical across processes).
_ROOT = BlockHash(sha256(("agentkv-tape", 1)))


class TapePlan:
    """Everything a replay needs from a tape, computed once: token ids, block hashes
    (vLLM's ``hash_block_tokens`` with sha256), segment kinds and the future-use index."""

    def __init__(self, tape: Tape) -> None:
        self.tape = tape
        self.requests: list[TapeRequest] = wire_ids(tape.requests, tape.name)
        self.block_size = bs = tape.block_size
        self._segment_cache: dict[str, list[int]] = {}
        self._hash_memo: dict[tuple[bytes, tuple[int, ...]], BlockHash] = {}
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self.hashes: dict[str, list[BlockHash]] = {}
        self.anchor_spans: list[list[tuple[int, int]]] = []
        self.kind_of_hash: dict[bytes, str] = {}
        self.depth_of_hash: dict[bytes, int] = {}  # the block's position in its prompt
        self.uses: dict[bytes, list[int]] = {}
        for index, request in enumerate(self.requests):
            prompt = self.tokens_of(request.segments)
            output = self._segment(request.output_key, request.output_tokens)
            hashes = self._hash_chain(prompt + output)
            self.prompts.append(prompt)
            self.outputs.append(output)
            self.hashes[request.id] = hashes
            spans, position = [], 0
            for key, n in request.segments:
                if segment_kind(key) == "anchor":
                    spans.append((position, position + n))
                position += n
            self.anchor_spans.append(spans)
            for b, block_hash in enumerate(hashes):
                if block_hash not in self.kind_of_hash:
                    inside = any(lo <= b * bs and (b + 1) * bs <= hi for lo, hi in spans)
                    self.kind_of_hash[block_hash] = "anchor" if inside else "history"
                    self.depth_of_hash[block_hash] = b  # a chained hash: the same depth in every prompt
            for block_hash in hashes[: len(prompt) // bs]:
                self.uses.setdefault(block_hash, []).append(index)
        # Each conversation is a chain of requests, each arriving after the previous one's answer
        # (and tool gap): by the tape's own session ids (two that sanitize alike are two chains), a
        # session id used again with ``parent: ""`` starting a new conversation (docs/tapes.md),
        # unless it continues the session's first dispatch (its tool loop).
        self.next_in_session: list[int | None] = [None] * len(self.requests)
        self.conversation_starts: list[int] = []
        last: dict[str, int] = {}
        for index, (original, request) in enumerate(zip(tape.requests, self.requests, strict=True)):
            previous = last.get(original.session)
            if previous is None or (request.parent == "" and not self._continues(previous, request)):
                self.conversation_starts.append(index)
            else:
                self.next_in_session[previous] = index
            last[original.session] = index
        self.max_request_blocks = max(-(-(len(p) + len(o)) // bs) for p, o in zip(self.prompts, self.outputs,
                                                                                     strict=True))
        self.anchor_blocks = sum(1 for kind in self.kind_of_hash.values() if kind == "anchor")

    def _continues(self, previous: int, request: TapeRequest) -> bool:
        """Whether ``request`` (``parent: ""``) continues the session's first dispatch, which request
        ``previous`` of its session belongs to (a tool loop: the same agent and step)."""
        before = self.requests[previous]
        return (not before.abandoned and before.parent == "" and before.agent == request.agent
                and before.step == request.step)

    # -- tokens and hashes -------------------------------------------------------------

    def _segment(self, key: str, n_tokens: int) -> list[int]:
        tokens = self._segment_cache.get(key)
        if tokens is None or len(tokens) < n_tokens:
            tokens = self._segment_cache[key] = self.tape.tokens(key, n_tokens)
        return tokens[:n_tokens]

    def tokens_of(self, segments: Sequence[tuple[str, int]]) -> list[int]:
        out: list[int] = []
        for key, n in segments:
            out.extend(self._segment(key, n))
        return out

    def _hash_chain(self, tokens: list[int]) -> list[BlockHash]:
        bs, memo = self.block_size, self._hash_memo
        parent, out = _ROOT, []
        for start in range(0, len(tokens) - bs + 1, bs):
            key = (parent, tuple(tokens[start : start + bs]))
            block_hash = memo.get(key)
            if block_hash is None:
                block_hash = memo[key] = hash_block_tokens(sha256, parent, key[1])
            out.append(block_hash)
            parent = block_hash
        return out

    def extra_hasher(self, tokens: list[int]) -> Callable[[Request], list[BlockHash]]:
        """vLLM block_hasher of an extra request (a warm-up) of ``tokens``: kept apart from the tape's
        requests' (whose ids may be anything, ``warmup-1`` too)."""
        hashes = self._hash_chain(tokens)
        return lambda request: hashes[len(request.block_hashes) : request.num_tokens // self.block_size]

    def hasher(self, request: Request) -> list[BlockHash]:
        """vLLM block_hasher: the request's new full-block hashes, precomputed."""
        have = len(request.block_hashes)
        return self.hashes[request.request_id][have : request.num_tokens // self.block_size]

    # -- workload facts --------------------------------------------------------------------

    def anchor_hit_tokens(self, index: int, hit: int) -> int:
        return sum(max(0, min(hi, hit) - lo) for lo, hi in self.anchor_spans[index])

    def anchor_segments(self, request: TapeRequest) -> tuple[tuple[str, int], ...]:
        """The request's leading anchor segments (what a warm-up coordinator records per agent)."""
        out = []
        for key, n in request.segments:
            if segment_kind(key) != "anchor":
                break
            out.append((key, n))
        return tuple(out)

    def is_handoff(self, request: TapeRequest) -> bool:
        """True if the session continues with another dispatch after this request (a new step; a
        tape without steps: another agent)."""
        following = self.next_in_session[self._index_of(request)]
        if following is None:
            return False
        after = self.requests[following]
        return after.agent != request.agent if request.step is None else after.step != request.step

    def is_tool_call(self, request: TapeRequest) -> bool:
        """Whether the request's answer was a tool call, as the response's finish_reason tells the
        server: the session's next request continues its dispatch (the same agent, at the same
        step; a tape without steps: the same agent, as a tool loop's calls are)."""
        following = self.next_in_session[self._index_of(request)]
        if following is None:
            return False
        after = self.requests[following]
        return after.agent == request.agent and (request.step is None or after.step == request.step)

    def _index_of(self, request: TapeRequest) -> int:
        if not hasattr(self, "_indices"):
            self._indices = {r.id: i for i, r in enumerate(self.requests)}
        return self._indices[request.id]

    @property
    def topology_name(self) -> str | None:
        """The built-in topology the header's ``workload.topology`` names, when the tape's agents are its
        agents (a header copied from a generated tape onto other agents names a graph they are not in)."""
        name = self.tape.header.get("workload", {}).get("topology")
        return name if name in TOPOLOGIES and set(self.agents()) <= set(AGENTS) else None

    def agents(self) -> list[str]:
        return list(dict.fromkeys(r.agent for r in self.requests))

    @property
    def header_graph(self) -> dict[str, Any] | None:
        """The tape header's declared graph (``graph``, validated by ``read_tape``), if any."""
        graph = self.tape.header.get("graph")
        if not isinstance(graph, dict):
            return None
        return {**graph, "nodes": [_wire(a) for a in graph["nodes"]],
                "edges": [[_wire(a), _wire(b)] for a, b in graph.get("edges", [])],
                "entry": [_wire(a) for a in graph.get("entry") or []]}

    def declared_graph(self) -> dict[str, set[str]]:
        """The graph the app declares: the header's ``graph`` (every possible transition), else
        the named topology's (its support); for a tape with neither, the complete graph over its agents."""
        graph = self.header_graph
        if graph is not None:
            out: dict[str, set[str]] = {a: set() for a in graph["nodes"]}
            for a, b in graph.get("edges", []):
                out[a].add(b)
            return out
        name = self.topology_name
        if name is None:
            agents = self.agents()
            return {a: set(agents) for a in agents}
        matrix = topology(name).matrix
        return {a: {b for j, b in enumerate(AGENTS) if matrix[i, j] > 1e-12} for i, a in enumerate(AGENTS)}

    def entry_agents(self) -> list[str]:
        graph = self.header_graph
        if graph is not None and graph.get("entry"):
            return list(graph["entry"])
        seen: set[str] = set()
        first = []
        for r in self.requests:  # a request without a parent is its session's first when the session is new
            if r.parent == "" or (r.parent is None and r.session not in seen):
                first.append(r.agent)
            seen.add(r.session)
        return list(dict.fromkeys(first))

    def graph_event(self) -> dict[str, Any] | None:
        """The ``graph`` event the app would send; None without a graph."""
        if self.header_graph is None and self.topology_name is None:
            return None
        graph = self.declared_graph()
        edges = sorted([a, b] for a, succ in graph.items() if len(succ) == 1 for b in succ)
        conditional = sorted([a, b] for a, succ in graph.items() if len(succ) > 1 for b in succ)
        name = f"tape-{self.tape.name}" if self.topology_name is None else f"topology-{self.topology_name}"
        return {"type": "graph", "id": sanitize_id(name), "nodes": list(graph),
                "edges": edges, "conditional_edges": conditional,
                "entry": [a for a in self.entry_agents() if a in graph]}


def _wire(name: str) -> str:
    return sanitize_id(name) if name else name  # parent "": the session's first dispatch


def wire_ids(requests: Iterable[TapeRequest], tape: str = "tape") -> list[TapeRequest]:
    """The requests with their agent, session and parent ids as agentkv's clients send them.

    The framework adapters pass every name through ``sanitize_id`` (``Research Agent`` is sent
    as ``Research_Agent``), so a tape recorded from an app replays tagged whatever its names.
    Two names that sanitize alike are one id, as they are live; that is logged.
    """
    out: list[TapeRequest] = []
    agents: dict[str, str] = {}  # original -> id; agents and sessions are apart (alike ids do not merge them)
    sessions: dict[str, str] = {}

    def wire(names: dict[str, str], name: str | None) -> str | None:
        return None if name is None else names.get(name) or names.setdefault(name, _wire(name))

    for request in requests:
        ids = (wire(agents, request.agent), wire(sessions, request.session), wire(agents, request.parent))
        if ids != (request.agent, request.session, request.parent):
            request = dataclasses.replace(request, agent=ids[0], session=ids[1], parent=ids[2])
        out.append(request)
    changed = {name: id_ for names in (agents, sessions) for name, id_ in names.items() if name != id_}
    if changed:
        merged = sum(count - 1 for names in (agents, sessions) for count in Counter(names.values()).values())
        _log.warning("%s: %d agent or session ids outside the wire alphabet are sent as agentkv's clients send them "
                     "(e.g. %r as %r)%s", tape, len(changed), *next(iter(changed.items())),
                     f"; {merged} of them now equal another id" if merged else "")
    return out

