"""The wire contract: headers, vllm_xargs, validation, events."""

import logging

import pytest

from agentkv.protocol import (
    HEADER_AGENT,
    HEADER_PARENT,
    HEADER_STEP,
    AgentTag,
    InvalidMetadata,
    MalformedCounter,
    ProtocolError,
    parse_headers,
    parse_xargs,
    validate_events,
)


def test_tag_round_trips_through_headers_and_xargs():
    tag = AgentTag("planner", session="thread-1", parent="supervisor", step=3)
    headers = tag.to_headers()
    assert headers == {
        "X-AgentKV-Agent": "planner",
        "X-AgentKV-Session": "thread-1",
        "X-Session-ID": "thread-1",
        "X-AgentKV-Parent": "supervisor",
        "X-AgentKV-Step": "3",
    }
    assert parse_headers({k.lower(): v for k, v in headers.items()}).tag == tag
    xargs = tag.to_xargs()
    assert xargs == {"agentkv_agent": "planner", "agentkv_session": "thread-1", "agentkv_parent": "supervisor",
                     "agentkv_step": 3}
    assert parse_xargs(xargs).tag == tag


def test_first_dispatch_has_an_empty_parent_and_warmups_are_flagged():
    tag = AgentTag("a", session="s", parent="", warmup=True)
    assert tag.to_headers()[HEADER_PARENT] == ""
    assert tag.to_headers()["X-AgentKV-Warmup"] == "1"
    assert parse_headers(tag.to_headers()).tag == tag
    assert parse_xargs(tag.to_xargs()).tag == tag


def test_vllm_session_header_stands_in_for_the_agentkv_one():
    assert parse_headers({"X-AgentKV-Agent": "a", "X-Session-ID": "s9"}).tag == AgentTag("a", session="s9")
    assert parse_headers({"X-Session-ID": "s9"}).tag is None  # a session alone is not a tag
    assert parse_headers({}).tag is None and parse_xargs(None).tag is None
    # vLLM's header, not agentkv's: a value outside agentkv's ids (a space, base64's "=") is left out
    for routing_key in ("user 42", "dXNlcjQy=", "x" * 129):
        result = parse_headers({"X-AgentKV-Agent": "a", "X-Session-ID": routing_key})
        assert result.tag == AgentTag("a") and result.errors == ()
    assert parse_headers({"X-AgentKV-Agent": "a", "X-AgentKV-Session": "user 42"}).tag is None  # agentkv's own


@pytest.mark.parametrize(
    ("headers", "field"),
    [
        ({HEADER_AGENT: "bad agent"}, HEADER_AGENT),
        ({HEADER_AGENT: "a" * 129}, HEADER_AGENT),
        ({HEADER_AGENT: ""}, HEADER_AGENT),
        ({HEADER_AGENT: "a", HEADER_STEP: "-1"}, HEADER_STEP),
        ({HEADER_AGENT: "a", HEADER_STEP: "3.5"}, HEADER_STEP),
        ({HEADER_AGENT: "a", HEADER_STEP: "٣"}, HEADER_STEP),
        ({HEADER_AGENT: "a", "X-AgentKV-Warmup": "yes"}, "X-AgentKV-Warmup"),
        ({HEADER_AGENT: "a", HEADER_PARENT: "p\u00e9re"}, HEADER_PARENT),
        ({HEADER_PARENT: "a"}, HEADER_AGENT),
    ],
)
def test_malformed_headers_are_ignored_by_default_and_named_in_strict_mode(headers, field):
    result = parse_headers(headers)
    assert result.tag is None
    assert result.errors and result.errors[0].field == field
    with pytest.raises(InvalidMetadata, match=field):
        parse_headers(headers, strict=True)


def test_malformed_xargs_name_the_key():
    result = parse_xargs({"agentkv_agent": "a", "agentkv_step": True})
    assert result.tag is None and result.errors[0].field == "agentkv_step"
    with pytest.raises(InvalidMetadata, match="agentkv_agent"):
        parse_xargs({"agentkv_agent": 5}, strict=True)
    assert parse_xargs({"other": 1}).tag is None


def test_tag_constructor_validates():
    with pytest.raises(InvalidMetadata):
        AgentTag("a", step=-2)
    with pytest.raises(InvalidMetadata):
        AgentTag("a b")


def test_malformed_counter_logs_each_field_once(caplog):
    counter = MalformedCounter()
    with caplog.at_level(logging.WARNING, logger="agentkv.protocol"):
        for _ in range(3):
            counter.record(parse_headers({HEADER_AGENT: "bad agent"}).errors)
        counter.record(parse_headers({HEADER_AGENT: "a", HEADER_STEP: "x"}).errors)
    assert counter.by_field == {HEADER_AGENT: 3, HEADER_STEP: 1}
    assert counter.total == 4
    assert len(caplog.records) == 2


@pytest.mark.parametrize(
    "payload",
    [
        {"events": []},
        {"version": 2, "events": []},
        {"version": 1, "events": [{"type": "graph"}]},
        {"version": 1, "events": [{"type": "session_end", "session": "bad id"}]},
        {"version": 1, "events": [{"type": "explode", "session": "s"}]},
        {"version": 1, "events": [{"type": "graph", "nodes": ["a"], "edges": [["a"]]}]},
        [],
    ],
)
def test_bad_event_payloads_are_refused(payload):
    with pytest.raises(ProtocolError, match="invalid events payload"):
        validate_events(payload)


@pytest.mark.parametrize(("payload", "message"), [
    ({"version": 1, "events": [0] * 200_000}, "at events: 200000 events, at most 1000"),
    ({"version": 1, "events": [{"type": "graph", "nodes": ["a"] * 200_000}]}, "at events/0/nodes: 200000 items"),
    ({"version": 1, "events": [{"type": "graph", "nodes": ["a"], "edges": [["a", "b"]] * 5000}]},
     "at events/0/edges: 5000 items, at most 4096"),
])
def test_an_over_long_list_is_refused_before_its_items_are_read(payload, message):
    """jsonschema reads every item of an over-long list before it says so: 200,000 of them took
    5-11 s, under the engine's lock. The caps are checked first, by hand."""
    with pytest.raises(ProtocolError, match=message):
        validate_events(payload)


def test_a_refusal_never_quotes_a_large_payload_back():
    with pytest.raises(ProtocolError) as refused:
        validate_events({"version": 1, "events": [{"type": "session_end", "session": "s" * 100_000}]})
    assert len(str(refused.value)) < 500


def test_good_event_payload():
    events = validate_events({"version": 1, "events": [{"type": "session_end", "session": "s1", "id": "x"}]})
    assert events == [{"type": "session_end", "session": "s1", "id": "x"}]
