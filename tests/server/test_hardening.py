"""Hostile traffic against one real ``agentkv serve`` started with ``--api-key`` (issue 13).

Every case asserts the exact status; none may reach a 5xx, and the server must still serve
tagged completions afterwards.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import httpx
import psutil
import pytest

from agentkv.launcher import free_port
from agentkv.protocol import EVENTS_PATH, MERGE_PATH, STATE_PATH, STATS_MAX_AGE, STATS_PATH, VIEW_PATH
from agentkv.testing.vllm_server import ServerSpec, VLLMServer

pytestmark = pytest.mark.server

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LISTED_AGENTS = 5
MAX_PEERS = 8
COMPLETION = {"model": "tiny", "prompt": [11, 12, 13, 14], "max_tokens": 1, "temperature": 0}
GONE_PEER = f"http://127.0.0.1:{free_port()}"  # a replica that is down: nothing listens there


class _KeyedPeer(http.server.BaseHTTPRequestHandler):
    """A replica behind an API key that only records who asks for its learned state (and refuses)."""

    asked: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        type(self).asked.append(self.headers.get("Authorization"))
        self.send_response(401)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def keyed_peer() -> Iterator[str]:
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeyedPeer) as peer:
        threading.Thread(target=peer.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{peer.server_address[1]}"
        peer.shutdown()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, keyed_peer: str) -> Iterator[VLLMServer]:
    spec = ServerSpec(
        model_dir=tiny_model_dir,
        num_gpu_blocks=81,
        module="agentkv.serve",
        extra_args=["--api-key", KEY],
        env={"AGENTKV_STATS_TOP_AGENTS": str(LISTED_AGENTS), "AGENTKV_MAX_PEERS": str(MAX_PEERS),
             "AGENTKV_PEERS": f"{GONE_PEER}, {keyed_peer}", "AGENTKV_SYNC_INTERVAL": "0.5"},  # a space, too
    )
    with VLLMServer(spec, log_path=tmp_path_factory.mktemp("hardening") / "vllm.log") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: VLLMServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as c:
        yield c


def _stats(client: httpx.Client) -> dict:
    response = client.get(STATS_PATH, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def _merge_document(**overrides: object) -> dict:
    document = {"format": "agentkv.transition-counts", "version": 1, "replica": "peer-a", "epoch": "e1",
                "sequence": 1, "agents": ["planner", "critic"], "counts": [[0, 3], [1, 0]], "entry": [1, 0],
                "ends": [0, 1]}
    return {**document, **overrides}


ROUTES = [("GET", STATS_PATH), ("GET", STATE_PATH), ("GET", VIEW_PATH), ("POST", EVENTS_PATH), ("POST", MERGE_PATH),
          ("GET", "/agentkv/v1/unknown")]


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", f"{KEY}", "Bearer", f"Bearer  {KEY}"])
def test_every_agentkv_route_requires_the_key(client, method, path, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    body = {"version": 1, "events": [{"type": "session_end", "session": "victim"}]}
    response = client.request(method, path, headers=headers, json=body if method == "POST" else None)
    assert response.status_code == 401
    assert response.json() == {"error": "Unauthorized"}


def test_the_key_is_accepted_in_the_header_forms_vllm_accepts(client):
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert client.get(STATS_PATH, headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    assert client.post("/v1/completions", json=COMPLETION).status_code == 401  # vLLM's own check, unchanged
    assert client.post("/v1/completions", json=COMPLETION, headers=AUTH).status_code == 200


def test_an_unauthenticated_bad_tag_gets_401_not_400(client):
    response = client.post("/v1/completions", json=COMPLETION, headers={"X-AgentKV-Agent": "bad agent"})
    assert response.status_code == 401


def test_a_peer_that_is_down_is_counted_and_logged_once_and_the_server_serves_on(server, client):
    deadline = time.monotonic() + 30
    while _stats(client).get("peer_sync_failures", {}).get(GONE_PEER, 0) < 2:
        assert time.monotonic() < deadline, "the failing pulls were not counted"
        time.sleep(0.5)
    assert client.post("/v1/completions", json=COMPLETION, headers=AUTH).status_code == 200
    log = server.log_path.read_text()
    assert log.count(f"cannot merge learned counts from {GONE_PEER}") == 1
    assert "agentkv: survival-scored eviction enabled on vLLM" in log  # the engine's start-up line, too


def test_the_pull_from_a_peer_carries_the_servers_own_api_key(client, keyed_peer):
    """Replicas behind ``--api-key`` pull each other's counts with the key (AGENTKV_PEER_API_KEY
    unset: the server's own)."""
    deadline = time.monotonic() + 30
    while not _KeyedPeer.asked:
        assert time.monotonic() < deadline, "the peer was never asked"
        _stats(client)  # the first request starts the pulls
        time.sleep(0.5)
    assert set(_KeyedPeer.asked) == {f"Bearer {KEY}"}
    assert _stats(client)["peer_sync_failures"][keyed_peer] >= 1  # refused: counted like any failure


@pytest.mark.parametrize("path", [EVENTS_PATH, MERGE_PATH])
def test_deeply_nested_agentkv_bodies_are_400(client, path):
    for body in ("[" * 1000 + "]" * 1000, "[" * 100_000 + "]" * 100_000, '{"a":' * 50 + "1" + "}" * 50):
        response = client.post(path, content=body, headers={**AUTH, "content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert "nested deeper than" in response.json()["error"]["message"]
    response = client.post(path, content="1" * 5000, headers=AUTH)  # an integer too long to convert
    assert response.status_code == 400


@pytest.mark.parametrize(("path", "limit"), [(EVENTS_PATH, 1 << 20), (MERGE_PATH, 4 << 20)])
def test_agentkv_bodies_above_their_size_limit_are_413(client, path, limit):
    body = b'{"version": 1, "pad": "' + b"x" * limit + b'"}'
    response = client.post(path, content=body, headers={**AUTH, "content-type": "application/json"})
    assert response.status_code == 413
    assert f"larger than {limit} bytes" in response.json()["error"]["message"]
    assert client.get(STATS_PATH, headers=AUTH).status_code == 200  # and the server serves on
    within = b'{"version": 1, "pad": "' + b"x" * (limit - 100) + b'"}'
    response = client.post(path, content=within, headers={**AUTH, "content-type": "application/json"})
    assert response.status_code == 400  # read and judged: not a document of that route


def test_deeply_nested_completion_bodies_are_400(client):
    body = '{"model":"tiny","max_tokens":1,"prompt":"hi","extra":' + "[" * 2000 + "]" * 2000 + "}"
    tagged = client.post("/v1/chat/completions", content=body,
                         headers={**AUTH, "X-AgentKV-Agent": "a", "content-type": "application/json"})
    assert tagged.status_code == 400
    assert "nested deeper than" in tagged.json()["error"]["message"]
    untagged = client.post("/v1/chat/completions", content=body, headers={**AUTH, "content-type": "application/json"})
    assert untagged.status_code == 400  # passed through untouched: vLLM's own answer


BAD_MERGES = [
    {"agents": ["", "critic"]},
    {"agents": ["bad agent\nwith newline", "critic"]},
    {"agents": ["x" * 5000, "critic"]},
    {"agents": ["代理", "critic"]},
    {"agents": "ab"},
    {"counts": [[0, True], [1, 0]]},
    {"counts": [[0, "1"], [1, 0]]},
    {"sequence": "7"},
    {"sequence": 1.9},
    {"sequence": True},
    {"replica": 5},
    {"replica": "peer\n"},
    {"version": True},
    {"counts": [[0, 1e300], [1e300, 0]]},
    {"counts": [[0, 1.7e308], [1.7e308, 0]]},
    {"entry": [float("1e309"), 0]},
]


@pytest.mark.parametrize("override", BAD_MERGES, ids=[json.dumps(o)[:40] for o in BAD_MERGES])
def test_malformed_merges_are_refused(client, override):
    response = client.post(MERGE_PATH, content=json.dumps(_merge_document(**override)),
                           headers={**AUTH, "content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith("merge refused")


@pytest.mark.parametrize("event", [
    {"type": "session_end", "session": "s\n"},
    {"type": "graph", "nodes": ["a\n"]},
    {"type": "graph", "nodes": ["a"], "edges": [["a", "b\n"]]},
    {"type": "session_end", "session": "代理"},
])
def test_events_follow_the_id_rules(client, event):
    response = client.post(EVENTS_PATH, json={"version": 1, "events": [event]}, headers=AUTH)
    assert response.status_code == 400


def test_peers_graph_facts_and_agent_lists_stay_bounded(server, client):
    for number in range(3 * MAX_PEERS):
        response = client.post(MERGE_PATH, json=_merge_document(replica=f"fabricated-{number}"), headers=AUTH)
        assert response.status_code == 200, response.text
    assert len(_stats(client)["learner"]["peers"]) == MAX_PEERS

    nodes = [f"n{i:04d}-" + "x" * 120 for i in range(1024)]
    first = client.post(EVENTS_PATH, json={"version": 1, "events": [{"type": "graph", "nodes": nodes}]}, headers=AUTH)
    assert first.status_code == 200, first.text
    engine = psutil.Process(server.pid).children(recursive=True)
    rss_before = sum(p.memory_info().rss for p in engine)
    for post in range(60):
        more = [f"m{post:02d}{i:04d}-" + "y" * 120 for i in range(1024)]
        flood = client.post(EVENTS_PATH, json={"version": 1, "events": [{"type": "graph", "nodes": more}]},
                            headers=AUTH)
        assert flood.status_code == 400
        assert "1024 nodes" in flood.json()["error"]["message"]
    rss_after = sum(p.memory_info().rss for p in engine)
    assert rss_after - rss_before < 32 << 20

    for number in range(40):
        tagged = {**AUTH, "X-AgentKV-Agent": f"fabricated-{number}", "X-AgentKV-Session": f"flood-{number}"}
        assert client.post("/v1/completions", json=COMPLETION, headers=tagged).status_code == 200
    stats = _stats(client)
    assert len(stats["agents"]) <= LISTED_AGENTS + 1 and "(other)" in stats["agents"]
    assert len(stats["sessions"]["current"]) <= LISTED_AGENTS
    metrics = client.get("/metrics").text
    assert sum(1 for line in metrics.splitlines() if line.startswith("agentkv_survival{")) <= LISTED_AGENTS + 1
    # the stats (behind the API key) list recent sessions; the unauthenticated /metrics never names one
    assert "flood-39" in json.dumps(stats["sessions"]) and "flood-" not in metrics


def _raw_post(server: VLLMServer, path: str, header_lines: list[str], body: dict) -> int:
    """One HTTP/1.1 POST written by hand (httpx refuses whitespace around header values); its status."""
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{server.port}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}", "Connection: close", *header_lines]
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload)
        status_line = sock.makefile("rb").readline().decode("latin-1")
    return int(status_line.split()[1])


def test_headers_follow_http(server, client):
    before = _stats(client)["malformed_metadata"]
    padded = [f"Authorization: Bearer {KEY}", "X-AgentKV-Agent: padded  ", "X-AgentKV-Session:\tpad-1 \t"]
    assert _raw_post(server, "/v1/completions", padded, COMPLETION) == 200
    duplicated = [("Authorization", AUTH["Authorization"]), ("X-AgentKV-Agent", "one"), ("X-AgentKV-Agent", "two")]
    assert client.post("/v1/completions", json=COMPLETION, headers=duplicated).status_code == 200
    sessions = [("Authorization", AUTH["Authorization"]), ("X-AgentKV-Agent", "one"),
                ("X-Session-ID", "s1"), ("X-Session-ID", "s2")]
    assert client.post("/v1/completions", json=COMPLETION, headers=sessions).status_code == 200
    routed = [("Authorization", AUTH["Authorization"]), ("X-AgentKV-Agent", "routed"), ("X-Session-ID", "user 42")]
    assert client.post("/v1/completions", json=COMPLETION, headers=routed).status_code == 200
    boolean_step = {**COMPLETION, "vllm_xargs": {"agentkv_agent": "stepper", "agentkv_step": True}}
    assert client.post("/v1/completions", json=boolean_step, headers=AUTH).status_code == 200
    time.sleep(STATS_MAX_AGE)  # the engine reuses a stats document for up to this long
    stats = _stats(client)
    grown = {k: v - before.get(k, 0) for k, v in stats["malformed_metadata"].items() if v != before.get(k, 0)}
    # the routing key outside agentkv's ids is counted (by the engine) and its agent tag kept
    assert grown == {"X-AgentKV-Agent": 1, "X-Session-ID": 2, "agentkv_step": 1}
    assert stats["sessions"]["current"].get("pad-1") == "padded"
    learned = client.get(STATE_PATH, headers=AUTH).json()["agents"]
    assert "padded" in learned and "routed" in learned
    assert "stepper" not in learned and "one" not in learned and "two" not in learned


def test_the_server_still_serves_after_all_of_it(client):
    response = client.post("/v1/completions", json=COMPLETION, headers={**AUTH, "X-AgentKV-Agent": "after"})
    assert response.status_code == 200
    assert client.get("/health").status_code == 200


def test_the_view_tells_queues_room_and_anchor_residency(client):
    """``GET /agentkv/v1/view``, what a warm-up decision reads: the scheduler's queues, the free
    blocks, each recent agent's [resident, learned] anchor blocks and the prediction after it,
    with no stats document built."""
    anchor = list(range(500, 500 + 96))  # three 32-token blocks every call of the agent repeats
    for session in ("view-1", "view-2"):  # a second session's call teaches the anchor's length
        body = {**COMPLETION, "prompt": [*anchor, 7, 8, 9, int(session[-1])]}
        response = client.post("/v1/completions", json=body,
                               headers={**AUTH, "X-AgentKV-Agent": "viewer", "X-AgentKV-Session": session})
        assert response.status_code == 200
    response = client.post("/v1/completions", json=COMPLETION,  # viewer -> reviewer, learned
                           headers={**AUTH, "X-AgentKV-Agent": "reviewer", "X-AgentKV-Session": "view-2"})
    assert response.status_code == 200
    view = client.get(VIEW_PATH, headers=AUTH).json()
    assert (view["waiting"], view["running"]) == (0, 0)  # idle between calls
    assert 0 < view["free_blocks"] <= 81
    assert view["anchors"]["viewer"] == [3, 3]
    assert view["block_size"] == 32 and 0.0 <= view["predictability"] <= 1.0
    assert view["next"]["viewer"][0] == "reviewer" and 0.0 < view["next"]["viewer"][1] <= 1.0
    assert "reviewer" not in view["next"]  # never followed: a uniform row predicts nothing
    assert view["warmups"] == [0, 0]  # (useful, failed) warm-ups: none sent
