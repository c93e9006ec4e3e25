"""The agentkv wire contract, version 1 (see docs/protocol.md).

A request is tagged with the agent that issues it, its session, the agent that ran
before it in that session (its lineage) and the dispatch step. The tag travels either
as HTTP headers or as flat ``vllm_xargs`` keys in the JSON body; both forms carry
exactly the same fields. This module is shared by the client and the server and must
never import vllm.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import jsonschema

__all__ = [
    "EVENTS_PATH",
    "EVENTS_SCHEMA",
    "HEADER_AGENT",
    "HEADER_PARENT",
    "HEADER_SESSION",
    "HEADER_STEP",
    "HEADER_VLLM_SESSION",
    "HEADER_WARMUP",
    "MAX_ID_LENGTH",
    "PROTOCOL_VERSION",
    "STATS_MAX_AGE",
    "STATS_PATH",
    "STATS_SCHEMA",
    "VIEW_PATH",
    "XARG_AGENT",
    "XARG_PARENT",
    "XARG_SESSION",
    "XARG_STEP",
    "XARG_WARMUP",
    "AgentTag",
    "InvalidMetadata",
    "MalformedCounter",
    "ParseResult",
    "ProtocolError",
    "names_a_session",
    "parse_header_list",
    "parse_headers",
    "parse_xargs",
    "validate_events",
    "validate_id",
]

PROTOCOL_VERSION: Final = 1

HEADER_AGENT: Final = "X-AgentKV-Agent"
HEADER_SESSION: Final = "X-AgentKV-Session"
HEADER_PARENT: Final = "X-AgentKV-Parent"
HEADER_STEP: Final = "X-AgentKV-Step"
HEADER_WARMUP: Final = "X-AgentKV-Warmup"
HEADER_VLLM_SESSION: Final = "X-Session-ID"

XARG_AGENT: Final = "agentkv_agent"
XARG_SESSION: Final = "agentkv_session"
XARG_PARENT: Final = "agentkv_parent"
XARG_STEP: Final = "agentkv_step"
XARG_WARMUP: Final = "agentkv_warmup"

STATS_PATH: Final = "/agentkv/v1/stats"
# A stats document may be served again for this long (seconds), so polling cannot stall the
# engine; a graph fact, a session event or a peer merge makes the next document fresh.
STATS_MAX_AGE: Final = 0.25
EVENTS_PATH: Final = "/agentkv/v1/events"
STATE_PATH: Final = "/agentkv/v1/state"
MERGE_PATH: Final = "/agentkv/v1/merge"
# What a warm-up decision reads: the engine's queues, free blocks and anchor residency, without
# building a stats document or rendering vLLM's whole /metrics exposition.
VIEW_PATH: Final = "/agentkv/v1/view"

MAX_ID_LENGTH: Final = 128
_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")
_VALID_IDS: set[str] = set()  # ids that passed validate_id: each request repeats its agents' (bounded)
_MAX_VALID_IDS: Final = 65_536
_MAX_STEP: Final = 2**63 - 1
_OWS: Final = " \t"  # HTTP's optional whitespace around a header value

logger = logging.getLogger("agentkv.protocol")


class ProtocolError(ValueError):
    """A value that violates the wire contract."""


class InvalidMetadata(ProtocolError):
    """Malformed tag metadata; ``field`` names the header (or xargs key) at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def validate_id(value: str, field: str) -> str:
    """Return ``value`` if it is a valid agent or session id, else raise InvalidMetadata."""
    if type(value) is str and value in _VALID_IDS:
        return value
    if not isinstance(value, str):
        raise InvalidMetadata(field, f"must be a string, got {type(value).__name__}")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidMetadata(field, f"longer than {MAX_ID_LENGTH} characters")
    if not _ID_PATTERN.fullmatch(value):
        raise InvalidMetadata(field, "must be 1-128 characters of [A-Za-z0-9._:@/-]")
    if len(_VALID_IDS) < _MAX_VALID_IDS:
        _VALID_IDS.add(value)
    return value


@dataclass(frozen=True, slots=True)
class AgentTag:
    """What one LLM request says about itself.

    ``parent`` is the agent that ran before in this session: ``""`` for the first
    dispatch of a session, ``None`` when the sender does not know (the server then
    uses the session's last agent).
    """

    agent: str
    session: str | None = None
    parent: str | None = None
    step: int | None = None
    warmup: bool = False

    def __post_init__(self) -> None:
        validate_id(self.agent, HEADER_AGENT)
        if self.session is not None:
            validate_id(self.session, HEADER_SESSION)
        if self.parent:
            validate_id(self.parent, HEADER_PARENT)
        if self.step is not None and (
            isinstance(self.step, bool) or not isinstance(self.step, int) or not 0 <= self.step <= _MAX_STEP
        ):
            raise InvalidMetadata(HEADER_STEP, "must be a non-negative integer")

    def to_headers(self) -> dict[str, str]:
        headers = {HEADER_AGENT: self.agent}
        if self.session is not None:
            headers[HEADER_SESSION] = self.session
            headers[HEADER_VLLM_SESSION] = self.session
        if self.parent is not None:
            headers[HEADER_PARENT] = self.parent
        if self.step is not None:
            headers[HEADER_STEP] = str(self.step)
        if self.warmup:
            headers[HEADER_WARMUP] = "1"
        return headers

    def to_xargs(self) -> dict[str, str | int]:
        xargs: dict[str, str | int] = {XARG_AGENT: self.agent}
        if self.session is not None:
            xargs[XARG_SESSION] = self.session
        if self.parent is not None:
            xargs[XARG_PARENT] = self.parent
        if self.step is not None:
            xargs[XARG_STEP] = self.step
        if self.warmup:
            xargs[XARG_WARMUP] = 1
        return xargs


@dataclass(frozen=True, slots=True)
class ParseResult:
    """A parsed tag (None when the request carries none or it was rejected) and its errors."""

    tag: AgentTag | None
    errors: tuple[InvalidMetadata, ...] = ()


_FIELDS: Final = (
    ("agent", HEADER_AGENT, XARG_AGENT),
    ("session", HEADER_SESSION, XARG_SESSION),
    ("parent", HEADER_PARENT, XARG_PARENT),
    ("step", HEADER_STEP, XARG_STEP),
    ("warmup", HEADER_WARMUP, XARG_WARMUP),
)
_HEADER_NAMES: Final = {key: header for key, header, _ in _FIELDS}
_XARG_NAMES: Final = {key: xarg for key, _, xarg in _FIELDS}


def _parse_step(raw: object, field: str) -> int:
    if isinstance(raw, bool):
        raise InvalidMetadata(field, "must be a non-negative integer")
    if isinstance(raw, int):
        value = raw
    elif isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= 19:
        value = int(raw)
    else:
        raise InvalidMetadata(field, "must be a non-negative integer")
    if not 0 <= value <= _MAX_STEP:
        raise InvalidMetadata(field, "must be a non-negative integer")
    return value


def _parse_warmup(raw: object, field: str) -> bool:
    if raw in ("1", 1, True, "true"):
        return True
    if raw in ("0", 0, False, "false", ""):
        return False
    raise InvalidMetadata(field, "must be 1 or 0")


def _parse(values: Mapping[str, object], names: Mapping[str, str], strict: bool) -> ParseResult:
    """Build an AgentTag from raw values keyed by field name.

    Lenient mode (the default): any malformed field makes the whole tag ``None`` and the
    request is served untagged. Strict mode raises the first InvalidMetadata.
    """
    if not values:
        return ParseResult(None)
    errors: list[InvalidMetadata] = []
    fields: dict[str, Any] = {}
    for key, raw in values.items():
        field = names[key]
        try:
            if key == "step":
                fields[key] = _parse_step(raw, field)
            elif key == "warmup":
                fields[key] = _parse_warmup(raw, field)
            elif key == "parent" and raw == "":
                fields[key] = ""
            else:
                fields[key] = validate_id(raw, field)  # type: ignore[arg-type]
        except InvalidMetadata as exc:
            errors.append(exc)
    if "agent" not in values:
        errors.append(InvalidMetadata(names["agent"], "missing while other agentkv fields are present"))
    if errors:
        if strict:
            raise errors[0]
        return ParseResult(None, tuple(errors))
    return ParseResult(AgentTag(**fields))


def names_a_session(session_id: str, agent: object) -> bool:
    """Whether vLLM's session id of a tagged request that names no session of its own stands for
    its session: not when it is the agent's own name, the routing key of ``set_routing_key("agent")``
    (it groups an agent's calls on one replica; the conversation is for recognition to find)."""
    return session_id != agent


def parse_headers(headers: Mapping[str, str], *, strict: bool = False) -> ParseResult:
    """Parse the agentkv headers of one request (header names are case-insensitive).

    ``X-Session-ID`` alone does not make a tag, but it stands in for a missing
    ``X-AgentKV-Session`` (not on a warm-up, where it is a routing key only); the header is
    vLLM's, so a value outside agentkv's ids does not make the tag malformed: it is left out
    (the engine counts it where it reads the header).
    """
    lowered = {k.lower(): v.strip(_OWS) for k, v in headers.items()}
    values: dict[str, object] = {}
    for key, header, _ in _FIELDS:
        if header.lower() in lowered:
            values[key] = lowered[header.lower()]
    stand_in = lowered.get(HEADER_VLLM_SESSION.lower())
    warmup = "warmup" in values  # a warm-up carries X-Session-ID only as a routing key: it joins no session
    if values and not warmup and "session" not in values and stand_in is not None \
            and _ID_PATTERN.fullmatch(stand_in) and names_a_session(stand_in, values.get("agent")):
        values["session"] = stand_in
    return _parse(values, _HEADER_NAMES, strict)


def parse_header_list(pairs: Iterable[tuple[str, str]]) -> ParseResult:
    """Lenient parse of a request's raw header list, as HTTP reads it: optional whitespace
    around a value is stripped, and an agentkv header or ``X-Session-ID`` sent more than once
    is malformed (agentkv and vLLM could otherwise read different values)."""
    wanted = {header.lower(): header for _, header, _ in _FIELDS} | {HEADER_VLLM_SESSION.lower(): HEADER_VLLM_SESSION}
    values: dict[str, str] = {}
    repeated: list[InvalidMetadata] = []
    for name, value in pairs:
        header = wanted.get(name.lower())
        if header is None:
            continue
        if header in values:
            if all(e.field != header for e in repeated):
                repeated.append(InvalidMetadata(header, "sent more than once"))
            continue
        values[header] = value
    result = parse_headers(values)
    if not repeated:
        return result
    return ParseResult(None, (*repeated, *result.errors))


def parse_xargs(xargs: Mapping[str, object] | None, *, strict: bool = False) -> ParseResult:
    """Parse the agentkv keys of a request's ``vllm_xargs`` (``sampling_params.extra_args``)."""
    if not xargs:
        return ParseResult(None)
    values = {key: xargs[xarg] for key, _, xarg in _FIELDS if xarg in xargs}
    return _parse(values, _XARG_NAMES, strict)


class MalformedCounter:
    """Counts malformed metadata by field and logs each field's first occurrence once."""

    def __init__(self, log: logging.Logger = logger) -> None:
        self.by_field: Counter[str] = Counter()
        self._log = log

    def record(self, errors: tuple[InvalidMetadata, ...]) -> None:
        for error in errors:
            if self.by_field[error.field] == 0:
                self._log.warning("agentkv: ignoring malformed metadata (%s); further ones are only counted", error)
            self.by_field[error.field] += 1

    @property
    def total(self) -> int:
        return sum(self.by_field.values())


_ID_SCHEMA: Final = {"type": "string", "pattern": r"^[A-Za-z0-9._:@/-]{1,128}$"}
_EDGE_SCHEMA: Final = {"type": "array", "items": _ID_SCHEMA, "minItems": 2, "maxItems": 2}

EVENTS_SCHEMA: Final[dict[str, Any]] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "agentkv events, v1",
    "type": "object",
    "required": ["version", "events"],
    "additionalProperties": False,
    "properties": {
        "version": {"const": PROTOCOL_VERSION},
        "events": {
            "type": "array",
            "maxItems": 1000,
            "items": {
                "oneOf": [
                    {
                        "type": "object",
                        "required": ["type", "nodes"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"const": "graph"},
                            "id": _ID_SCHEMA,
                            "app": _ID_SCHEMA,
                            "nodes": {"type": "array", "items": _ID_SCHEMA, "maxItems": 1024},
                            "edges": {"type": "array", "items": _EDGE_SCHEMA, "maxItems": 4096},
                            "conditional_edges": {"type": "array", "items": _EDGE_SCHEMA, "maxItems": 4096},
                            "entry": {"type": "array", "items": _ID_SCHEMA, "maxItems": 1024},
                        },
                    },
                    {
                        "type": "object",
                        "required": ["type", "session"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"enum": ["session_start", "session_end", "cancel"]},
                            "id": _ID_SCHEMA,
                            "session": _ID_SCHEMA,
                        },
                    },
                ]
            },
        },
    },
}

_COUNT: Final = {"type": "integer", "minimum": 0}
_PROB: Final = {"type": "number", "minimum": 0, "maximum": 1}

STATS_SCHEMA: Final[dict[str, Any]] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "agentkv stats, v1",
    "type": "object",
    "required": ["version", "enabled", "policy", "predictability", "top1_accuracy", "agents", "evictions", "learner"],
    "properties": {
        "version": {"const": PROTOCOL_VERSION},
        "enabled": {"type": "boolean"},
        "policy": {"enum": ["survival", "lru"]},
        "predictability": _PROB,
        "top1_accuracy": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "dispatches": _COUNT,
        "sessions": {"type": "object"},
        "agents": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["queries", "hits"],
                "properties": {
                    "queries": _COUNT,
                    "hits": _COUNT,
                    "anchor_blocks": _COUNT,
                    "history_blocks": _COUNT,
                    "survival": _PROB,
                    "anchor_length_blocks": _COUNT,
                    "anchor_resident_blocks": _COUNT,
                },
            },
        },
        "kv_free_blocks": {"type": ["integer", "null"], "minimum": 0},
        "warmups": {
            "type": "object",
            "required": ["sent", "useful", "wasted", "redundant", "pending"],
            "properties": {"sent": _COUNT, "useful": _COUNT, "wasted": _COUNT, "redundant": _COUNT,
                           "pending": _COUNT, "wasted_by": {"type": "object", "additionalProperties": _COUNT},
                           "useful_lead_s": {
                               "type": "object",
                               "required": ["bounds", "counts", "sum"],
                               "properties": {"bounds": {"type": "array", "items": {"type": "number"}},
                                              "counts": {"type": "array", "items": _COUNT},
                                              "sum": {"type": "number", "minimum": 0}},
                           }},
        },
        "trace": {
            "type": ["object", "null"],
            "required": ["path", "written", "dropped", "error"],
            "properties": {"path": {"type": "string"}, "written": _COUNT, "dropped": _COUNT,
                           "error": {"type": ["string", "null"]}},
        },
        "transitions": {"type": "object"},
        "evictions": {
            "type": "object",
            "required": ["anchor", "history", "untagged"],
            "properties": {"anchor": _COUNT, "history": _COUNT, "untagged": _COUNT, "retired": _COUNT},
        },
        "learner": {"type": "object", "required": ["bytes"], "properties": {"bytes": _COUNT}},
        "timing": {"type": "object", "required": ["gaps", "agents"], "properties": {"gaps": _COUNT, "agents": _COUNT}},
        "malformed_metadata": {"type": "object", "additionalProperties": _COUNT},
    },
}

_EVENTS_VALIDATOR: Final = jsonschema.Draft202012Validator(EVENTS_SCHEMA)


_MAX_ERROR_MESSAGE = 200  # characters of a schema error told back (its message quotes the value)
_MAX_EVENTS: Final = EVENTS_SCHEMA["properties"]["events"]["maxItems"]
_MAX_LISTS: Final = {name: field["maxItems"] for name, field in
                     EVENTS_SCHEMA["properties"]["events"]["items"]["oneOf"][0]["properties"].items()
                     if field.get("type") == "array"}


def _check_sizes(payload: object) -> None:
    """The schema's size caps, checked first and by hand: jsonschema reads every item of an
    over-long list before it says so (seconds for 200,000 of them)."""
    events = payload.get("events") if isinstance(payload, dict) else None
    if not isinstance(events, list):
        return  # the schema names the problem
    if len(events) > _MAX_EVENTS:
        raise ProtocolError(f"invalid events payload at events: {len(events)} events, at most {_MAX_EVENTS}")
    for number, event in enumerate(events):
        for name, cap in _MAX_LISTS.items():
            value = event.get(name) if isinstance(event, dict) else None
            if isinstance(value, list) and len(value) > cap:
                raise ProtocolError(f"invalid events payload at events/{number}/{name}: "
                                    f"{len(value)} items, at most {cap}")


def validate_events(payload: object) -> list[dict[str, Any]]:
    """Return the events of a ``POST /agentkv/v1/events`` body, or raise ProtocolError (its
    message at most a few hundred characters, whatever the payload)."""
    _check_sizes(payload)
    # the first error only (with its context): reading on to rank them all took seconds on 1,000 bad events
    error = jsonschema.exceptions.best_match(itertools.islice(_EVENTS_VALIDATOR.iter_errors(payload), 1))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "body"
        message = error.message if len(error.message) <= _MAX_ERROR_MESSAGE else \
            error.message[:_MAX_ERROR_MESSAGE] + "..."
        raise ProtocolError(f"invalid events payload at {where[:_MAX_ERROR_MESSAGE]}: {message}")
    assert isinstance(payload, dict)
    events = list(payload["events"])
    for number, event in enumerate(events):  # the schema's pattern lets "id\n" through; validate_id does not
        for field, value in _event_ids(event):
            try:
                validate_id(value, field)
            except InvalidMetadata as exc:
                raise ProtocolError(f"invalid events payload at events/{number}/{exc}") from None
    return events


def _event_ids(event: Mapping[str, Any]) -> Iterable[tuple[str, str]]:
    """Every id an event names (START/END included: they match the id alphabet too)."""
    for field in ("id", "app", "session"):
        if field in event:
            yield field, event[field]
    for field in ("nodes", "entry"):
        for value in event.get(field, ()):
            yield field, value
    for field in ("edges", "conditional_edges"):
        for edge in event.get(field, ()):
            for value in edge:
                yield field, value
