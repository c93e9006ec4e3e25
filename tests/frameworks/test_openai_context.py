"""The tagging core with the plain OpenAI SDK: agentkv.agent(), install(), hooks, never breaking calls."""

from __future__ import annotations

import asyncio
import importlib.util
import logging

import pytest

import agentkv
import agentkv.client
from agentkv.frameworks import (
    Dispatch,
    TaggedRequest,
    current_tag,
    install,
    on_dispatch,
    on_dispatch_end,
    on_request,
    sanitize_id,
    stats,
    tracker,
    use_tag,
)
from agentkv.protocol import AgentTag, validate_id


def _ask(client, text: str = "hi", **kwargs):
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], **kwargs)


def test_top_level_exports_are_lazy_and_work():
    assert agentkv.agent is agentkv.client.agent
    if importlib.util.find_spec("langgraph") is not None:
        assert agentkv.instrument.__module__ == "agentkv.frameworks.langgraph"
    with pytest.raises(AttributeError):
        agentkv.no_such_thing  # noqa: B018


def test_install_is_idempotent_and_wraps_both_clients():
    from openai import _base_client

    assert install() and install()
    sync_hook = _base_client.SyncAPIClient._prepare_options
    async_hook = _base_client.AsyncAPIClient._prepare_options
    assert getattr(sync_hook, "__agentkv_wrapped__", None) is not None
    assert getattr(async_hook, "__agentkv_wrapped__", None) is not None
    assert getattr(sync_hook.__agentkv_wrapped__, "__agentkv_wrapped__", None) is None  # wrapped once
    assert asyncio.iscoroutinefunction(async_hook)
    for cls in (_base_client.SyncAPIClient, _base_client.AsyncAPIClient):  # the same patch reports responses
        response_hook = cls._process_response
        assert getattr(response_hook.__agentkv_wrapped__, "__agentkv_wrapped__", None) is None
    assert asyncio.iscoroutinefunction(_base_client.AsyncAPIClient._process_response)


def test_untagged_calls_carry_no_agentkv_headers(server):
    install()
    _ask(server.openai())
    assert server.requests[0].tag == (None, None, None, None)
    assert "x-session-id" not in server.requests[0].headers


def test_agent_context_manager_tracks_lineage_and_steps(server, session, dispatches):
    client = server.openai()
    ended: list[Dispatch] = []
    unsubscribe = on_dispatch_end(ended.append)
    try:
        for name in ("planner", "coder", "planner"):
            with agentkv.agent(name, session=session) as tag:
                assert current_tag() == tag
                assert len(ended) == len(dispatches) - 1  # the end comes when the block exits
                _ask(client, name)
                _ask(client, name)  # several calls in one dispatch share its tag
    finally:
        unsubscribe()
    assert current_tag() is None
    assert ended == dispatches
    assert server.tags() == [
        ("planner", session, "", 1),
        ("planner", session, "", 1),
        ("coder", session, "planner", 2),
        ("coder", session, "planner", 2),
        ("planner", session, "coder", 3),
        ("planner", session, "coder", 3),
    ]
    assert server.requests[0].headers["x-session-id"] == session
    assert [(d.agent, d.parent, d.step, d.framework) for d in dispatches] == [
        ("planner", "", 1, "manual"),
        ("coder", "planner", 2, "manual"),
        ("planner", "coder", 3, "manual"),
    ]


def test_stream_raw_and_explicit_parent(server, session):
    client = server.openai()
    with agentkv.agent("a", session=session):
        chunks = list(_ask(client, "stream", stream=True))
        assert chunks[0].choices[0].delta.content == "ok"
    with agentkv.agent("b", session=session, parent="x"):
        raw = client.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "r"}])
        assert raw.parse().choices[0].message.content == "ok"
    with agentkv.agent("c", session=session, step=42):
        with client.chat.completions.with_streaming_response.create(
            model="m", messages=[{"role": "user", "content": "s"}]
        ) as response:
            response.read()
    assert server.tags() == [("a", session, "", 1), ("b", session, "x", 2), ("c", session, "b", 42)]


def test_async_client_and_concurrent_tasks_keep_their_own_tags(server, session):
    client = server.async_openai()

    async def worker(name: str, sess: str) -> None:
        async with agentkv.agent(name, session=sess):
            await asyncio.sleep(0)
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": name}])
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": name}], stream=True
            )
            async for _ in stream:
                pass

    async def main() -> None:
        await asyncio.gather(*(worker(f"w{i}", f"{session}-{i}") for i in range(5)))

    asyncio.run(main())
    assert len(server.requests) == 10
    for r in server.requests:
        agent, sess, parent, step = r.tag
        assert sess == f"{session}-{agent[1:]}" and parent == "" and step == 1


def test_session_is_inherited_and_ids_are_sanitized(server, session):
    client = server.openai()
    with use_tag(AgentTag("outer", session=session)):
        with agentkv.agent("my agent/ü"):
            _ask(client)
    agent, sess, parent, step = server.requests[0].tag
    assert agent == sanitize_id("my agent/ü") and agent.startswith("my_agent/_-") and sess == session
    assert parent == "" and step == 1
    long = "x" * 300
    assert len(sanitize_id(long)) == 128 and validate_id(sanitize_id(long), "t")
    assert sanitize_id(long) != sanitize_id("x" * 299)
    assert sanitize_id("") == "_" and sanitize_id("ok.id:1@a/b-c") == "ok.id:1@a/b-c"
    assert sanitize_id("Research Agent") == "Research_Agent"
    # names in another script would all read "___": each keeps its own id, and stays valid
    chinese = [sanitize_id(name) for name in ("研究员", "审稿人", "研究员" * 60)]
    assert len(set(chinese)) == 3 and all(validate_id(i, "t") for i in chinese)
    assert all(sanitize_id(i) == i for i in chinese)


def test_no_session_means_no_lineage(server):
    client = server.openai()
    with agentkv.agent("solo"):
        _ask(client)
    assert server.requests[0].tag == ("solo", None, None, None)


def test_use_tag_for_warmup_requests(server, session):
    client = server.openai()
    with use_tag(AgentTag("coder", session=session, warmup=True)):
        _ask(client)
    assert server.requests[0].headers["x-agentkv-warmup"] == "1"
    assert tracker().last_agent(session) is None  # use_tag records no dispatch


def test_explicit_caller_headers_win(server, session):
    client = server.openai()
    with agentkv.agent("auto", session=session):
        _ask(client, extra_headers={"X-AgentKV-Agent": "mine"})
    assert server.requests[0].headers["x-agentkv-agent"] == "mine"
    assert "x-agentkv-session" not in server.requests[0].headers


def test_on_request_sees_the_body_for_anchor_capture(server, session):
    captured: list[TaggedRequest] = []
    unsubscribe = on_request(captured.append)
    try:
        with agentkv.agent("writer", session=session):
            _ask(server.openai(), "draft")
    finally:
        unsubscribe()
    (req,) = captured
    assert req.tag.agent == "writer" and req.url == "/chat/completions" and req.method.lower() == "post"
    assert req.base_url.startswith("http://127.0.0.1:9/v1")
    assert req.json_data["messages"] == [{"role": "user", "content": "draft"}]


def test_failures_never_break_the_call(server, session, monkeypatch, caplog):
    def boom(*args, **kwargs):
        raise RuntimeError("listener bug")

    unsubscribe_d = on_dispatch(boom)
    unsubscribe_r = on_request(boom)
    monkeypatch.setattr(agentkv.client.ERRORS, "by_kind", type(agentkv.client.ERRORS.by_kind)())
    try:
        with caplog.at_level(logging.WARNING, logger="agentkv.frameworks"):
            client = server.openai()
            for _ in range(3):
                with agentkv.agent("a", session=session):
                    assert _ask(client).choices[0].message.content == "ok"
    finally:
        unsubscribe_d()
        unsubscribe_r()
    errors = stats()["errors"]
    assert errors["dispatch listener"] == 3 and errors["request listener"] == 3
    assert len([r for r in caplog.records if "listener" in r.getMessage()]) == 2  # logged once per kind
    assert server.tags()[0] == ("a", session, "", 1)  # still tagged

    # a failure inside tagging itself: the request goes out untagged, counted
    monkeypatch.setattr(AgentTag, "to_headers", boom)
    with agentkv.agent("b", session=session):
        assert _ask(client).choices[0].message.content == "ok"
    assert server.requests[-1].tag == (None, None, None, None)
    assert stats()["errors"]["request tagging"] == 1


def test_learner_listener_feeds_a_transition_learner(session):
    from agentkv.frameworks import learner_listener
    from agentkv.graph import TransitionLearner

    learner = TransitionLearner()
    unsubscribe = on_dispatch(learner_listener(learner))
    try:
        for name in ("plan", "code", "plan", "code"):
            with agentkv.agent(name, session=session):
                pass
    finally:
        unsubscribe()
    assert learner.dispatches == 4 and learner.current_agent(session) == "code"
