"""The requests of ``agentkv bench soak``: valid agent traffic mixed with hostile input.

Each case builds one request from a seeded ``random.Random``; nothing here sends anything. The
hostile cases reproduce what an outside probe sent to a server (malformed and duplicate tag
headers, deeply nested and oversized JSON bodies, fabricated peer merges, events and graph facts
from many agents and replicas, unauthenticated control calls). ``STATELESS_CASES`` leave the
server's learned state (learner, facts, peers) untouched when the server handles them correctly,
so they can run against a server that other tests share.
"""

from __future__ import annotations

import itertools
import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from agentkv.graph import COUNTS_FORMAT, COUNTS_VERSION
from agentkv.protocol import EVENTS_PATH, MERGE_PATH, STATE_PATH, STATS_PATH, AgentTag

__all__ = ["CASES", "STATELESS_CASES", "Request", "SoakContext", "choose_case"]

AGENTS: Final = ("planner", "coder", "critic", "tester", "writer", "reviewer")
NESTING: Final = 2_000
OVERSIZED_BYTES: Final = 4 * 1024 * 1024
Headers = list[tuple[str, str | bytes]]


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    headers: Headers
    body: bytes | None = None


@dataclass
class SoakContext:
    """What the cases share: the model name, the API key (None: the server has none), counters."""

    model: str
    api_key: str | None = None
    sequence: int = 0
    sessions: list[str] = field(default_factory=list)

    def auth(self) -> Headers:
        return [("Authorization", f"Bearer {self.api_key}")] if self.api_key else []

    def next(self) -> int:
        self.sequence += 1
        return self.sequence


def _json(payload: object) -> bytes:
    return json.dumps(payload).encode()


def _completion(ctx: SoakContext, rng: random.Random, extra: dict[str, object] | None = None) -> bytes:
    anchor = [10 + AGENTS.index(rng.choice(AGENTS))] * 64  # a shared prefix per agent: real cache hits
    prompt = anchor + [rng.randrange(10, 4000) for _ in range(rng.randrange(8, 96))]
    return _json({"model": ctx.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **(extra or {})})


def _random_id(rng: random.Random, length: int) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits, k=length))


# -- valid traffic ---------------------------------------------------------------------


def valid_tagged(ctx: SoakContext, rng: random.Random) -> Request:
    session = f"soak-{ctx.next() // 4}"
    if not ctx.sessions or ctx.sessions[-1] != session:
        ctx.sessions = [*ctx.sessions[-63:], session]
    step = rng.randrange(4)
    tag = AgentTag(rng.choice(AGENTS), session, "" if step == 0 else rng.choice(AGENTS), step)
    return Request("POST", "/v1/completions", [*ctx.auth(), *tag.to_headers().items()], _completion(ctx, rng))


def valid_untagged(ctx: SoakContext, rng: random.Random) -> Request:
    return Request("POST", "/v1/completions", ctx.auth(), _completion(ctx, rng))


def valid_chat(ctx: SoakContext, rng: random.Random) -> Request:
    agent = rng.choice(AGENTS)
    body = {"model": ctx.model, "max_tokens": 1, "messages": [
        {"role": "system", "content": f"You are the {agent}. " * 8},
        {"role": "user", "content": _random_id(rng, 40)}]}
    tag = AgentTag(agent, f"soak-chat-{ctx.next()}", "", 0)
    return Request("POST", "/v1/chat/completions", [*ctx.auth(), *tag.to_headers().items()], _json(body))


def control_reads(ctx: SoakContext, rng: random.Random) -> Request:
    return Request("GET", rng.choice((STATS_PATH, STATE_PATH, "/metrics", "/health")), ctx.auth())


def valid_events(ctx: SoakContext, rng: random.Random) -> Request:
    session = rng.choice(ctx.sessions) if ctx.sessions else f"soak-{ctx.next()}"
    kind = rng.choice(("session_start", "session_end", "cancel"))
    events = [{"type": kind, "id": f"soak-{ctx.next()}", "session": session}]
    if rng.random() < 0.3:
        events.append({"type": "graph", "id": f"soak-graph-{ctx.next()}", "nodes": list(AGENTS),
                       "edges": [list(pair) for pair in itertools.pairwise(AGENTS)]})
    return Request("POST", EVENTS_PATH, [*ctx.auth(), ("Content-Type", "application/json")],
                   _json({"version": 1, "events": events}))


# -- hostile traffic ---------------------------------------------------------------------


def malformed_agent(ctx: SoakContext, rng: random.Random) -> Request:
    value: str | bytes = rng.choice(
        ["", "bad agent", "x" * 5000, "代理".encode(), "a/../../b", "%00", "planner;drop"])
    return Request("POST", "/v1/completions", [*ctx.auth(), ("X-AgentKV-Agent", value)], _completion(ctx, rng))


def malformed_fields(ctx: SoakContext, rng: random.Random) -> Request:
    headers: Headers = [*ctx.auth(), ("X-AgentKV-Agent", rng.choice(AGENTS))]
    extra: dict[str, object] = {}
    choice = rng.randrange(4)
    if choice == 0:
        headers.append(("X-AgentKV-Step", rng.choice(("abc", "-1", "1.5", "99999999999999999999", "true"))))
    elif choice == 1:
        headers.append(("X-AgentKV-Warmup", rng.choice(("maybe", "2", ""))))
    elif choice == 2:
        headers.append(("X-AgentKV-Parent", "p" * 300))
    else:
        extra = {"vllm_xargs": {"agentkv_agent": rng.choice(AGENTS), "agentkv_step": rng.choice((True, -3, 1.5))}}
    return Request("POST", "/v1/completions", headers, _completion(ctx, rng, extra))


def duplicate_headers(ctx: SoakContext, rng: random.Random) -> Request:
    if rng.random() < 0.5:
        headers: Headers = [("X-Session-ID", f"dup-{ctx.next()}"), ("X-Session-ID", f"dup-{ctx.next()}")]
    else:
        headers = [("X-AgentKV-Agent", f"dup{i}") for i in range(100)]
    return Request("POST", "/v1/completions", [*ctx.auth(), *headers], _completion(ctx, rng))


def nested_json(ctx: SoakContext, rng: random.Random) -> Request:
    nested = "[" * NESTING + "]" * NESTING
    target = rng.randrange(4)
    if target == 0:
        return Request("POST", EVENTS_PATH, [*ctx.auth(), ("Content-Type", "application/json")], nested.encode())
    if target == 1:
        return Request("POST", MERGE_PATH, [*ctx.auth(), ("Content-Type", "application/json")], nested.encode())
    body = f'{{"model": "{ctx.model}", "max_tokens": 1, "messages": {nested}}}'.encode()
    headers: Headers = [*ctx.auth(), ("Content-Type", "application/json")]
    if target == 2:
        headers.append(("X-AgentKV-Agent", "a"))
    return Request("POST", "/v1/chat/completions", headers, body)


def oversized_body(ctx: SoakContext, rng: random.Random) -> Request:
    path = rng.choice((EVENTS_PATH, MERGE_PATH, "/v1/completions"))
    body = {"version": 1, "model": ctx.model, "prompt": [11, 12, 13], "max_tokens": 1, "events": [],
            "padding": "x" * OVERSIZED_BYTES}  # big but cheap to parse: no 4 MB prompt to tokenize
    return Request("POST", path, [*ctx.auth(), ("Content-Type", "application/json"), ("X-AgentKV-Agent", "big")],
                   _json(body))


def fabricated_merge(ctx: SoakContext, rng: random.Random) -> Request:
    n = rng.randrange(2, 200)
    agents = [_random_id(rng, rng.randrange(1, 128)) for _ in range(n)]
    counts: list[list[object]] = [[rng.random() * 100 for _ in range(n)] for _ in range(n)]
    hostile = rng.randrange(5)
    if hostile == 1:
        counts[0][min(1, n - 1)] = 1e300
    elif hostile == 2:
        counts[0][0] = "1"
    elif hostile == 3:
        agents[0] = rng.choice(("", "bad agent\nwith newline", "x" * 5000, "代理"))
    document = {"format": COUNTS_FORMAT, "version": COUNTS_VERSION, "replica": f"fake-{ctx.next()}",
                "epoch": _random_id(rng, 16), "sequence": ctx.next(), "agents": agents, "counts": counts,
                "entry": [1.0] * n, "ends": [0.0] * n}
    return Request("POST", MERGE_PATH, [*ctx.auth(), ("Content-Type", "application/json")], _json(document))


def fabricated_events(ctx: SoakContext, rng: random.Random) -> Request:
    if rng.random() < 0.5:
        nodes = [_random_id(rng, 128) for _ in range(1024)]
        event = {"type": "graph", "id": f"fake-graph-{ctx.next()}", "nodes": nodes,
                 "edges": [[nodes[i], nodes[i + 1]] for i in range(0, 1023, 2)]}
        events = [event]
    else:  # end sessions the soak did not start, and the soak's own live ones
        sessions = [f"fake-{_random_id(rng, 12)}" for _ in range(200)] + ctx.sessions
        events = [{"type": "session_end", "id": f"fake-{ctx.next()}", "session": s} for s in sessions]
    return Request("POST", EVENTS_PATH, [*ctx.auth(), ("Content-Type", "application/json")],
                   _json({"version": 1, "events": events}))


def unauthenticated(ctx: SoakContext, rng: random.Random) -> Request:
    key: Headers = rng.choice(([], [("Authorization", "Bearer wrong-key")]))
    choice = rng.randrange(5)
    if choice == 0:
        return Request("GET", rng.choice((STATS_PATH, STATE_PATH)), key)
    if choice == 1:
        body = {"version": 1, "events": [{"type": "session_end", "id": f"u-{ctx.next()}", "session": "soak-0"}]}
        return Request("POST", EVENTS_PATH, [*key, ("Content-Type", "application/json")], _json(body))
    if choice == 2:
        return Request("POST", MERGE_PATH, [*key, ("Content-Type", "application/json")], _json({"format": "x"}))
    headers: Headers = [*key, ("X-AgentKV-Agent", "bad agent" if choice == 3 else "planner")]
    return Request("POST", "/v1/completions", headers, _completion(ctx, rng))


Case = Callable[[SoakContext, random.Random], Request]
# name -> (builder, weight, needs an API key on the server)
CASES: Final[dict[str, tuple[Case, int, bool]]] = {
    "valid_tagged": (valid_tagged, 20, False),
    "valid_untagged": (valid_untagged, 5, False),
    "valid_chat": (valid_chat, 3, False),
    "control_reads": (control_reads, 6, False),
    "valid_events": (valid_events, 4, False),
    "malformed_agent": (malformed_agent, 8, False),
    "malformed_fields": (malformed_fields, 4, False),
    "duplicate_headers": (duplicate_headers, 4, False),
    "nested_json": (nested_json, 4, False),
    "oversized_body": (oversized_body, 1, False),
    "fabricated_merge": (fabricated_merge, 4, False),
    "fabricated_events": (fabricated_events, 3, False),
    "unauthenticated": (unauthenticated, 4, True),
}
STATELESS_CASES: Final = ("valid_untagged", "control_reads", "malformed_agent", "nested_json")


def choose_case(rng: random.Random, names: list[str], weights: list[int]) -> str:
    return rng.choices(names, weights)[0]
