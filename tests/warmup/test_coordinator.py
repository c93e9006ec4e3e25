"""WarmupCoordinator against an in-process fake vLLM: gates, rate limit, queue, errors, usefulness."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import respx
from openai import OpenAI

import agentkv
from agentkv.frameworks import set_routing_key, tracker, use_tag
from agentkv.graph import TransitionLearner
from agentkv.protocol import AgentTag
from agentkv.warmup import TaggedResponse, WarmupCoordinator, on_response
from agentkv.warmup._coordinator import CLOSE_TIMEOUT
from tests.frameworks._fakes import SilentServer

from ._fake_vllm import BASE, FakeVLLM

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search.",
                                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def system(agent: str) -> str:
    return f"{agent}: you are {agent}. Follow the {agent} rules exactly; keep answers short and precise. " * 2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake() -> FakeVLLM:
    return FakeVLLM(block_size=16)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def client(fake: FakeVLLM) -> OpenAI:
    return OpenAI(base_url=BASE + "/v1", api_key="x", http_client=fake.client(), max_retries=0)


@pytest.fixture
def run_id() -> str:
    return uuid.uuid4().hex[:8]


def make(fake: FakeVLLM, clock: Clock, **kwargs: Any) -> WarmupCoordinator:
    kwargs.setdefault("learner", TransitionLearner())
    return WarmupCoordinator(BASE, transport=fake.transport(), clock=clock, **kwargs)


def call(client: OpenAI, agent: str, session: str, **kwargs: Any) -> Any:
    messages = [{"role": "system", "content": system(agent)}, {"role": "user", "content": f"task of {session}"}]
    return client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none", **kwargs)


def tagged_call(client: OpenAI, agent: str, sid: str) -> Any:
    """A tagged call that is not a dispatch (no dispatch-end job): only anchors and last use are learned."""
    with use_tag(AgentTag(agent, session=sid)):
        return call(client, agent, sid)


def wait_for_warmups(fake: FakeVLLM, n: int) -> None:
    """Until the fake received ``n`` warm-ups (the worker is then inside the n-th, if the fake holds it)."""
    deadline = time.monotonic() + 5
    while len(fake.warmups()) < n:
        assert time.monotonic() < deadline, "the warm-up never arrived"
        time.sleep(0.005)


def session(client: OpenAI, coord: WarmupCoordinator, clock: Clock, agents: list[str], sid: str) -> list[Any]:
    """One session: each agent is a dispatch; the pause after it lets the coordinator finish its job."""
    results = []
    for agent in agents:
        with agentkv.agent(agent, session=sid):
            results.append(call(client, agent, sid))
        clock.advance(10)  # past metrics_interval: the next job reads /metrics again
        assert coord.flush(5)
    return results


def cached(result: Any) -> int:
    return result.usage.prompt_tokens_details.cached_tokens


# --------------------------------------------------------------------------------------
# The whole loop
# --------------------------------------------------------------------------------------


def test_warms_the_predicted_agent_and_counts_useful(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    planner, coder = f"planner-{run_id}", f"coder-{run_id}"
    with make(fake, clock) as coord:
        session(client, coord, clock, [planner, coder], f"a-{run_id}")
        assert fake.warmups() == []  # nothing learned yet
        fake.evict_all()
        first, second = session(client, coord, clock, [planner, coder], f"b-{run_id}")
        stats = coord.stats()

    [warm] = fake.warmups()
    anchor = coord.anchors.anchor(coder)
    assert warm.path == "/v1/completions"
    assert warm.body["prompt"] == list(anchor.tokens) and warm.body["max_tokens"] == 1
    assert warm.headers["x-agentkv-agent"] == coder and "x-agentkv-session" not in warm.headers
    assert warm.headers["x-session-id"] == f"b-{run_id}"  # routed like the coder's coming call
    assert anchor.length > 0 and anchor.length % 16 == 0
    assert cached(first) == 0  # the planner was not warmed: cold after the eviction
    assert cached(second) >= anchor.length  # the coder was
    assert stats["sent"] == 1 and stats["useful"] == 1 and stats["failed"] == 0
    assert stats["tokens"] == {"prompt": anchor.length, "cached": 0}  # what it added to vLLM's counters
    assert stats["predictions"] == {"right": 1, "wrong": 0}
    assert stats["recent"][0] | {"seconds": 0} == {
        "agent": coder, "after": planner, "session": f"b-{run_id}", "anchor_tokens": anchor.length,
        "source": anchor.source, "cached_tokens": 0, "prompt_tokens": anchor.length, "seconds": 0,
        "next_call_cached_tokens": cached(second)}
    assert stats["anchors"][coder]["stable"] is True


@pytest.mark.parametrize("given", ["argument", "VLLM_API_KEY"])
def test_every_request_of_the_coordinator_carries_the_api_key(
        fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str, monkeypatch: pytest.MonkeyPatch,
        given: str) -> None:
    planner, coder = f"planner-{run_id}", f"coder-{run_id}"
    if given == "VLLM_API_KEY":  # the default, as for vLLM's own server
        monkeypatch.setenv("VLLM_API_KEY", "secret")
        config = {}
    else:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        config = {"api_key": "secret"}
    with make(fake, clock, **config) as coord:
        session(client, coord, clock, [planner, coder], f"a-{run_id}")
        fake.evict_all()
        session(client, coord, clock, [planner, coder], f"b-{run_id}")
    assert len(fake.warmups()) == 1
    # everything but the app's own calls: warm-ups, the view, stats, /metrics, /tokenize
    mine = [c for c in fake.calls if c.headers.get("x-agentkv-warmup") == "1" or not c.path.startswith("/v1/")]
    assert {c.path for c in mine} >= {"/v1/completions", "/agentkv/v1/view"}
    assert all(c.headers.get("authorization") == "Bearer secret" for c in mine)


def test_warms_in_the_tool_step_once_the_model_answered(
    fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str
) -> None:
    planner, coder = f"planner-{run_id}", f"coder-{run_id}"
    with make(fake, clock) as coord:
        session(client, coord, clock, [planner, coder], f"a-{run_id}")
        fake.evict_all()
        with agentkv.agent(planner, session=f"b-{run_id}"):
            call(client, planner, f"b-{run_id}")
            assert coord.flush(5)
            # still inside the planner's dispatch (its tool step): the coder is warm already
            assert [w.headers["x-agentkv-agent"] for w in fake.warmups()] == [coder]
        assert coord.flush(5)
        stats = coord.stats()
    assert stats["sent"] == 1 and "late" not in stats["skipped"]  # the dispatch's end queued no second job


def test_agent_routing_key_sends_calls_and_warmups_by_agent(
    fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str
) -> None:
    planner, coder = f"planner-{run_id}", f"coder-{run_id}"
    set_routing_key("agent")
    try:
        with make(fake, clock) as coord:
            session(client, coord, clock, [planner, coder], f"a-{run_id}")
            fake.evict_all()
            session(client, coord, clock, [planner, coder], f"b-{run_id}")
    finally:
        set_routing_key("session")
    real = [c for c in fake.calls if c.path == "/v1/chat/completions" and "x-agentkv-agent" in c.headers]
    assert {c.headers["x-session-id"] for c in real} == {planner, coder}
    assert {c.headers["x-agentkv-session"] for c in real} == {f"a-{run_id}", f"b-{run_id}"}
    assert [w.headers["x-session-id"] for w in fake.warmups()] == [coder]


def test_server_side_prediction_and_block_size(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    planner, coder, critic = f"planner-{run_id}", f"coder-{run_id}", f"critic-{run_id}"
    fake.transitions = {planner: {coder: 0.7, critic: 0.3}}
    fake.predictability = 0.6
    with make(fake, clock, learner=None, stats_interval=1000) as coord:
        coord.anchors.block_size = 64  # replaced by the server's block size (16)
        session(client, coord, clock, [coder, critic], f"a-{run_id}")
        session(client, coord, clock, [planner], f"b-{run_id}")
        stats = coord.stats()
    [warm] = fake.warmups()
    assert warm.headers["x-agentkv-agent"] == coder
    assert len(warm.body["prompt"]) % 16 == 0 and len(warm.body["prompt"]) % 64 != 0
    assert fake.count("/agentkv/v1/stats") == 1  # cached for stats_interval (the fake clock stands still)
    assert stats["skipped"]["no_prediction"] == 2  # coder and critic have no learned successor


def test_an_agentkv_view_is_all_a_decision_reads(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    """The view tells the server's prediction, R and block size: no stats document is asked for,
    and a target whose learned anchor is cached is skipped without resolving its anchor (/tokenize)."""
    planner, coder = f"planner-{run_id}", f"coder-{run_id}"
    fake.view, fake.predictability = True, 0.6
    fake.transitions = {planner: {coder: 0.7, f"critic-{run_id}": 0.3}}
    fake.anchors = {coder: (4, 4)}
    with make(fake, clock, learner=None) as coord:
        coord.anchors.block_size = 64  # replaced by the view's block size (16)
        session(client, coord, clock, [coder], f"a-{run_id}")
        tokenized = fake.count("/tokenize")
        session(client, coord, clock, [planner], f"b-{run_id}")
        assert coord.stats()["skipped"] == {"no_prediction": 1, "resident": 1}
        assert fake.count("/tokenize") == tokenized  # a resident target's anchor is not resolved
        fake.anchors = {coder: (1, 4)}
        session(client, coord, clock, [planner], f"c-{run_id}")
        stats = coord.stats()
    [warm] = fake.warmups()
    assert warm.headers["x-agentkv-agent"] == coder and stats["sent"] == 1
    assert len(warm.body["prompt"]) % 16 == 0 and len(warm.body["prompt"]) % 64 != 0
    assert fake.count("/agentkv/v1/stats") == 0 and fake.count("/metrics") == 0


# --------------------------------------------------------------------------------------
# Gates
# --------------------------------------------------------------------------------------


def test_predictability_gate(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    learner = TransitionLearner()
    names = [f"a-{run_id}", f"b-{run_id}", f"c-{run_id}"]
    for i, (x, y) in enumerate((x, y) for x in names for y in names if x != y):
        learner.observe(x, f"train-{i}", "")
        learner.observe(y, f"train-{i}")
    assert learner.predictability() < 0.5
    with make(fake, clock, learner=learner, r_min=0.5) as coord:
        session(client, coord, clock, names[:2], f"s-{run_id}")
        stats = coord.stats()
    assert stats["sent"] == 0 and stats["skipped"]["predictability"] == 2


def test_no_prediction_and_no_anchor(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    planner = f"planner-{run_id}"
    fake.transitions = {planner: {f"ghost-{run_id}": 1.0}}
    with make(fake, clock, learner=None) as coord:
        session(client, coord, clock, [planner, f"other-{run_id}"], f"s-{run_id}")
        stats = coord.stats()
    assert stats["skipped"] == {"no_anchor": 1, "no_prediction": 1}  # the ghost never called: nothing to warm


def test_resident_gate_reads_the_servers_residency(
    fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str
) -> None:
    coder = f"coder-{run_id}"
    fake.anchors = {coder: (4, 4)}
    with make(fake, clock) as coord:
        tagged_call(client, coder, f"s-{run_id}")
        coord.warm(coder)  # the server holds the whole anchor
        assert coord.flush(5)
        fake.anchors = {coder: (3, 4)}  # its last block was evicted
        clock.advance(0.6)
        coord.warm(coder)
        assert coord.flush(5)
        fake.anchors = {coder: (0, 4)}
        coord.warm(coder)  # within metrics_interval: the anchor just warmed counts as resident
        assert coord.flush(5)
        stats = coord.stats()
    assert stats["sent"] == 1 and stats["skipped"] == {"resident": 2} and stats["fallbacks"] == {}
    assert fake.count("/metrics") == 2


def test_no_room_gate(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    coder = f"coder-{run_id}"
    with make(fake, clock, min_free_blocks=2) as coord:
        tagged_call(client, coder, f"s-{run_id}")
        fake.free_blocks = 0
        coord.warm(coder)
        assert coord.flush(5)
        blocks = coord.anchors.anchor(coder).blocks
        fake.free_blocks = blocks + 1  # the anchor fits, the reserve does not
        clock.advance(0.6)
        coord.warm(coder)
        assert coord.flush(5)
        fake.free_blocks = blocks + 2
        clock.advance(0.6)
        coord.warm(coder)
        assert coord.flush(5)
        stats = coord.stats()
    assert stats["sent"] == 1 and stats["skipped"] == {"no_room": 2}


@pytest.mark.parametrize("server", ["vanilla", "broken"])
def test_unknown_residency_and_room_fall_back_and_are_counted(
    fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str, server: str
) -> None:
    coder = f"coder-{run_id}"
    if server == "vanilla":
        fake.agentkv_metrics = False
    else:
        fake.fail["/metrics"] = 500
    with make(fake, clock) as coord:
        tagged_call(client, coder, f"s-{run_id}")
        coord.warm(coder)
        assert coord.flush(5)
        stats = coord.stats()
    assert stats["sent"] == 1 and stats["skipped"] == {}
    unknown = {"residency_unknown": 1, "room_unknown": 1}
    assert stats["fallbacks"] == (unknown if server == "vanilla" else unknown | {"load_unknown": 1})
    assert ("GET /metrics" in stats["errors"]) == (server == "broken")


def test_rate_limit_token_bucket(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    agents = [f"x{i}-{run_id}" for i in range(4)]
    with make(fake, clock, max_per_second=0.5, burst=2) as coord:
        for agent in agents:
            tagged_call(client, agent, f"s-{run_id}")
        for agent in agents:
            coord.warm(agent)
        assert coord.flush(5)
        assert coord.stats()["sent"] == 2 and coord.stats()["skipped"] == {"rate_limit": 2}
        clock.advance(2.0)  # one token back
        coord.warm(agents[2])
        coord.warm(agents[3])
        assert coord.flush(5)
        assert coord.stats()["sent"] == 3 and coord.stats()["skipped"] == {"rate_limit": 3}


def test_already_warm_is_counted(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    coder = f"coder-{run_id}"
    with make(fake, clock) as coord:
        tagged_call(client, coder, f"s-{run_id}")
        fake.evict_all()
        coord.warm(coder)
        coord.warm(coder)  # the first one left it cached
        assert coord.flush(5)
        stats = coord.stats()
    assert stats["sent"] == 2 and stats["already_warm"] == 1
    assert [r["cached_tokens"] for r in stats["recent"]] == [0, stats["recent"][0]["anchor_tokens"] - 16]


def test_busy_gate_reads_metrics_at_most_every_interval(
    fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str
) -> None:
    coder = f"coder-{run_id}"
    fake.waiting = 2
    with make(fake, clock, max_per_second=100, burst=100) as coord:
        tagged_call(client, coder, f"s-{run_id}")
        for _ in range(3):
            coord.warm(coder)
        assert coord.flush(5)
        assert coord.stats()["skipped"] == {"busy": 3} and fake.count("/metrics") == 1
        fake.waiting = 0
        clock.advance(0.6)
        coord.warm(coder)
        assert coord.flush(5)
        assert coord.stats()["sent"] == 1 and fake.count("/metrics") == 2
    fake.running = 5
    with make(fake, clock, max_load=4) as coord:
        tagged_call(client, coder, f"t-{run_id}")
        coord.warm(coder)
        assert coord.flush(5)
        assert coord.stats()["skipped"] == {"busy": 1}


def test_late_and_ended_sessions_are_skipped(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    planner, coder = f"planner-{run_id}", f"coder-{run_id}"
    fake.gate = threading.Event()
    with make(fake, clock, max_per_second=100, burst=100) as coord:
        fake.gate.set()
        session(client, coord, clock, [planner, coder], f"a-{run_id}")
        fake.gate.clear()
        coord.warm(planner)
        wait_for_warmups(fake, 1)  # the worker now waits inside this warm-up
        # session b: the coder starts before the worker gets to the job queued at the planner's end
        with agentkv.agent(planner, session=f"b-{run_id}"):
            call(client, planner, f"b-{run_id}")
        with agentkv.agent(coder, session=f"b-{run_id}"):
            call(client, coder, f"b-{run_id}")
        # session c: ends before the worker gets to its job
        with agentkv.agent(planner, session=f"c-{run_id}"):
            call(client, planner, f"c-{run_id}")
        tracker().end_session(f"c-{run_id}")
        clock.advance(10)
        fake.gate.set()
        assert coord.flush(5)
        stats = coord.stats()
    assert stats["skipped"]["late"] == 1 and stats["skipped"]["session_ended"] >= 1
    assert [w.headers["x-agentkv-agent"] for w in fake.warmups()] == [planner]


def test_bounded_queue_drops_the_oldest(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    agents = [f"x{i}-{run_id}" for i in range(6)]
    fake.gate = threading.Event()
    with make(fake, clock, queue_size=2, max_per_second=100, burst=100) as coord:
        for agent in agents:
            tagged_call(client, agent, f"s-{run_id}")
        coord.warm(agents[0])
        wait_for_warmups(fake, 1)  # the worker is inside warm-up 0
        for agent in agents[1:]:
            coord.warm(agent)  # never blocks, even with the worker stuck
        fake.gate.set()
        assert coord.flush(5)
        stats = coord.stats()
    assert stats["dropped"] == 3 and stats["sent"] == 3
    assert [w.headers["x-agentkv-agent"] for w in fake.warmups()] == [agents[0], agents[4], agents[5]]


# --------------------------------------------------------------------------------------
# Errors never reach the user
# --------------------------------------------------------------------------------------


def test_failed_warmups_are_counted_and_logged_once(
    fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agentkv.warmup")
    planner, coder = f"planner-{run_id}", f"coder-{run_id}"
    fake.fail["/v1/completions"] = 500
    with make(fake, clock) as coord:
        for s in range(4):
            results = session(client, coord, clock, [planner, coder], f"{s}-{run_id}")
            assert all(r.choices[0].message.content == "ok" for r in results)  # the app is unaffected
        stats = coord.stats()
    assert stats["failed"] == 3 and stats["sent"] == 0
    assert stats["errors"] == {"warm-up POST /v1/completions": 3}
    assert len([r for r in caplog.records if "warm-up POST" in r.getMessage()]) == 1


def test_unreachable_server_and_slow_warmups_cost_the_app_nothing(
    fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str
) -> None:
    planner, coder = f"planner-{run_id}", f"coder-{run_id}"
    # The coordinator talks to the network (respx intercepts it); the app's own client is the fake.
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        router.post("/tokenize").mock(side_effect=httpx.ConnectError("refused"))
        router.get("/metrics").mock(side_effect=httpx.ConnectError("refused"))
        router.route().mock(side_effect=httpx.ConnectError("refused"))
        with WarmupCoordinator(BASE, learner=TransitionLearner(), clock=clock, timeout=0.5) as coord:
            for s in range(3):
                session(client, coord, clock, [planner, coder], f"{s}-{run_id}")
            stats = coord.stats()
    assert stats["sent"] == 0 and stats["skipped"]["no_anchor"] == 2
    assert stats["errors"]["POST /tokenize"] == 2

    fake.gate = threading.Event()  # warm-ups hang until released
    with make(fake, clock) as coord:
        session(client, coord, clock, [planner, coder], f"slow-a-{run_id}")
        with agentkv.agent(planner, session=f"slow-b-{run_id}"):
            call(client, planner, f"slow-b-{run_id}")
        wait_for_warmups(fake, 1)  # the coder's warm-up is in flight and stuck
        started = time.perf_counter()
        with agentkv.agent(coder, session=f"slow-b-{run_id}"):
            call(client, coder, f"slow-b-{run_id}")
        with agentkv.agent(planner, session=f"slow-b-{run_id}"):
            call(client, planner, f"slow-b-{run_id}")
        elapsed = time.perf_counter() - started
        fake.gate.set()
    assert elapsed < 0.5, "a slow warm-up never delays the application"


def test_listener_errors_stay_inside(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    class Broken:
        def observe(self, *args: Any) -> None:
            raise RuntimeError("learner bug")

        def predict(self, agent: str) -> None:
            raise RuntimeError("learner bug")

        learner = None

    with make(fake, clock, learner=Broken()) as coord:
        results = session(client, coord, clock, [f"a-{run_id}", f"b-{run_id}"], f"s-{run_id}")
        stats = coord.stats()
    assert len(results) == 2
    assert stats["errors"]["client-side prediction"] == 2 and stats["skipped"]["no_prediction"] == 2


# --------------------------------------------------------------------------------------
# Usefulness
# --------------------------------------------------------------------------------------


def test_not_useful_unmeasured_and_unused(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    planner, coder = f"planner-{run_id}", f"coder-{run_id}"
    with make(fake, clock, useful_window=60) as coord:
        session(client, coord, clock, [planner, coder], f"a-{run_id}")
        session(client, coord, clock, [planner], f"b-{run_id}")
        fake.evict_all()  # something evicted the warmed anchor before the coder came
        with agentkv.agent(coder, session=f"b-{run_id}"):
            call(client, coder, f"b-{run_id}")
        assert coord.stats()["not_useful"] == 1
        clock.advance(10)
        session(client, coord, clock, [planner], f"c-{run_id}")
        with agentkv.agent(coder, session=f"c-{run_id}"):
            stream = call(client, coder, f"c-{run_id}", stream=True)  # no usage in a stream
            list(stream)
        assert coord.stats()["unmeasured"] == 1
        clock.advance(10)
        session(client, coord, clock, [planner], f"d-{run_id}")  # the coder never comes
        assert coord.stats()["pending"] == 1 and coord.stats()["unused"] == 0
        clock.advance(61)
        stats = coord.stats()
    assert stats["sent"] == 3 and stats["unused"] == 1 and stats["useful"] == 0


def test_chat_replay_when_the_server_cannot_tokenize(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    planner, coder = f"planner-{run_id}", f"coder-{run_id}"
    fake.tokenize_status = 404
    with make(fake, clock) as coord:
        session(client, coord, clock, [planner, coder], f"a-{run_id}")
        fake.evict_all()
        _, second = session(client, coord, clock, [planner, coder], f"b-{run_id}")
        stats = coord.stats()
    [warm] = fake.warmups()
    assert warm.path == "/v1/chat/completions"
    assert warm.body["messages"] == [{"role": "system", "content": system(coder)}]
    assert warm.body["tools"] == TOOLS and warm.body["tool_choice"] == "none"
    assert warm.body["add_generation_prompt"] is False and warm.body["max_tokens"] == 1
    assert stats["mode"] == "chat" and stats["useful"] == 1
    assert cached(second) == stats["recent"][0]["anchor_tokens"] > 0


def test_close_unsubscribes(fake: FakeVLLM, clock: Clock, client: OpenAI, run_id: str) -> None:
    coord = make(fake, clock).start()
    assert coord.start() is coord
    coord.close()
    coord.close()
    session(client, coord, clock, [f"a-{run_id}", f"b-{run_id}"], f"s-{run_id}")
    assert coord.anchors.agents() == [] and coord.stats()["queued"] == 0


def test_close_is_bounded_while_a_job_hangs_on_a_silent_server() -> None:
    with SilentServer() as silent:
        coord = WarmupCoordinator(silent.url, learner=TransitionLearner(), timeout=30.0).start()
        coord.warm("planner")  # the job first asks the server for its block size, and waits
        deadline = time.monotonic() + 5
        while silent.accepted == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        coord.warm("coder")
        coord.warm("critic")  # both queued behind the stuck job
        started = time.perf_counter()
        coord.close()
        elapsed = time.perf_counter() - started
    assert CLOSE_TIMEOUT - 0.05 <= elapsed <= CLOSE_TIMEOUT + 0.5
    assert coord.stats()["dropped"] == 2 and coord.stats()["queued"] == 0


# --------------------------------------------------------------------------------------
# Response observation
# --------------------------------------------------------------------------------------


@pytest.fixture
def responses() -> Iterator[list[TaggedResponse]]:
    seen: list[TaggedResponse] = []
    unsubscribe = on_response(seen.append)
    yield seen
    unsubscribe()


def test_responses_of_tagged_calls_are_reported(fake: FakeVLLM, client: OpenAI, responses: list[TaggedResponse],
                                                 run_id: str) -> None:
    call(client, "untagged", "s")
    with agentkv.agent(f"coder-{run_id}", session=f"s-{run_id}"):
        call(client, f"coder-{run_id}", "s")
        call(client, f"coder-{run_id}", "s")
        list(call(client, f"coder-{run_id}", "s", stream=True))
    assert [(r.tag.agent, r.cached_tokens is not None, r.streamed) for r in responses] == [
        (f"coder-{run_id}", True, False), (f"coder-{run_id}", True, False), (f"coder-{run_id}", False, True)]
    assert responses[1].cached_tokens > 0 and responses[1].prompt_tokens > responses[1].cached_tokens


def test_streaming_responses_are_left_untouched(fake: FakeVLLM, client: OpenAI, responses: list[TaggedResponse],
                                                 run_id: str) -> None:
    messages = [{"role": "system", "content": system("x")}, {"role": "user", "content": "hi"}]
    with agentkv.agent(f"coder-{run_id}", session=f"s-{run_id}"):
        with client.chat.completions.with_streaming_response.create(model="tiny", messages=messages) as raw:
            assert raw.parse().choices[0].message.content == "ok"  # the body was not consumed by agentkv
        raw_response = client.chat.completions.with_raw_response.create(model="tiny", messages=messages)
        assert raw_response.parse().usage.prompt_tokens_details.cached_tokens > 0
    assert [r.cached_tokens is None for r in responses] == [True, False]


def test_async_responses_are_reported(fake: FakeVLLM, responses: list[TaggedResponse], run_id: str) -> None:
    from openai import AsyncOpenAI

    async def main() -> None:
        client = AsyncOpenAI(base_url=BASE + "/v1", api_key="x",
                             http_client=httpx.AsyncClient(transport=httpx.MockTransport(fake.handle)))
        async with agentkv.agent(f"coder-{run_id}", session=f"s-{run_id}"):
            await client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=1)

    asyncio.run(main())
    assert [r.tag.agent for r in responses] == [f"coder-{run_id}"]


def test_a_worker_that_cannot_build_its_client_closes_the_coordinator_instead_of_leaving_jobs_waiting(fake, clock):
    # httpx encodes header values as ASCII: no client can be built with this key
    coord = make(fake, clock, api_key="clé").start()
    try:
        deadline = time.monotonic() + 10
        while "warm-up client" not in coord.errors.by_kind and time.monotonic() < deadline:
            time.sleep(0.01)
        coord.warm("planner")  # nothing will ever send it: not queued
        started = time.monotonic()
        assert coord.flush(5) and time.monotonic() - started < 1
        assert coord.errors.by_kind["warm-up client"] == 1 and coord.counts["sent"] == 0
    finally:
        coord.close()


def test_coordinators_sharing_an_anchor_book_keep_it_capturing_until_the_last_closes(fake, clock, client, run_id):
    from agentkv.warmup import AnchorBook

    book = AnchorBook(base_url=BASE, block_size=16)
    first, second = make(fake, clock, anchors=book).start(), make(fake, clock, anchors=book).start()
    first.close()
    with use_tag(AgentTag("planner", session=f"s-{run_id}")):
        call(client, "planner", f"s-{run_id}")
    assert book.resolve("planner", None) is not None  # still captured: the second coordinator runs
    second.close()
    captured = book.counts["captured"]
    with use_tag(AgentTag("planner", session=f"t-{run_id}")):
        call(client, "planner", f"t-{run_id}")
    assert book.counts["captured"] == captured  # the last one closed: the book no longer listens


def test_no_warm_up_is_sent_after_close_returned():
    """``close()`` waits 1 s for the worker; a job still reading a slow view then POSTed its
    warm-up after ``close()`` had returned."""

    class SlowView(FakeVLLM):
        def _route(self, path, body):
            if path == "/agentkv/v1/view":
                time.sleep(1.5)  # a loaded server: within the view's timeout
            return super()._route(path, body)

    fake = SlowView(block_size=16, view=True)
    coordinator = WarmupCoordinator(BASE, transport=fake.transport()).start()
    system = "coder: you are the coder. Follow the rules exactly. " * 4
    for session in ("s1", "s2"):
        coordinator.anchors.capture("coder", session, {"model": "tiny", "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": session}]})
    coordinator.warm("coder")
    time.sleep(0.2)
    coordinator.close()
    time.sleep(2.0)
    assert fake.warmups() == [] and coordinator.stats()["sent"] == 0


def test_pending_warm_ups_expire_without_a_stats_reader():
    """With agent names that come and go and nobody reading ``stats()``, the ledger's pending
    warm-ups grew without bound (they were expired only there)."""
    from agentkv.warmup import AnchorBook

    now = [0.0]
    fake = FakeVLLM(block_size=16, view=True)
    book = AnchorBook(base_url=BASE, max_agents=50, clock=lambda: now[0])
    coordinator = WarmupCoordinator(BASE, anchors=book, transport=fake.transport(), clock=lambda: now[0],
                                    max_per_second=1e9, burst=1e9, metrics_interval=0.0).start()
    try:
        for i in range(120):
            agent, system = f"task-{i}", f"task-{i}: you are the worker for task {i}. " * 4
            for session in ("s1", "s2"):
                book.capture(agent, session, {"model": "tiny", "messages": [
                    {"role": "system", "content": system}, {"role": "user", "content": session}]})
            coordinator.warm(agent)
            coordinator.flush()
            now[0] += 10.0  # past the useful window (120 s) within 13 warm-ups
        assert len(coordinator._ledger.pending) <= 13
    finally:
        coordinator.close()


def test_a_job_found_late_while_deciding_spends_no_token(fake: FakeVLLM, clock: Clock, client: OpenAI,
                                                         run_id: str) -> None:
    planner, coder = f"planner-{run_id}", f"coder-{run_id}"
    with make(fake, clock, max_per_second=1e-6, burst=1) as coord:
        session(client, coord, clock, [planner, coder], f"a-{run_id}")
        fake.evict_all()
        policy = coord.policy

        class NextCallWhileDeciding:
            """The session's next call is sent while the worker decides (once)."""

            def decide(self, job: Any, target: Any, take: Any) -> Any:
                with coord._lock:
                    coord._seq[f"b-{run_id}"] += 1
                coord.policy = policy
                return policy.decide(job, target, take)

        coord.policy = NextCallWhileDeciding()
        with agentkv.agent(planner, session=f"b-{run_id}"):
            call(client, planner, f"b-{run_id}")
        assert coord.flush(5)
        with agentkv.agent(planner, session=f"c-{run_id}"):
            call(client, planner, f"c-{run_id}")
        assert coord.flush(5)
        stats = coord.stats()
    assert stats["skipped"]["late"] == 1 and "rate_limit" not in stats["skipped"]
    assert stats["sent"] == 1  # the burst's one token went to c
    assert [w.headers["x-session-id"] for w in fake.warmups()] == [f"c-{run_id}"]
