"""The tape format: records, reading and validating, writing, and the token ids of a segment (docs/tapes.md)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from agentkv.client import sanitize_id
from agentkv.graph import TransitionLearner

__all__ = [
    "ANCHOR_PREFIX",
    "DEFAULT_OFFSET",
    "DEFAULT_VOCAB",
    "FORMAT",
    "MAX_REQUEST_TOKENS",
    "VERSION",
    "Tape",
    "TapeError",
    "TapeRequest",
    "TimeModel",
    "measured_predictability",
    "read_tape",
    "segment_kind",
    "segment_tokens",
    "write_tape",
]

FORMAT = "agentkv-tape"
VERSION = 1
DEFAULT_VOCAB = 30_000
DEFAULT_OFFSET = 1_000
ANCHOR_PREFIX = "anchor/"
MAX_TOKEN_ID = 2**31 - 1  # an engine's token ids are 32-bit
# prompt + output tokens of one request: the longest context windows served today; a replay
# computes every token id, so an unbounded count would hang it rather than fail
MAX_REQUEST_TOKENS = 2**20


class TapeError(ValueError):
    """A tape that does not follow the format (message names the line and field)."""


# -- token ids ---------------------------------------------------------------------------


def segment_tokens(key: str, n_tokens: int, *, vocab: int = DEFAULT_VOCAB, offset: int = DEFAULT_OFFSET) -> list[int]:
    """Token ids of a segment: counter-mode BLAKE2b of the key.

    token i = int.from_bytes(blake2b(f"{key}:{i}".encode("utf-8"), digest_size=8).digest()[:4], "big")
              % vocab + offset
    """
    out = []
    for i in range(n_tokens):
        digest = hashlib.blake2b(f"{key}:{i}".encode(), digest_size=8).digest()
        out.append(int.from_bytes(digest[:4], "big") % vocab + offset)
    return out


def segment_kind(key: str) -> str:
    """``anchor`` for keys starting with ``anchor/`` (an agent's fixed prefix), else ``history``."""
    return "anchor" if key.startswith(ANCHOR_PREFIX) else "history"


# -- the format --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TapeRequest:
    """One LLM request of a tape (one line)."""

    id: str
    t: float  # arrival time, seconds from the tape's start
    session: str
    agent: str
    parent: str | None  # the agent of the session's previous dispatch; "" in its first; None: not given
    segments: tuple[tuple[str, int], ...]  # the prompt: [key, n_tokens] spans, in order
    output_tokens: int
    tool_gap: float  # seconds before the session's next request (tool time or hand-off)
    step: int | None = None  # the dispatch step within the session (tool-loop calls share it)
    output: str = ""  # key of the output segment ("" -> f"{id}/out")
    abandoned: bool = False  # the session's last request, and its app never ends the session

    @property
    def output_key(self) -> str:
        return self.output or f"{self.id}/out"

    @property
    def prompt_tokens(self) -> int:
        return sum(n for _, n in self.segments)

    def to_json(self) -> dict[str, Any]:
        line: dict[str, Any] = {
            "id": self.id,
            "t": round(self.t, 6),
            "session": self.session,
            "agent": self.agent,
            "parent": self.parent,
            "step": self.step,
            "segments": [list(s) for s in self.segments],
            "output": self.output,
            "output_tokens": self.output_tokens,
            "tool_gap": round(self.tool_gap, 6),
        }
        if self.step is None:
            del line["step"]
        if self.parent is None:
            del line["parent"]
        if not self.output:
            del line["output"]
        if self.abandoned:
            line["abandoned"] = True
        return line


@dataclass
class Tape:
    header: dict[str, Any]
    requests: list[TapeRequest]

    @property
    def block_size(self) -> int:
        return int(self.header["block_size"])

    @property
    def vocab(self) -> int:
        return int(self.header.get("tokens", {}).get("vocab", DEFAULT_VOCAB))

    @property
    def offset(self) -> int:
        return int(self.header.get("tokens", {}).get("offset", DEFAULT_OFFSET))

    @property
    def name(self) -> str:
        return str(self.header.get("name") or self.header.get("workload", {}).get("topology") or "tape")

    def tokens(self, key: str, n_tokens: int) -> list[int]:
        return segment_tokens(key, n_tokens, vocab=self.vocab, offset=self.offset)

    def sessions(self) -> dict[str, list[TapeRequest]]:
        """Requests grouped by session, in tape order."""
        out: dict[str, list[TapeRequest]] = {}
        for request in self.requests:
            out.setdefault(request.session, []).append(request)
        return out

    def summary(self) -> dict[str, Any]:
        """Workload statistics: anchor share of prompt tokens, measured R, sizes."""
        prompt = sum(r.prompt_tokens for r in self.requests)
        anchor = sum(n for r in self.requests for k, n in r.segments if segment_kind(k) == "anchor")
        sessions = self.sessions()
        return {
            "requests": len(self.requests),
            "sessions": len(sessions),
            "dispatches": sum(_dispatches(rs) for rs in sessions.values()),
            "prompt_tokens": prompt,
            "anchor_share": anchor / prompt if prompt else 0.0,
            "predictability": measured_predictability(self),
            "max_prompt_tokens": max((r.prompt_tokens for r in self.requests), default=0),
            "max_request_tokens": max((r.prompt_tokens + r.output_tokens for r in self.requests), default=0),
            "duration_s": max((r.t for r in self.requests), default=0.0),
            "abandoned_sessions": sum(1 for r in self.requests if r.abandoned),
        }


def _dispatches(session: Sequence[TapeRequest]) -> int:
    """A session's dispatches: a request opens one when its step differs from the previous request's,
    or, without a step, its agent does (a tool loop's calls are one dispatch, as the server implies)."""
    count, previous = 0, None
    for request in session:
        if previous is None or (request.agent != previous.agent if request.step is None
                                else request.step != previous.step):
            count += 1
        previous = request
    return count


def _fail(line: int, message: str) -> TapeError:
    return TapeError(f"tape line {line}: {message}")


def _check_header(header: object) -> dict[str, Any]:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _fail(1, f"header must be an object with format {FORMAT!r}")
    version = header.get("version")
    if isinstance(version, bool) or version != VERSION:  # true == 1 in Python, not in a tape
        raise _fail(1, f"unsupported version {version!r} (this reader: {VERSION})")
    block_size = header.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise _fail(1, "block_size must be a positive integer")
    tokens = header.get("tokens", {})
    if not isinstance(tokens, dict):
        raise _fail(1, "tokens must be an object")
    for name in ("vocab", "offset"):
        value = tokens.get(name, 1)
        least = 1 if name == "vocab" else 0
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise _fail(1, f"tokens.{name} must be an integer >= {least}")
    if tokens.get("vocab", DEFAULT_VOCAB) + tokens.get("offset", DEFAULT_OFFSET) > MAX_TOKEN_ID + 1:
        raise _fail(1, f"token ids must stay below 2**31 (tokens.vocab + tokens.offset <= {MAX_TOKEN_ID + 1})")
    if not isinstance(header.get("workload", {}), dict):
        raise _fail(1, "workload must be an object")
    if "graph" in header:
        _check_graph(header["graph"])
    return header


def _check_graph(graph: object) -> None:
    """The optional declared graph: {"nodes": [id], "edges": [[from, to]], "entry": [id]}, edges and entry
    between declared nodes."""
    def ids(value: object) -> bool:
        return isinstance(value, list) and all(isinstance(x, str) and x for x in value)

    if not isinstance(graph, dict) or not ids(graph.get("nodes")) or not ids(graph.get("entry", [])):
        raise _fail(1, "graph must be an object with nodes (and entry) as lists of non-empty strings")
    edges = graph.get("edges", [])
    if not isinstance(edges, list) or not all(ids(e) and len(e) == 2 for e in edges):
        raise _fail(1, "graph.edges must be a list of [from, to] pairs")
    nodes = set(graph["nodes"])
    if not {a for e in edges for a in e} | set(graph.get("entry", [])) <= nodes:
        raise _fail(1, "graph.edges and graph.entry may only name graph.nodes")


def _parse_request(obj: object, line: int, index: int) -> TapeRequest:
    if not isinstance(obj, dict):
        raise _fail(line, "a request must be a JSON object")
    for name, kind in (("t", (int, float)), ("session", str), ("agent", str), ("segments", list),
                       ("output_tokens", int), ("tool_gap", (int, float))):
        if name not in obj:
            raise _fail(line, f"missing field {name!r}")
        if not isinstance(obj[name], kind) or isinstance(obj[name], bool):
            raise _fail(line, f"field {name!r} has the wrong type")
    parent = obj.get("parent")
    if parent is not None and not isinstance(parent, str):
        raise _fail(line, "field 'parent' has the wrong type")
    segments = []
    for segment in obj["segments"]:
        if (not isinstance(segment, list) or len(segment) != 2 or not isinstance(segment[0], str)
                or not isinstance(segment[1], int) or isinstance(segment[1], bool) or segment[1] < 0):
            raise _fail(line, f"segment {segment!r} must be [key, n_tokens >= 0]")
        if segment[1]:  # an empty span (a tool that returned nothing) adds no token
            segments.append((segment[0], segment[1]))
    if not segments:
        raise _fail(line, "a request's prompt needs at least one token")
    if sum(n for _, n in segments) + obj["output_tokens"] > MAX_REQUEST_TOKENS:
        raise _fail(line, f"a request's prompt and output tokens must total at most {MAX_REQUEST_TOKENS:,}")
    try:  # an integer too large for a float overflows
        finite = math.isfinite(obj["t"]) and math.isfinite(obj["tool_gap"])
    except OverflowError:
        finite = False
    if not finite:
        raise _fail(line, "t and tool_gap must be finite numbers")
    if obj["output_tokens"] < 1 or obj["tool_gap"] < 0 or obj["t"] < 0 or not obj["session"] or not obj["agent"]:
        raise _fail(line, "output_tokens >= 1, tool_gap >= 0, t >= 0 and non-empty session and agent are required")
    step = obj.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise _fail(line, "step must be a non-negative integer")
    output = obj.get("output", "")
    if not isinstance(output, str):
        raise _fail(line, "output must be a string key")
    request_id = obj.get("id", f"r{index}")
    if not isinstance(request_id, str) or not request_id:
        raise _fail(line, "id must be a non-empty string")
    abandoned = obj.get("abandoned", False)
    if not isinstance(abandoned, bool):
        raise _fail(line, "abandoned must be true or false")
    return TapeRequest(request_id, float(obj["t"]), obj["session"], obj["agent"], parent, tuple(segments),
                       obj["output_tokens"], float(obj["tool_gap"]), step, output, abandoned)


def read_tape(path: str | Path | TextIO | Iterable[str]) -> Tape:
    """Read and validate a tape (a path, an open text file or its lines)."""
    if isinstance(path, (str, Path)):
        with open(path, "rb") as handle:
            return read_tape(_utf8_lines(handle))
    header: dict[str, Any] | None = None
    requests: list[TapeRequest] = []
    ids: set[str] = set()
    ended: dict[str, int] = {}  # session -> line of its conversation's request marked abandoned
    last_t = 0.0
    number = 0
    try:
        for number, raw in enumerate(path, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw, parse_constant=_reject_constant)
            except json.JSONDecodeError as exc:
                raise _fail(number, f"not JSON ({exc.msg})") from exc
            except ValueError as exc:
                raise _fail(number, str(exc)) from exc
            if header is None:
                header = _check_header(obj)
                continue
            _append_request(_parse_request(obj, number, len(requests)), number, requests, ids, ended, last_t)
            last_t = requests[-1].t
    except UnicodeDecodeError as exc:
        raise TapeError(f"tape is not UTF-8 ({exc.reason}, after line {number})") from exc
    if header is None:
        raise TapeError("empty tape: no header line")
    _check_graph_agents(header, requests)
    return Tape(header, requests)


def _utf8_lines(handle: Iterable[bytes]) -> Iterable[str]:
    """The lines of a tape file decoded one by one, so that a bad byte is reported on its line;
    a leading byte-order mark (some editors write one) is dropped."""
    for number, raw in enumerate(handle, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _fail(number, f"not UTF-8 ({exc.reason} at byte {exc.start})") from exc
        yield line.removeprefix("\ufeff") if number == 1 else line


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _append_request(request: TapeRequest, number: int, requests: list[TapeRequest], ids: set[str],
                    ended: dict[str, int], last_t: float) -> None:
    if request.t < last_t:
        raise _fail(number, f"t={request.t} goes back in time (previous {last_t}): requests are in arrival order")
    if request.id in ids:
        raise _fail(number, f"duplicate id {request.id!r}")
    if request.session in ended:
        if request.parent != "":  # a session id may start a new conversation after an abandoned one
            raise _fail(ended[request.session], "abandoned marks a request that is not its conversation's last")
        del ended[request.session]
    if request.abandoned:
        ended[request.session] = number
    ids.add(request.id)
    requests.append(request)


def _check_graph_agents(header: dict[str, Any], requests: list[TapeRequest]) -> None:
    """A declared graph names every agent of the tape (its nodes are the app's agents), compared as the
    clients send them (a node ``Research_Agent`` is the agent ``Research Agent``)."""
    graph = header.get("graph")
    if graph is None:
        return
    nodes = {sanitize_id(node) for node in graph["nodes"]}
    missing = sorted(agent for agent in {r.agent for r in requests} if sanitize_id(agent) not in nodes)
    if missing:
        raise _fail(1, f"graph.nodes must list every agent of the tape; missing {missing[:5]}"
                       + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def write_tape(tape: Tape, path: str | Path | TextIO) -> None:
    if isinstance(path, (str, Path)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            write_tape(tape, handle)
        return
    path.write(json.dumps(tape.header, sort_keys=True) + "\n")
    for request in tape.requests:
        path.write(json.dumps(request.to_json()) + "\n")


@dataclass(frozen=True)
class TimeModel:
    """Service time of one request on the simulated engine (no contention between requests).

    duration = overhead + computed_prompt_tokens / prefill_tps + output_tokens * tpot
    """

    prefill_tps: float = 10_000.0  # prompt tokens per second (an 8B model on one GPU)
    tpot: float = 0.010  # seconds per output token
    overhead: float = 0.005  # seconds per request

    def duration(self, computed_prompt_tokens: int, output_tokens: int) -> float:
        return self.overhead + computed_prompt_tokens / self.prefill_tps + output_tokens * self.tpot


def measured_predictability(tape: Tape | Iterable[TapeRequest]) -> float:
    """R = 1 - H(next | current) / H(next) of the tape's dispatch lineage (one count per dispatch)."""
    requests = tape.requests if isinstance(tape, Tape) else tape
    learner = TransitionLearner()
    seen: set[tuple[str, int | None]] = set()
    for request in requests:
        key = (request.session, request.step)
        if request.step is not None and key in seen:
            continue
        seen.add(key)
        learner.observe(request.agent, session=request.session, parent=request.parent, now=request.t)
    return learner.predictability()

