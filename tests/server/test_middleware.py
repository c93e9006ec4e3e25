"""AgentKVMiddleware as ASGI, with the real control channel to a real AgentKVRuntime."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading

import httpx
import pytest

from agentkv.protocol import EVENTS_PATH, MERGE_PATH, STATE_PATH, STATS_PATH
from server_patch._control import ControlServer
from server_patch._runtime import AgentKVRuntime, RuntimeConfig
from server_patch.middleware import AgentKVMiddleware

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def echo_app(scope, receive, send):
    """Stands in for vLLM's app: answers with the body and headers it received."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/metrics":
        payload = b"vllm:prefix_cache_queries_total 3.0\n"
    else:
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        payload = json.dumps({"body": body.decode(), "content-length": headers.get("content-length")}).encode()
    headers = [(b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


@pytest.fixture
def runtime_endpoint(tmp_path, monkeypatch):
    endpoint = f"ipc://{tmp_path}/control.ipc"
    monkeypatch.setenv("AGENTKV_CONTROL", endpoint)
    runtime = AgentKVRuntime()
    server = ControlServer(endpoint, runtime.handle)
    yield runtime
    server.close()


def client(middleware: AgentKVMiddleware) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=middleware), base_url="http://test")


BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}
TAG = {"X-AgentKV-Agent": "coder", "X-AgentKV-Session": "t1", "X-AgentKV-Parent": "", "X-AgentKV-Step": "0"}


async def test_untagged_requests_pass_through_byte_for_byte():
    raw = b'{"model":"m",  "prompt":"hi"}'
    async with client(AgentKVMiddleware(echo_app)) as c:
        echoed = (await c.post("/v1/completions", content=raw)).json()
    assert echoed["body"].encode() == raw


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
async def test_headers_become_vllm_xargs(path):
    async with client(AgentKVMiddleware(echo_app)) as c:
        echoed = (await c.post(path, json={**BODY, "vllm_xargs": {"other": 1}}, headers=TAG)).json()
    body = json.loads(echoed["body"])
    assert body["vllm_xargs"] == {"other": 1, "agentkv_agent": "coder", "agentkv_session": "t1",
                                  "agentkv_parent": "", "agentkv_step": 0}
    assert int(echoed["content-length"]) == len(echoed["body"].encode())


async def test_body_form_wins_over_headers():
    xargs = {"agentkv_agent": "writer", "agentkv_session": "t9"}
    async with client(AgentKVMiddleware(echo_app)) as c:
        echoed = (await c.post("/v1/completions", json={**BODY, "vllm_xargs": xargs}, headers=TAG)).json()
    assert json.loads(echoed["body"])["vllm_xargs"] == xargs


async def test_malformed_headers_are_served_untagged_and_counted():
    middleware = AgentKVMiddleware(echo_app)
    async with client(middleware) as c:
        response = await c.post("/v1/completions", json=BODY, headers={**TAG, "X-AgentKV-Step": "-1"})
    assert response.status_code == 200
    assert "vllm_xargs" not in json.loads(response.json()["body"])
    assert middleware.malformed.by_field == {"X-AgentKV-Step": 1}


@pytest.mark.parametrize(
    ("headers", "body", "named"),
    [
        ({**TAG, "X-AgentKV-Agent": "bad agent"}, BODY, "X-AgentKV-Agent"),
        ({}, {**BODY, "vllm_xargs": {"agentkv_agent": "a", "agentkv_step": "x"}}, "agentkv_step"),
    ],
)
async def test_strict_mode_answers_400_naming_the_field(monkeypatch, headers, body, named):
    monkeypatch.setenv("AGENTKV_STRICT", "1")
    async with client(AgentKVMiddleware(echo_app)) as c:
        response = await c.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(named)


async def test_stats_and_events_reach_the_engine_runtime(runtime_endpoint):
    middleware = AgentKVMiddleware(echo_app)
    async with client(middleware) as c:
        await c.post("/v1/completions", json=BODY, headers={**TAG, "X-AgentKV-Agent": "bad agent"})
        stats = (await c.get(STATS_PATH)).json()
        assert stats["malformed_metadata"] == {"X-AgentKV-Agent": 1}
        assert stats["policy"] == "lru"
        event = {"version": 1, "events": [{"type": "session_end", "session": "t1", "id": "e1"}]}
        assert (await c.post(EVENTS_PATH, json=event)).json() == {"accepted": 1, "duplicates": 0}
        assert (await c.post(EVENTS_PATH, json=event)).json() == {"accepted": 0, "duplicates": 1}
        bad = await c.post(EVENTS_PATH, json={"version": 1, "events": [{"type": "nope"}]})
        assert bad.status_code == 400
        assert (await c.post(EVENTS_PATH, content=b"{")).status_code == 400
        metrics = (await c.get("/metrics")).text
    assert metrics.startswith("vllm:prefix_cache_queries_total 3.0\n")
    assert "agentkv_predictability 0.0" in metrics
    assert runtime_endpoint.facts.is_ended("t1")


async def test_an_engine_that_fails_to_build_its_stats_gives_503_not_a_200_without_them(runtime_endpoint,
                                                                                        monkeypatch):
    def broken() -> dict:
        raise RuntimeError("stats bug")

    monkeypatch.setattr(runtime_endpoint, "stats", broken)
    async with client(AgentKVMiddleware(echo_app)) as c:
        response = await c.get(STATS_PATH)
        assert response.status_code == 503 and "RuntimeError: stats bug" in response.text
        assert (await c.get("/metrics")).text == "vllm:prefix_cache_queries_total 3.0\n"  # vLLM's own still flow


async def test_a_mute_engine_gives_503_not_500(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTKV_CONTROL", f"ipc://{tmp_path}/nobody.ipc")
    middleware = AgentKVMiddleware(echo_app)
    middleware.timeout = 0.2
    async with client(middleware) as c:
        assert (await c.get(STATS_PATH)).status_code == 503
        assert (await c.post(EVENTS_PATH, json={"version": 1, "events": []})).status_code == 503
        assert (await c.get("/metrics")).status_code == 200  # vLLM's own metrics still flow


async def test_state_export_and_merge_between_replicas(tmp_path, monkeypatch):
    replicas = []
    for name in ("r1", "r2"):
        endpoint = f"ipc://{tmp_path}/{name}.ipc"
        runtime = AgentKVRuntime(RuntimeConfig(replica=name))
        replicas.append((runtime, ControlServer(endpoint, runtime.handle), endpoint))
    (first, _, first_endpoint), (second, _, second_endpoint) = replicas
    for _ in range(5):
        first.learner.observe("coder", parent="planner")
    try:
        monkeypatch.setenv("AGENTKV_CONTROL", first_endpoint)
        async with client(AgentKVMiddleware(echo_app)) as c:
            state = (await c.get(STATE_PATH)).json()
        assert state["replica"] == "r1" and state["agents"] == ["planner", "coder"]
        monkeypatch.setenv("AGENTKV_CONTROL", second_endpoint)
        async with client(AgentKVMiddleware(echo_app)) as c:
            assert (await c.post(MERGE_PATH, json=state)).json() == {"merged": True}
            assert (await c.post(MERGE_PATH, json=state)).json() == {"merged": False}  # idempotent
            assert (await c.post(MERGE_PATH, json={"format": "x"})).status_code == 400
            stats = (await c.get(STATS_PATH)).json()
        assert stats["learner"]["peers"] == {"r1": state["sequence"]}
        assert second.predictor.predict("planner").agent == "coder"
    finally:
        for _, server, _ in replicas:
            server.close()


def answering_app(chunks: list[bytes], status: int = 200):
    """Stands in for vLLM's app: answers with ``chunks`` (a JSON body or server-sent events)."""

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": status, "headers": []})
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})

    return app


TOOL_EVENTS = [b'data: {"choices":[{"delta":{"tool_calls":[{"index":0}]},"finish_reason":null}]}\n\n',
               b'data: {"choices":[{"delta":{},"finish_reas', b'on":"tool_calls"}]}\n\n', b"data: [DONE]\n\n"]
TOOLS = {"tools": [{"type": "function", "function": {"name": "search", "parameters": {}}}]}


async def _told(runtime: AgentKVRuntime, session: str) -> bool | None:
    for _ in range(100):
        told = runtime.timing.told(session)
        if told is not None:
            return told
        await asyncio.sleep(0.01)
    return None


# what vLLM 0.32 sends: a response's function call item, an Anthropic message's tool_use block
RESPONSES_CALL = [b'{"id":"resp_1","object":"response","output":[{"arguments":"{}","call_id":"call_1",'
                  b'"name":"search","type":"function_call","id":"fc_1"}],"tools":[{"name":"search","type":"function"}]}']
RESPONSES_TEXT = [b'{"id":"resp_2","output":[{"content":[{"text":"\\"type\\":\\"function_call\\"",'
                  b'"type":"output_text"}],"type":"message"}],"tools":[{"name":"search","type":"function"}]}']
MESSAGES_EVENTS = [b'event: message_start\ndata: {"type":"message_start","message":{"id":"chatcmpl-3"}}\n\n',
                   b'event: content_block_start\ndata: {"type":"content_block_start","content_block":{"type":"tool_',
                   b'use","id":"call_2","name":"search","input":{}},"index":0}\n\n']
MESSAGES_TEXT = [b'{"id":"chatcmpl-4","type":"message","content":[{"type":"text","text":"tool_use"}],'
                 b'"stop_reason":"end_turn"}']


@pytest.mark.parametrize(("path", "chunks", "status", "body", "told"), [
    ("/v1/chat/completions", TOOL_EVENTS, 200, {}, True),  # streamed, the finish reason split across two chunks
    ("/v1/chat/completions", [b'{"choices": [{"finish_reason": "tool_calls"}]}'], 200, TOOLS, True),
    ("/v1/chat/completions", [b'{"choices":[{"finish_reason":"stop"}]}'], 200, TOOLS, False),  # offered, none called
    ("/v1/chat/completions", [b'{"choices":[{"finish_reason":"stop"}]}'], 200, {}, None),  # none offered: nothing
    ("/v1/chat/completions", [b'{"error":{"message":"finish_reason tool_calls"}}'], 400, TOOLS, None),
    ("/v1/responses", RESPONSES_CALL, 200, TOOLS, True),
    ("/v1/responses", RESPONSES_TEXT, 200, TOOLS, False),  # the words in the text are not a call
    ("/v1/messages", MESSAGES_EVENTS, 200, TOOLS, True),  # streamed, the block type split across two chunks
    ("/v1/messages", MESSAGES_TEXT, 200, TOOLS, False),
    ("/v1/responses", [b'{"choices":[{"finish_reason":"tool_calls"}]}'], 200, TOOLS, False),  # another API's words
    # run in the background: answered "queued" before the model ran, so no call yet says nothing
    ("/v1/responses", [b'{"id":"resp_3","status":"queued","output":[]}'], 200, {**TOOLS, "background": True}, None),
])
async def test_the_engine_learns_whether_an_answer_called_a_tool(runtime_endpoint, path, chunks, status, body, told):
    middleware = AgentKVMiddleware(answering_app(chunks, status))
    session = f"t{path[4:8]}{len(chunks)}{status}{told}"
    runtime_endpoint.timing.observe(session, "coder", 0.0, 0)
    async with client(middleware) as c:
        response = await c.post(path, json={**BODY, **body}, headers={**TAG, "X-AgentKV-Session": session})
    assert response.content == b"".join(chunks)  # the user's answer is untouched
    assert await _told(runtime_endpoint, session) is told
    assert middleware.answer_failures == 0


async def test_a_mute_engine_never_fails_the_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTKV_CONTROL", f"ipc://{tmp_path}/nobody.ipc")
    middleware = AgentKVMiddleware(answering_app([b'{"choices":[{"finish_reason":"tool_calls"}]}']))
    middleware.timeout = 0.1
    async with client(middleware) as c:
        response = await c.post("/v1/chat/completions", json=BODY, headers=TAG)
    assert response.status_code == 200
    for _ in range(50):
        if middleware.answer_failures:
            break
        await asyncio.sleep(0.02)
    assert middleware.answer_failures == 1


@pytest.mark.parametrize("request_", [{"op": "answered", "session": "s", "tool_call": 1},
                                      {"op": "answered", "session": "bad id", "tool_call": True},
                                      {"op": "answered", "session": ["s"], "tool_call": False}])
def test_the_answered_op_refuses_malformed_input(request_):
    runtime = AgentKVRuntime()
    reply = runtime.handle(request_)
    assert reply["status"] == 400 and "error" in reply
    assert runtime.handle({"op": "answered", "session": "s", "tool_call": True}) == {"answered": True}


@pytest.mark.parametrize(("path", "chunks", "key"), [
    ("/v1/chat/completions", [b'data: {"id":"chatcmpl-9a","choices":[{"delta":{"tool_calls":[{"id":"call-1"',
                              b'}]}}]}\n\n', b"data: [DONE]\n\n"], "chatcmpl-9a"),
    ("/v1/completions", [b'{"id":"cmpl-77","choices":[{"finish_reason":"tool_calls"}]}'], "cmpl-77-0"),
    ("/v1/responses", [b'event: response.created\ndata: {"response":{"id":"resp_5","output":[]}}\n\n',
                       b'event: response.output_item.added\ndata: {"item":{"type":"function_call","id":"fc_5"}}\n\n'],
     "resp_5_0"),
    ("/v1/messages", MESSAGES_EVENTS, "chatcmpl-3"),
])
@pytest.mark.parametrize("headers", [{}, {"X-AgentKV-Agent": "coder"}], ids=["untagged", "agent-only"])
@pytest.mark.parametrize("text", [{}, {"user": "what is agentkv_agent?"}], ids=["", "naming-agentkv"])
async def test_an_answer_without_a_session_is_told_by_its_response_id(runtime_endpoint, path, chunks, key, headers,
                                                                       text):
    """No agentkv metadata at all, or an agent and no session: recognition may have found its session.
    An untagged body that only mentions ``agentkv_`` (read as JSON: no tag) was never told."""
    middleware = AgentKVMiddleware(answering_app(chunks))
    session = f"recognized-{key}-{len(headers)}-{len(text)}"
    runtime_endpoint.timing.observe(session, "fp:abc", 0.0, 0)
    runtime_endpoint._answer_sessions[key] = session  # what recognizing the request recorded
    async with client(middleware) as c:
        response = await c.post(path, json={**BODY, **TOOLS, **text}, headers=headers)
    assert response.content == b"".join(chunks)
    assert await _told(runtime_endpoint, session) is True
    assert middleware.answer_failures == 0


@pytest.mark.parametrize(("background", "told"), [(b"true", None), (b"false", False)])
async def test_an_untagged_response_run_in_the_background_tells_nothing(runtime_endpoint, background, told):
    middleware = AgentKVMiddleware(answering_app([b'{"id":"resp_4","status":"queued","output":[]}']))
    session = f"recognized-background-{background.decode()}"
    runtime_endpoint.timing.observe(session, "fp:abc", 0.0, 0)
    runtime_endpoint._answer_sessions["resp_4_0"] = session
    body = b'{"model":"m","input":"hi","tools":[{"type":"function","name":"f"}],"background": ' + background + b"}"
    async with client(middleware) as c:
        await c.post("/v1/responses", content=body)
    assert await _told(runtime_endpoint, session) is told


async def test_a_warm_up_answer_is_never_told_for_the_session_it_is_routed_by(runtime_endpoint):
    """A warm-up sends X-Session-ID as a routing key (agentkv.warmup, routing key "session"): it is
    no call of that session. Its one-token answer (no tool call, though the anchor offers tools)
    overwrote the session's last real answer (a tool call), and the session was tagged with it."""
    seen: list[object] = []

    async def vllm(scope, receive, send):
        seen.append(json.loads((await receive())["body"]).get("vllm_xargs"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        answer = b'{"id":"chatcmpl-w","choices":[{"finish_reason":"length"}]}'
        await send({"type": "http.response.body", "body": answer})

    runtime_endpoint.timing.observe("s1", "coder", 0.0, 0)
    runtime_endpoint.timing.answered("s1", True)
    headers = {"X-AgentKV-Agent": "coder", "X-AgentKV-Warmup": "1", "X-Session-ID": "s1"}
    async with client(AgentKVMiddleware(vllm)) as c:
        await c.post("/v1/chat/completions", json={**BODY, **TOOLS, "max_tokens": 1}, headers=headers)
    await asyncio.sleep(0.2)
    assert seen == [{"agentkv_agent": "coder", "agentkv_warmup": 1}]  # no session of its own
    assert runtime_endpoint.timing.told("s1") is True and not runtime_endpoint.answers


async def test_behind_a_root_path_tags_and_routes_are_read_as_vllm_routes_them(runtime_endpoint):
    """vLLM's ``--root-path /api`` serves ``/api/v1/...`` (the scope's path keeps the prefix; vLLM's
    routing and auth strip it): the tag was dropped silently and ``/api/agentkv/v1/view`` was 404."""
    transport = httpx.ASGITransport(app=AgentKVMiddleware(echo_app), root_path="/api")
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        echoed = (await c.post("/api/v1/completions", json=BODY, headers=TAG)).json()
        view = await c.get("/api/agentkv/v1/view")
    assert json.loads(echoed["body"])["vllm_xargs"]["agentkv_agent"] == "coder"
    assert view.status_code == 200 and "anchors" in view.json()


@pytest.mark.parametrize("named", ["header", "body", "xargs"])
async def test_an_agent_only_tag_is_told_for_the_session_vllm_names_it_by(runtime_endpoint, monkeypatch, named):
    """The agent in ``vllm_xargs``, the session in vLLM's own session id (the body's ``session_id``,
    else ``X-Session-ID``, else ``vllm_xargs``'): the engine takes that session, so the answer is told
    for it, with recognition off too (it was not watched: no agentkv session, no recognition)."""
    monkeypatch.setenv("AGENTKV_RECOGNIZE", "0")
    middleware = AgentKVMiddleware(answering_app([b'{"id":"chatcmpl-9","choices":[{"finish_reason":"tool_calls"}]}']))
    session = f"vllm-{named}"
    runtime_endpoint.timing.observe(session, "coder", 0.0, 0)
    xargs: dict[str, object] = {"agentkv_agent": "coder"}
    body: dict[str, object] = {**BODY, **TOOLS, "vllm_xargs": xargs}
    headers = {"X-Session-ID": session} if named == "header" else {}
    if named == "body":
        body["session_id"] = session
    elif named == "xargs":
        xargs["session_id"] = session
    async with client(middleware) as c:
        await c.post("/v1/chat/completions", json=body, headers=headers)
    assert await _told(runtime_endpoint, session) is True


async def test_untagged_answers_are_not_watched_without_recognition(runtime_endpoint, monkeypatch):
    monkeypatch.setenv("AGENTKV_RECOGNIZE", "0")
    middleware = AgentKVMiddleware(answering_app([b'{"id":"chatcmpl-1","choices":[{"finish_reason":"tool_calls"}]}']))
    runtime_endpoint.timing.observe("recognized-2", "fp:abc", 0.0, 0)
    runtime_endpoint._answer_sessions["chatcmpl-1"] = "recognized-2"
    async with client(middleware) as c:
        await c.post("/v1/chat/completions", json={**BODY, **TOOLS})
    await asyncio.sleep(0.2)
    assert runtime_endpoint.timing.told("recognized-2") is None


async def test_a_peer_url_httpx_cannot_use_is_counted_and_the_others_are_still_pulled(runtime_endpoint, monkeypatch):
    """A port out of range makes httpx raise no HTTPError. A server started by hand refuses it as
    ``agentkv serve`` does; should one get through, it is counted like any failing peer."""
    from agentkv.settings import SettingError

    bad, gone = "http://127.0.0.1:80000", "http://127.0.0.1:9"
    monkeypatch.setenv("AGENTKV_PEERS", f"{bad}, {gone}/")
    with pytest.raises(SettingError, match="AGENTKV_PEERS takes comma-separated http"):
        AgentKVMiddleware(echo_app)
    monkeypatch.setenv("AGENTKV_PEERS", f"{gone}/v1/")
    monkeypatch.setenv("AGENTKV_SYNC_INTERVAL", "0.05")
    middleware = AgentKVMiddleware(echo_app)
    assert middleware.peers == [gone]  # its root: /agentkv/v1/state is pulled from there
    middleware.peers = [bad, gone]
    task = asyncio.create_task(middleware._sync_forever())
    try:
        for _ in range(200):
            if min(middleware.sync_failures[bad], middleware.sync_failures[gone]) >= 2:
                break
            await asyncio.sleep(0.05)
        assert not task.done() and middleware.sync_failures[bad] >= 2 and middleware.sync_failures[gone] >= 2
    finally:
        task.cancel()


class _Peer(http.server.ThreadingHTTPServer):
    """A replica on loopback: ``slow`` sends its state one byte every 0.2 s (never done); else 404."""

    daemon_threads = True

    def __init__(self, slow: bool) -> None:
        self.slow, self.hits, self.stop = slow, 0, threading.Event()
        peer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                peer.hits += 1
                self.send_response(200 if peer.slow else 404)
                self.send_header("Content-Length", str(1 << 20 if peer.slow else 0))
                self.end_headers()
                while peer.slow and not peer.stop.wait(0.2):
                    self.wfile.write(b" ")
                    self.wfile.flush()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.stop.set()
        self.shutdown()
        self.server_close()


async def test_a_peer_that_never_finishes_its_answer_holds_up_no_other(runtime_endpoint, monkeypatch):
    """httpx's timeout is per read: a peer dribbling its state held every other peer's pull (and
    grew memory) without end; now each peer is pulled beside the others, within a deadline."""
    monkeypatch.setenv("AGENTKV_SYNC_INTERVAL", "0.05")
    middleware = AgentKVMiddleware(echo_app)
    slow, fast = _Peer(slow=True), _Peer(slow=False)
    middleware.peers = [slow.url, fast.url]
    task = asyncio.create_task(middleware._sync_forever())
    try:
        await asyncio.sleep(1.5)
        assert fast.hits >= 5 and middleware.sync_failures[fast.url] >= 5
    finally:
        task.cancel()
        slow.close()
        fast.close()


class _KeyRecorder(http.server.ThreadingHTTPServer):
    """A replica on loopback that records the Authorization header of every pull (and answers 404)."""

    daemon_threads = True

    def __init__(self) -> None:
        self.keys: list[str | None] = []
        peer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                peer.keys.append(self.headers.get("Authorization"))
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.mark.parametrize(("configured", "sent"), [("peer-key", "Bearer peer-key"), ("  ", "Bearer own-key")])
async def test_the_peer_key_is_read_as_agentkv_serve_reads_it(runtime_endpoint, monkeypatch, configured, sent):
    """AGENTKV_PEER_API_KEY is a setting like every other: a blank value is unset (this server's own
    key goes), as ``agentkv serve`` has it; it was read raw, and a blank key was sent as the key."""
    from server_patch._guard import ApiKeyGuard

    monkeypatch.setenv("AGENTKV_PEER_API_KEY", configured)
    monkeypatch.setenv("AGENTKV_SYNC_INTERVAL", "0.05")
    middleware = AgentKVMiddleware(echo_app)
    middleware._guard = ApiKeyGuard(["own-key"])  # the key vLLM was started with
    peer = _KeyRecorder()
    middleware.peers = [f"http://127.0.0.1:{peer.server_address[1]}"]
    task = asyncio.create_task(middleware._sync_forever())
    try:
        for _ in range(100):
            if peer.keys:
                break
            await asyncio.sleep(0.05)
        assert peer.keys and set(peer.keys) == {sent}
    finally:
        task.cancel()
        peer.shutdown()
        peer.server_close()
