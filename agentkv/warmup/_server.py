"""What the warm-up worker reads from the vLLM server: learned stats, load and anchor residency, tokens."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agentkv.client import ErrorCounter, routing_header, usage_of
from agentkv.protocol import STATS_PATH, VIEW_PATH, AgentTag

from ._anchors import Anchor

__all__ = ["NoTokenizer", "ServerView", "WarmupServer", "anchor_resident", "blocks_to_warm", "merge_views",
           "parse_server_view", "view_of", "warmup_request"]


@dataclass(slots=True)
class ServerView:
    """What one ``GET /agentkv/v1/view`` (or ``/metrics``) tells about the engine (None: not said).

    ``anchors``: agent -> (leading anchor blocks resident, learned anchor length in blocks);
    ``successors``: agent -> (the server's predicted next agent, its probability), told with
    ``predictability`` (the learned R) by an agentkv view; ``block_size``: the server's KV block size;
    ``outcomes``: (useful, failed) of the server's latest warm-ups, whence ``survival``.
    """

    running: float | None = None
    waiting: float | None = None
    free_blocks: int | None = None
    anchors: dict[str, tuple[int, int]] = field(default_factory=dict)
    successors: dict[str, tuple[str, float]] = field(default_factory=dict)
    predictability: float | None = None
    block_size: int | None = None
    outcomes: tuple[int, int] | None = None

    @property
    def survival(self) -> float | None:
        """The share of warm-ups that lasted until their agent's call, (useful + 1) / (useful + failed
        + 1) (1 before any outcome: warm-ups get their chance); None when the server does not say."""
        if self.outcomes is None:
            return None
        useful, failed = self.outcomes
        return (useful + 1) / (useful + failed + 1)

    def resident(self, agent: str, anchor_blocks: int | None = None) -> bool | None:
        """Whether ``agent``'s anchor is cached (see ``anchor_resident``); None for an agent not listed."""
        if agent not in self.anchors:
            return None
        return anchor_resident(*self.anchors[agent], anchor_blocks)


def anchor_resident(resident: int, learned: int, anchor_blocks: int | None) -> bool | None:
    """Whether an anchor is cached, from the server's (leading blocks cached, learned anchor length):
    against the learned length; while none is learned, ``resident`` counts the leading blocks of
    the agent's latest first call, checked against ``anchor_blocks`` (the anchor the caller holds,
    when its token length is known); None when neither length is known."""
    if learned > 0:
        return resident >= learned
    if anchor_blocks:
        return resident >= anchor_blocks
    return None


def parse_server_view(text: str) -> ServerView:
    """The engine's queue (summed over engines), free blocks and anchor residency from Prometheus text."""
    view = ServerView()
    resident: dict[str, int] = {}
    length: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, sample.value
            if name == "vllm:num_requests_running":
                view.running = (view.running or 0.0) + value
            elif name == "vllm:num_requests_waiting":
                view.waiting = (view.waiting or 0.0) + value
            elif name == "agentkv_kv_free_blocks":
                view.free_blocks = int(value)
            elif name in ("agentkv_anchor_resident_blocks", "agentkv_anchor_length_blocks"):
                agent = sample.labels.get("agent")
                if agent is not None:
                    table = resident if name == "agentkv_anchor_resident_blocks" else length
                    table[agent] = int(value)
    view.anchors = {a: (resident.get(a, 0), n) for a, n in length.items()}
    return view


def view_of(document: Any) -> ServerView:
    """A ``GET /agentkv/v1/view`` document as a view; ValueError when it is not one."""
    if not isinstance(document, Mapping) or not isinstance(anchors := document.get("anchors"), Mapping):
        raise ValueError("the view is not a JSON object with anchors")
    view = ServerView()
    for name in ("waiting", "running"):
        value = document.get(name)
        if value is not None:
            setattr(view, name, float(value))
    free = document.get("free_blocks")
    view.free_blocks = None if free is None else int(free)
    view.anchors = {str(agent): (int(pair[0]), int(pair[1])) for agent, pair in anchors.items()}
    # an older agentkv server's view tells no prediction: the caller then asks the stats
    successors, predictability, size = document.get("next"), document.get("predictability"), document.get("block_size")
    if isinstance(successors, Mapping) and predictability is not None:
        view.successors = {str(agent): (str(pair[0]), float(pair[1])) for agent, pair in successors.items()}
        view.predictability = float(predictability)
    if size is not None:
        view.block_size = int(size)
    outcomes = document.get("warmups")
    if isinstance(outcomes, list) and len(outcomes) == 2 and all(type(n) is int and n >= 0 for n in outcomes):
        view.outcomes = (outcomes[0], outcomes[1])
    return view


def merge_views(views: Sequence[ServerView]) -> ServerView:
    """One view of the replicas behind a router, from each replica's own (an unreadable one is empty).

    A ``kv_aware`` router sends a call to the replica that holds its prefix, and under
    ``consistent_hash`` on the agent an anchor lives on its agent's replica only: an anchor counts as
    resident when any replica holds it. Where the router puts a warm-up of an anchor no replica
    holds is its own choice, so the load and the room are the replicas' mean. Warm-up outcomes add
    up; the prediction is the first told (the replicas share their learned counts).
    """
    if len(views) == 1:
        return views[0]
    merged = ServerView()
    for name in ("running", "waiting", "free_blocks"):
        said = [value for view in views if (value := getattr(view, name)) is not None]
        if said:
            mean = sum(said) / len(said)
            setattr(merged, name, int(mean) if name == "free_blocks" else mean)
    for view in views:
        for agent, pair in view.anchors.items():
            held = merged.anchors.get(agent)
            if held is None or _holds_more(pair, held):
                merged.anchors[agent] = pair
        if merged.predictability is None and view.predictability is not None:
            merged.predictability, merged.successors = view.predictability, dict(view.successors)
        if merged.block_size is None:
            merged.block_size = view.block_size
        if view.outcomes is not None:
            useful, failed = merged.outcomes or (0, 0)
            merged.outcomes = (useful + view.outcomes[0], failed + view.outcomes[1])
    return merged


def _holds_more(pair: tuple[int, int], than: tuple[int, int]) -> bool:
    """Whether a replica's (resident, learned) anchor entry says more is cached than ``than``."""
    return (anchor_resident(*pair, None) is True, pair[0]) > (anchor_resident(*than, None) is True, than[0])


def blocks_to_warm(anchor: Anchor | None, view: ServerView, agent: str) -> int:
    """Blocks a warm-up of ``anchor`` prefills: its token length, or for a chat replay (length known
    only from the answer) the server's learned anchor length, at least one block."""
    if anchor is None:
        return 0
    if anchor.tokens:
        return anchor.blocks
    return max(1, view.anchors.get(agent, (0, 0))[1])


def warmup_request(
    agent: str, anchor: Anchor, model: str | None, session: str | None
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(path, JSON body, headers) of the ``max_tokens=1`` request that re-prefills ``anchor``.

    Exact token ids as ``/v1/completions`` ``prompt``; without them (no ``/tokenize``) a chat replay
    of ``messages[0]`` + tools. ``model`` (else the anchor's) is left out when unknown.
    """
    model = model or anchor.model
    # through a router, the warm-up must take the path the predicted call will take
    headers = {**AgentTag(agent, warmup=True).to_headers(), **routing_header(agent, session)}
    if anchor.tokens:
        path = "/v1/completions"
        body: dict[str, Any] = {"model": model, "prompt": list(anchor.tokens), "max_tokens": 1, "temperature": 0}
    else:
        path = "/v1/chat/completions"
        body = {**(anchor.chat or {}), "model": model, "max_tokens": 1, "temperature": 0}
    body.update(anchor.extra)
    if model is None:
        body.pop("model")
    return path, body, headers


class NoTokenizer(RuntimeError):
    """The server has no ``POST /tokenize``."""


class WarmupServer:
    """The warm-up worker's reads of one server, through its httpx client; behind a router, the
    view is read from each of ``replicas`` (clients of the servers behind it) at once, one thread
    per replica beyond the first, and merged (:func:`merge_views`): the router would hand a read to
    one replica only, and a decision waits for the slowest replica, not for their sum.

    Invariant: ``GET /agentkv/v1/stats`` is asked at most every ``stats_interval`` seconds and
    the view (``GET /agentkv/v1/view``, else ``/metrics``) at most every ``metrics_interval``
    seconds, failures included (a failed read is
    cached as unknown). Errors are counted in ``errors``, never raised. Called from one thread only.
    """

    def __init__(
        self,
        client: httpx.Client,
        errors: ErrorCounter,
        clock: Callable[[], float],
        *,
        stats_interval: float,
        metrics_interval: float,
        model: str | None,
        replicas: Sequence[httpx.Client] = (),
    ) -> None:
        self.client = client
        self.errors = errors
        self.clock = clock
        self.stats_interval = stats_interval
        self.metrics_interval = metrics_interval
        self.model = model
        self._viewed = tuple(replicas) or (client,)
        self._view: tuple[float, ServerView] | None = None  # (read at, what the servers said)
        self._no_view: set[int] = set()  # indexes into _viewed of servers that answered 404 on VIEW_PATH
        self._stats: tuple[float, Mapping[str, Any] | None] | None = None

    def stats(self) -> Mapping[str, Any] | None:
        """``GET /agentkv/v1/stats`` (None when unreadable)."""
        now = self.clock()
        cached = self._stats
        if cached is not None and now - cached[0] < self.stats_interval:
            return cached[1]
        try:
            response = self.client.get(STATS_PATH)
            response.raise_for_status()
            stats = response.json()
            if not isinstance(stats, Mapping):
                raise ValueError("stats are not a JSON object")
        except Exception as exc:
            self.errors.record(f"GET {STATS_PATH}", exc)
            self._stats = (now, None)  # do not ask again before stats_interval
            return None
        self._stats = (now, stats)
        return stats

    def view(self) -> ServerView:
        """What ``GET /agentkv/v1/view`` says, or ``/metrics`` on a server without that route (vanilla
        vLLM); empty when unreadable. The view costs the server a few dictionary reads; ``/metrics``
        costs it vLLM's whole exposition and this process ~8 ms of parsing (692 lines) right when
        the application sends its next call, so it is read only where nothing else says."""
        now = self.clock()
        cached = self._view
        if cached is not None and now - cached[0] < self.metrics_interval:
            return cached[1]
        view = merge_views(self._read_views())
        self._view = (now, view)
        return view

    def _read_views(self) -> list[ServerView]:
        """Every replica's view, read concurrently (each read is bounded by its client's timeout)."""
        views = [ServerView() for _ in self._viewed]

        def read(index: int) -> None:
            views[index] = self._read_view(index)

        # daemon threads: a replica that hangs must not hold up the interpreter's exit
        others = [threading.Thread(target=read, args=(i,), name="agentkv-view", daemon=True)
                  for i in range(1, len(views))]
        for thread in others:
            thread.start()
        read(0)
        for thread in others:
            thread.join()
        return views

    def _read_view(self, index: int) -> ServerView:
        client = self._viewed[index]
        path = "/metrics" if index in self._no_view else VIEW_PATH  # set.add from a reader thread is atomic
        try:
            response = client.get(path)
            if path == VIEW_PATH and response.status_code == 404:
                self._no_view.add(index)  # not an agentkv server: its /metrics, now and from then on
                path = "/metrics"
                response = client.get(path)
            response.raise_for_status()
            view = view_of(response.json()) if path == VIEW_PATH else parse_server_view(response.text)
            if view.waiting is None:
                self.errors.record(f"GET {path}", message="no waiting-request count: the busy gate is off")
            return view
        except Exception as exc:
            self.errors.record(f"GET {path}", exc)
            return ServerView()

    def mark_resident(self, agent: str, blocks: int) -> None:
        """Until the next view, count ``agent``'s anchor (``blocks`` long, or as learned) as resident (just warmed)."""
        if self._view is not None and agent in self._view[1].anchors:
            learned = self._view[1].anchors[agent][1]
            self._view[1].anchors[agent] = (max(learned, blocks), learned)

    def post(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> tuple[int | None, int | None]:
        """Send a warm-up; its ``(prompt_tokens, cached_tokens)``. Raises on any failure (the caller counts it)."""
        response = self.client.post(path, json=body, headers=headers)
        if response.status_code >= 400:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        return usage_of(response.json())

    def tokenize(self, payload: Mapping[str, Any]) -> list[int]:
        """``POST /tokenize``; :class:`NoTokenizer` when the server has no such endpoint."""
        body = dict(payload)
        if self.model is not None:
            body["model"] = self.model
        response = self.client.post("/tokenize", json=body)
        if response.status_code in (404, 405):
            raise NoTokenizer(f"HTTP {response.status_code}")
        response.raise_for_status()
        tokens = response.json().get("tokens")
        if not isinstance(tokens, list):
            raise ValueError("/tokenize answered without tokens")
        return tokens
