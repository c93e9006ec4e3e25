"""Unit tests of issue 13's server side on the real classes: the API-key guard, bounded JSON,
strict/lenient agreement, and the runtime's bounds (peers, facts, per-agent rows, snapshots)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest

from agentkv.graph import GraphFacts, PeerExport, load_snapshot
from agentkv.protocol import EVENTS_PATH, MERGE_PATH, STATE_PATH, STATS_PATH
from server_patch._control import ControlServer, ask
from server_patch._guard import ApiKeyGuard, BodyError, json_depth, parse_json
from server_patch._persist import PeriodicSave
from server_patch._runtime import OTHER, PEER_WEIGHT_FLOOR, AgentKVRuntime, RuntimeConfig
from server_patch._tracker import AnchorLengths
from server_patch.middleware import AgentKVMiddleware

from .test_middleware import BODY, echo_app


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _scope(authorization: str | None = None, api_key: list[str] | None = None) -> dict:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    app = SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(api_key=api_key)))
    return {"type": "http", "headers": headers, "app": app}


def test_guard_takes_vllm_keys_then_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert ApiKeyGuard.for_scope(_scope(api_key=["a", "b"])).tokens == ("a", "b")
    assert ApiKeyGuard.for_scope(_scope()).tokens == ("env-key",)
    monkeypatch.delenv("VLLM_API_KEY")
    open_guard = ApiKeyGuard.for_scope({"type": "http", "headers": []})
    assert not open_guard.required and open_guard.allows(_scope())


@pytest.mark.parametrize(
    ("authorization", "allowed"),
    [("Bearer a", True), ("bearer b", True), ("BEARER a", True), ("Bearer c", False), ("Basic a", False),
     ("a", False), ("Bearer ", False), ("Bearer  a", False), (None, False)],
)
def test_guard_accepts_what_vllm_accepts(authorization, allowed):
    assert ApiKeyGuard(["a", "b"]).allows(_scope(authorization)) is allowed


def test_bounded_json():
    assert parse_json(b'{"a": [[1]]}', what="x", max_depth=3) == {"a": [[1]]}
    assert json_depth({"a": [[1]]}) == 3 and json_depth(7) == 0
    for body in (b"[" * 5 + b"]" * 5, b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(BodyError, match="nested deeper than 4 levels"):
            parse_json(body, what="x", max_depth=4)
    for body in (b"{", b"1" * 5000, b"\xff"):
        with pytest.raises(BodyError, match="not valid JSON"):
            parse_json(body, what="x", max_depth=4)


def _client(middleware: AgentKVMiddleware) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=middleware), base_url="http://test")


@pytest.mark.anyio
async def test_agentkv_routes_require_the_environment_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k")
    async with _client(AgentKVMiddleware(echo_app)) as c:
        for method, path in (("GET", STATS_PATH), ("GET", STATE_PATH), ("POST", EVENTS_PATH), ("POST", MERGE_PATH)):
            response = await c.request(method, path, content=b"[" * 1000 + b"]" * 1000)
            assert (response.status_code, response.json()) == (401, {"error": "Unauthorized"})
        untouched = await c.post("/v1/completions", json=BODY, headers={"X-AgentKV-Agent": "bad agent"})
        assert json.loads(untouched.json()["body"]) == BODY  # vLLM's own guard answers, nothing parsed


@pytest.mark.anyio
@pytest.mark.parametrize("strict", [False, True])
async def test_nested_bodies_never_raise(monkeypatch, strict):
    if strict:
        monkeypatch.setenv("AGENTKV_STRICT", "1")
    nested = b'{"model":"m","prompt":' + b"[" * 2000 + b"]" * 2000 + b"}"
    async with _client(AgentKVMiddleware(echo_app)) as c:
        untagged = await c.post("/v1/chat/completions", content=nested)
        assert untagged.json()["body"].encode() == nested  # agentkv has no business with it: vLLM judges
        tagged = await c.post("/v1/chat/completions", content=nested, headers={"X-AgentKV-Agent": "a"})
        assert tagged.status_code == 400
        assert tagged.json()["error"]["message"] == "request body is nested deeper than 128 levels"
        for path in (EVENTS_PATH, MERGE_PATH):
            response = await c.post(path, content=b"[" * 1000 + b"]" * 1000)
            assert response.status_code == 400


@pytest.mark.anyio
async def test_lenient_and_strict_agree_on_a_boolean_step(monkeypatch):
    body = {**BODY, "vllm_xargs": {"agentkv_agent": "a", "agentkv_step": True, "other": 1}}
    lenient = AgentKVMiddleware(echo_app)
    async with _client(lenient) as c:
        served = json.loads((await c.post("/v1/completions", json=body)).json()["body"])
    assert served["vllm_xargs"] == {"other": 1}  # served untagged, not as step 1
    assert lenient.malformed.by_field == {"agentkv_step": 1}
    monkeypatch.setenv("AGENTKV_STRICT", "1")
    async with _client(AgentKVMiddleware(echo_app)) as c:
        refused = await c.post("/v1/completions", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("agentkv_step")


@pytest.mark.anyio
async def test_duplicated_and_padded_headers(monkeypatch):
    middleware = AgentKVMiddleware(echo_app)
    async with _client(middleware) as c:
        padded = await c.post("/v1/completions", json=BODY, headers={"X-AgentKV-Agent": " coder \t"})
        assert json.loads(padded.json()["body"])["vllm_xargs"] == {"agentkv_agent": "coder"}
        twice = [("X-AgentKV-Agent", "a"), ("x-agentkv-agent", "b"), ("X-Session-ID", "s"), ("X-Session-ID", "t")]
        served = await c.post("/v1/completions", json=BODY, headers=twice)
        assert "vllm_xargs" not in json.loads(served.json()["body"])
    assert middleware.malformed.by_field == {"X-AgentKV-Agent": 1, "X-Session-ID": 1}
    monkeypatch.setenv("AGENTKV_STRICT", "1")
    async with _client(AgentKVMiddleware(echo_app)) as c:
        refused = await c.post("/v1/completions", json=BODY, headers=twice)
    assert refused.json()["error"]["message"] == "X-AgentKV-Agent: sent more than once"


def _export(replica: str, counts: list[list[float]], agents: tuple[str, ...] = ("planner", "coder", "critic")) -> dict:
    n = len(agents)
    return {"format": "agentkv.transition-counts", "version": 1, "replica": replica, "epoch": "e", "sequence": 1,
            "agents": list(agents), "counts": counts, "entry": [0] * n, "ends": [0] * n}


def _learn_planner_to_coder(runtime: AgentKVRuntime, sessions: int = 20) -> None:
    for s in range(sessions):
        for agent in ("planner", "coder" if s % 20 else "critic"):
            runtime.learner.observe(agent, f"s{s}")


def test_implausible_merges_are_refused_and_leave_the_model_alone():
    runtime = AgentKVRuntime()
    _learn_planner_to_coder(runtime)
    before = runtime.stats()["transitions"]["planner"]
    assert before["coder"] > 0.9
    for huge in (1e300, 1.7e308):
        reply = runtime.merge(_export("forger", [[0, 0, huge], [0, 0, 0], [0, 0, 0]]))
        assert reply["status"] == 400 and "more than a replica can learn" in reply["error"]
    assert runtime.stats()["transitions"]["planner"] == before
    assert runtime.learner.peers.replicas() == {}


def test_the_peer_map_keeps_the_most_recent_replicas():
    runtime = AgentKVRuntime(RuntimeConfig(max_peers=4))
    for number in range(10):
        assert runtime.merge(_export(f"r{number}", [[0, 1, 0], [0, 0, 1], [0, 0, 0]])) == {"merged": True}
    assert runtime.learner.peers.replicas() == {f"r{n}": 1 for n in range(6, 10)}


def test_graph_facts_are_capped_and_a_refused_event_can_be_resent():
    runtime = AgentKVRuntime()
    runtime.facts = GraphFacts(max_nodes=3, max_edges=2)
    graph = {"type": "graph", "id": "g1", "nodes": ["a", "b", "c", "d"]}
    reply = runtime.apply_events({"version": 1, "events": [{"type": "session_start", "session": "s"}, graph]})
    assert reply["status"] == 400 and reply["accepted"] == 1 and "3 nodes" in reply["error"]
    assert runtime.facts.export()["nodes"] == []
    edges = {"type": "graph", "id": "g1", "nodes": ["a"], "edges": [["a", "b"], ["b", "c"], ["c", "a"]]}
    assert "2 edges" in runtime.apply_events({"version": 1, "events": [edges]})["error"]
    graph["nodes"] = ["a", "b", "c"]
    assert runtime.apply_events({"version": 1, "events": [graph]}) == {"accepted": 1, "duplicates": 0}


def test_agent_rows_are_bounded_with_an_other_bucket():
    runtime = AgentKVRuntime(RuntimeConfig(listed_agents=3, tracked_agents=5))
    for number in range(8):
        runtime._count_traffic(f"agent-{number}", tokens=10 * (number + 1), hits=number)
    assert set(runtime.queries) == {f"agent-{n}" for n in range(5)} | {OTHER}
    assert runtime.queries[OTHER] == 60 + 70 + 80
    rows = runtime.stats()["agents"]
    assert list(rows) == sorted(rows)
    assert set(rows) == {OTHER, "agent-4", "agent-3"}
    assert rows[OTHER]["queries"] == 210 + 30 + 20 + 10  # the untracked and the unlisted agents summed
    assert sum(r["queries"] for r in rows.values()) == sum(10 * (n + 1) for n in range(8))


def test_an_events_payload_is_validated_outside_the_engine_lock(monkeypatch):
    """Validating a 1 MiB events body takes a second or more; the scheduler (which takes the
    engine's lock at every step) never waits on it: it stalled 5-11 s before."""
    import threading

    import server_patch._runtime_control as control

    runtime, original = AgentKVRuntime(RuntimeConfig()), control.validate_events
    held: list[bool] = []

    def probe() -> None:  # another thread, as the scheduler's
        free = runtime.lock.acquire(blocking=False)
        held.append(not free)
        if free:
            runtime.lock.release()

    def validate(payload: object) -> list[dict[str, object]]:
        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
        return original(payload)

    monkeypatch.setattr(control, "validate_events", validate)
    reply = runtime.handle({"op": "events", "payload": {"version": 1, "events": [
        {"type": "session_end", "session": "s"}]}})
    assert reply == {"accepted": 1, "duplicates": 0} and held == [False]


def test_save_if_changed_and_the_save_op(tmp_path):
    path = tmp_path / "state.json"
    runtime = AgentKVRuntime(RuntimeConfig(snapshot_path=str(path)))
    assert runtime.handle({"op": "save"}) == {"saved": True}  # nothing saved yet
    assert runtime.handle({"op": "save"}) == {"saved": False}
    _learn_planner_to_coder(runtime)
    saver = PeriodicSave(runtime.save_if_changed, interval=0.05)
    try:
        deadline = time.monotonic() + 5
        while saver.saves == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        saver.close()
    assert saver.saves >= 1 and saver.failures == 0
    learner, _ = load_snapshot(path)
    assert set(learner.agents) == {"planner", "coder", "critic"}
    assert not list(tmp_path.glob(".state.json.*"))  # written atomically: no temp file left


def test_a_restored_snapshot_is_not_written_again_until_something_changes(tmp_path):
    """A restored state is what its file holds: the first save (periodic, the save op, shutdown's)
    rewrote the identical file all the same."""
    path = tmp_path / "state.json"
    trained = AgentKVRuntime(RuntimeConfig(snapshot_path=str(path)))
    _learn_planner_to_coder(trained)
    trained.save()
    written = path.stat().st_ino  # a save writes a new file and renames it over the old one
    restored = AgentKVRuntime(RuntimeConfig(snapshot_path=str(path)))
    assert set(restored.learner.agents) == {"planner", "coder", "critic"}
    assert restored.handle({"op": "save"}) == {"saved": False} and not restored.save_if_changed()
    assert path.stat().st_ino == written
    restored.learner.observe("planner", "new")
    assert restored.handle({"op": "save"}) == {"saved": True} and path.stat().st_ino != written
    written = path.stat().st_ino
    # what the snapshot does not hold changes nothing: a peer's merge, a session's end
    peer = _export("peer", [[0, 1, 0], [0, 0, 1], [0, 0, 0]], agents=("planner", "coder", "researcher"))
    assert restored.merge(peer) == {"merged": True} and "researcher" in restored.learner.agents
    assert "researcher" not in restored.learner.export_state()["agents"]  # the peer's name is not saved either
    event = {"version": 1, "events": [{"type": "session_end", "id": "end-x", "session": "never-seen"}]}
    assert restored.apply_events(event)["accepted"] == 1
    assert not restored.save_if_changed() and path.stat().st_ino == written
    path.write_text("{}")  # refused at start (moved aside): the first save writes the fresh state
    assert AgentKVRuntime(RuntimeConfig(snapshot_path=str(path))).save_if_changed()
    assert load_snapshot(path)[0].agents == []


def test_the_session_timing_is_restored_and_saved_when_it_learned(tmp_path):
    """The gaps came back after a restart (the history scoring started from nothing); what the
    timing learned is saved, and a request's passing state alone (an answer told) is not."""
    path = tmp_path / "state.json"
    trained = AgentKVRuntime(RuntimeConfig(snapshot_path=str(path)))
    _learn_planner_to_coder(trained)
    for s in range(5):
        trained.timing.observe(f"s{s}", "planner", 10.0 * s, 0)
        trained.timing.observe(f"s{s}", "coder", 10.0 * s + 1.5, 1)
    assert trained.save_if_changed()
    trained.timing.answered("s4", tool_call=True)
    trained.timing.finished("s4")
    assert not trained.save_if_changed()
    trained.timing.observe("s4", "coder", 60.0, 1)  # a gap learned, the learner told nothing
    assert trained.save_if_changed() and not trained.save_if_changed()
    restored = AgentKVRuntime(RuntimeConfig(snapshot_path=str(path)))
    assert restored.stats()["timing"] == {"gaps": 6, "agents": 2} == trained.stats()["timing"]
    assert restored.timing.table().median_gap == trained.timing.table().median_gap
    assert not restored.save_if_changed()


def test_a_snapshot_is_written_outside_the_engine_lock(tmp_path, monkeypatch):
    """A slow disk (here a write that takes 0.5 s) never holds up a scheduler step: the engine's lock
    is free while the snapshot is encoded and written; the save op, which holds it, still saves."""
    import threading

    import server_patch._runtime_control as control

    path = tmp_path / "state.json"
    runtime = AgentKVRuntime(RuntimeConfig(snapshot_path=str(path)))
    _learn_planner_to_coder(runtime)
    writing, write = threading.Event(), control.write_snapshot

    def slow_write(*args, **kwargs):
        writing.set()
        time.sleep(0.5)
        write(*args, **kwargs)

    monkeypatch.setattr(control, "write_snapshot", slow_write)
    saver = threading.Thread(target=runtime.save)
    saver.start()
    assert writing.wait(5)
    assert runtime.lock.acquire(timeout=0.2)  # as the scheduler's next step would
    runtime.lock.release()
    saver.join(5)
    assert set(load_snapshot(path)[0].agents) == {"planner", "coder", "critic"}
    runtime.learner.observe("critic", "another", "coder")
    assert runtime.handle({"op": "save"}) == {"saved": True}  # under the lock, as the middleware asks it
    assert runtime.handle({"op": "save"}) == {"saved": False}
    assert load_snapshot(path)[0].dispatches == runtime.learner.dispatches


def test_a_failing_periodic_save_is_counted_not_raised():
    def broken() -> bool:
        raise OSError("disk full")

    saver = PeriodicSave(broken, interval=0.02)
    time.sleep(0.2)
    saver.close()
    assert saver.failures >= 2 and saver.saves == 0


def test_control_failures_are_logged_once_per_kind(tmp_path, caplog):
    def handler(request: dict) -> dict:
        raise KeyError(request["missing"])

    server = ControlServer(f"ipc://{tmp_path}/c.ipc", handler)
    try:
        for _ in range(5):
            reply = asyncio.run(ask(server.endpoint, {"op": "x"}))
            assert reply == {"error": "KeyError: 'missing'"}
    finally:
        server.close()
    assert server.failures == {"KeyError": 5}
    assert sum("control request failed" in r.message for r in caplog.records) == 1


def test_a_reply_that_is_not_json_is_answered_as_an_error_and_the_channel_serves_on(tmp_path):
    def handler(request: dict) -> dict:
        return {"value": {1, 2}} if request["op"] == "set" else {"ok": True}

    server = ControlServer(f"ipc://{tmp_path}/c.ipc", handler)
    try:
        assert asyncio.run(ask(server.endpoint, {"op": "set"})) == {
            "error": "TypeError: Object of type set is not JSON serializable"}
        assert asyncio.run(ask(server.endpoint, {"op": "next"})) == {"ok": True}
    finally:
        server.close()
    assert server.failures == {"TypeError": 1}


def test_a_second_engine_cannot_take_over_the_control_socket_silently(tmp_path):
    # binding an ipc path that another socket listens on succeeds in ZMQ and steals it: a second
    # EngineCore of the same API server (vLLM's --data-parallel-size 2) would cut the first one off
    endpoint = f"ipc://{tmp_path}/c.ipc"
    first = ControlServer(endpoint, lambda request: {"engine": 1})
    try:
        with pytest.raises(RuntimeError, match="another engine already answers"):
            ControlServer(endpoint, lambda request: {"engine": 2})
        assert asyncio.run(ask(endpoint, {"op": "stats"})) == {"engine": 1}
    finally:
        first.close()
    assert not (tmp_path / "c.ipc").exists()  # a closed server takes its socket file along
    (tmp_path / "c.ipc").touch()  # a socket file nobody answers on (a crashed engine's) is taken over
    second = ControlServer(endpoint, lambda request: {"engine": 2})
    try:
        assert asyncio.run(ask(endpoint, {"op": "stats"})) == {"engine": 2}
    finally:
        second.close()
    assert not (tmp_path / "c.ipc").exists()


def test_peer_export_refuses_loose_types():
    good = _export("r", [[0, 1, 0], [0, 0, 1], [0, 0, 0]])
    assert PeerExport.from_json(good).agents == ("planner", "coder", "critic")
    for override in ({"agents": "abc"}, {"sequence": 1.0}, {"sequence": -1}, {"epoch": ""},
                     {"counts": [[0, 1, 0], [0, 0, 1], [0, 0, None]]}, {"counts": [[0, 1, 0], [0, 0, 1]]},
                     {"entry": [0, 0, False]}, {"agents": ["a"] * 3}):
        with pytest.raises(ValueError):
            PeerExport.from_json({**good, **override})
    with pytest.raises(ValueError, match="exceed the limit"):
        PeerExport.from_json(_export("r", [[0] * 3] * 3, agents=("a", "b", "c")), max_agents=2)


def test_a_peer_weighs_at_most_a_multiple_of_the_local_evidence():
    runtime = AgentKVRuntime(RuntimeConfig(peer_weight=4.0))
    for s in range(200):
        for agent in ("planner", "coder"):
            runtime.learner.observe(agent, f"s{s}")
    own = runtime.learner.export_counts("me", "e").total_weight()
    assert own > 64
    heavy = _export("heavy", [[0, 0, 10_000], [0, 0, 0], [0, 0, 0]])
    assert runtime.merge(heavy) == {"merged": True}
    merged = runtime.learner.peers.aligned(runtime.learner.agents, own)[0]
    assert merged.sum() == pytest.approx(4.0 * own)  # scaled down, its distribution kept
    light = _export("light", [[0, 5, 0], [0, 0, 0], [0, 0, 0]])
    runtime.merge(light)
    coder, critic = runtime.learner.agents.index("coder"), runtime.learner.agents.index("critic")
    merged = runtime.learner.peers.aligned(runtime.learner.agents, own)[0]
    assert merged.sum() == pytest.approx(4.0 * own)  # both together, too
    assert merged[:, coder].sum() / merged[:, critic].sum() == pytest.approx(5 / (4.0 * own))  # light: unscaled


def test_many_peers_together_weigh_at_most_a_multiple_of_the_local_evidence():
    """Each merged peer was bounded alone: 32 made-up replica names outweighed the local model 128 times."""
    runtime = AgentKVRuntime(RuntimeConfig(peer_weight=4.0))
    for s in range(200):
        for agent in ("planner", "coder"):
            runtime.learner.observe(agent, f"s{s}")
    learner = runtime.learner
    own = learner.export_counts("me", "e").total_weight()
    planner, coder = learner.agents.index("planner"), learner.agents.index("coder")
    own_planner_to_coder = learner.counts()[planner, coder]
    for number in range(32):
        assert runtime.merge({**_export(f"fake-{number}", [[0, 0, 10_000], [0, 0, 0], [0, 0, 0]]),
                              "entry": [0, 0, 10_000]}) == {"merged": True}
    assert len(learner.peers.replicas()) == 32
    merged = sum(float(part.sum()) for part in (learner.counts(), learner.entry_counts(), learner.end_counts(),
                                                learner.interposed_counts()))
    assert merged == pytest.approx(own + 4.0 * own)  # all 32 together: 4 x own, not 32 x 4 x own
    critic = learner.agents.index("critic")
    assert learner.counts()[planner, critic] == pytest.approx(learner.entry_counts()[critic])  # their distribution
    assert learner.counts()[planner, coder] == own_planner_to_coder  # the local counts untouched
    fresh = AgentKVRuntime(RuntimeConfig(peer_weight=4.0))
    for number in range(32):
        fresh.merge(_export(f"fake-{number}", [[0, 0, 100], [0, 0, 0], [0, 0, 0]]))
    assert fresh.learner.counts().sum() == pytest.approx(4.0 * PEER_WEIGHT_FLOOR)  # a fresh replica is informed


def test_anchor_lengths_forget_the_least_recent_agents():
    anchors = AnchorLengths(max_agents=2)
    for number in range(5):
        for session in ("s", "t"):
            anchors.observe(f"agent-{number}", session, [1, 2, 3])
    anchors.observe("agent-3", "u", [1, 2, 9])
    anchors.observe("agent-9", "s", [1])
    assert anchors.as_dict() == {"agent-3": 2}  # agent-4 was the least recently observed


def test_anchor_lengths_of_calls_outside_any_session_keep_a_bounded_window():
    anchors = AnchorLengths(max_agents=2, window=3)
    for number in range(5):
        for call in range(10):
            anchors.observe(f"agent-{number}", None, [1, 2, 100 + call])
    assert set(anchors._sessionless) == {"agent-3", "agent-4"}  # forgotten with the agent
    assert all(len(calls) == 3 for calls in anchors._sessionless.values())
    assert anchors.as_dict() == {"agent-3": 2, "agent-4": 2}


@pytest.mark.anyio
async def test_the_engine_is_asked_to_save_before_vllm_shuts_it_down(tmp_path, monkeypatch):
    endpoint = f"ipc://{tmp_path}/control.ipc"
    monkeypatch.setenv("AGENTKV_CONTROL", endpoint)
    runtime = AgentKVRuntime(RuntimeConfig(snapshot_path=str(tmp_path / "state.json")))
    _learn_planner_to_coder(runtime)
    server = ControlServer(endpoint, runtime.handle)
    calls: list[str] = []
    engine = SimpleNamespace(shutdown=lambda timeout=None: calls.append(f"shutdown {timeout}"))
    app_scope = {"type": "lifespan", "app": SimpleNamespace(state=SimpleNamespace(engine_client=engine))}

    async def lifespan_app(scope, receive, send):
        assert (await receive())["type"] == "lifespan.startup"

    async def startup():
        return {"type": "lifespan.startup"}

    try:
        await AgentKVMiddleware(lifespan_app)(app_scope, startup, None)
        await asyncio.to_thread(engine.shutdown, timeout=0)  # as vLLM's launcher calls it
        await asyncio.to_thread(engine.shutdown, timeout=0)
    finally:
        server.close()
    assert calls == ["shutdown 0", "shutdown 0"]
    assert set(load_snapshot(tmp_path / "state.json")[0].agents) == {"planner", "critic", "coder"}
