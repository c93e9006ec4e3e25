"""POST /agentkv/v1/events from the adapters: delivered when up, harmless when down, slow or failing."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
import uuid
from typing import Any

import httpx
import pytest

pytest.importorskip("langgraph")

from agentkv.frameworks import stats
from agentkv.frameworks._events import CLOSE_TIMEOUT, EventSink, events_endpoint, session_event
from agentkv.frameworks.langgraph import InstrumentedGraph, instrument
from agentkv.protocol import EVENTS_PATH, validate_events

from ._fakes import EventsServer, FakeOpenAI, SilentServer, cfg, closed_port_url
from .test_langgraph import FAN_OUT_EXPECTED, fan_out_app


def thread_id() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def test_events_endpoint_accepts_base_or_full_urls():
    assert events_endpoint("http://127.0.0.1:8000") == "http://127.0.0.1:8000" + EVENTS_PATH
    assert events_endpoint("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000" + EVENTS_PATH
    assert events_endpoint("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000" + EVENTS_PATH
    full = "http://127.0.0.1:8000" + EVENTS_PATH
    assert events_endpoint(full) == full


def test_graph_and_session_events_are_delivered():
    server = FakeOpenAI()
    thread = thread_id()
    with EventsServer() as events:
        app = instrument(fan_out_app(server), events_url=events.url + "/v1")
        app.invoke({"notes": []}, cfg(thread))
        with pytest.raises(RuntimeError, match="node failed"):
            instrument(_failing_app(), events_url=events.url).invoke({"notes": []}, cfg(thread + "-x"))
        assert app.sink.flush(5)
        kinds = [(e["type"], e.get("session")) for e in events.events()]
        # a checkpointed thread outlives its run (the next message continues it): no end yet
        assert ("session_start", thread) in kinds and ("session_end", thread) not in kinds
        app.end_session(thread)  # the app says the conversation is over
        assert app.sink.flush(5)
    assert all(body["path"] == EVENTS_PATH for body in events.bodies)
    for body in events.bodies:
        validate_events(body["json"])  # every batch matches the protocol schema
    kinds = [(e["type"], e.get("session")) for e in events.events()]
    assert kinds.index(("session_start", thread)) < kinds.index(("session_end", thread))
    assert ("cancel", thread + "-x") in kinds  # a run that raised, with no thread state kept, is cancelled
    graph = next(e for e in events.events() if e["type"] == "graph" and "Planner" in e["nodes"])
    assert graph == {**app.facts}
    assert graph["entry"] == ["Planner"] and ["Planner", "left"] in graph["edges"]


def _failing_app() -> Any:
    from langgraph.graph import START, StateGraph

    from .test_langgraph import Notes

    def boom(state: Any) -> Any:
        raise RuntimeError("node failed")

    g = StateGraph(Notes)
    g.add_node("boom", boom)
    g.add_edge(START, "boom")
    return g.compile()


def _two_step_app() -> Any:
    from langgraph.graph import START, StateGraph

    from .test_langgraph import Notes

    g = StateGraph(Notes)
    g.add_node("first", lambda state: {"notes": ["first"]})
    g.add_node("second", lambda state: {"notes": ["second"]})
    g.add_edge(START, "first")
    g.add_edge("first", "second")
    return g.compile()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_abandoned_stream_cancels_its_session(mode):
    thread = thread_id()
    with EventsServer() as events:
        app = instrument(_two_step_app(), events_url=events.url)
        if mode == "sync":
            stream = app.stream({"notes": []}, cfg(thread))
            next(stream)  # the caller reads the first step and walks away
            stream.close()
        else:
            async def read_one() -> None:
                stream = app.astream({"notes": []}, cfg(thread))
                await anext(stream)
                await stream.aclose()

            asyncio.run(read_one())
        assert app.sink.flush(5)
        kinds = [(e["type"], e.get("session")) for e in events.events()]
    assert ("session_start", thread) in kinds and ("cancel", thread) in kinds
    assert ("session_end", thread) not in kinds


def test_server_down_never_affects_the_app(caplog):
    server = FakeOpenAI()
    thread = thread_id()
    url = closed_port_url()
    # the errors are counted process-wide by kind, which names the URL: a port an earlier test
    # used (and saw fail) was logged then, so this test sees its one warning only on a new port
    logged_before = {kind for kind, n in stats()["errors"].items() if n}
    with caplog.at_level(logging.WARNING, logger="agentkv.frameworks"):
        app = instrument(fan_out_app(server), events_url=url)
        for i in range(3):
            app.invoke({"notes": []}, cfg(f"{thread}-{i}"))
        assert app.sink.flush(10)
    assert len(server.requests) == 18  # the user's calls all went through, tagged
    assert {k: (a, p, st) for k, (a, s, p, st) in server.tags_by_text().items()} == FAN_OUT_EXPECTED
    assert app.sink.failed == 1 + 3 * 2 and app.sink.sent == 0  # facts; per run facts+start (threads go on)
    # Another test's sink may still be failing in the background; count only this sink's warnings.
    failures = [r for r in caplog.records if f"events POST to {app.sink.urls[0]}" in r.getMessage()]
    assert len(failures) == (f"events POST to {app.sink.urls[0]}" not in logged_before)  # once, then counted
    assert stats()["errors"][f"events POST to {app.sink.urls[0]}"] >= 1  # POSTs coalesce queued batches


def test_slow_server_does_not_slow_the_app():
    server = FakeOpenAI()
    thread = thread_id()
    with EventsServer(delay=3.0) as events:
        app = instrument(fan_out_app(server), events_url=events.url)
        started = time.perf_counter()
        app.invoke({"notes": []}, cfg(thread))
        asyncio.run(app.ainvoke({"notes": []}, cfg(thread + "a")))
        elapsed = time.perf_counter() - started
        assert elapsed < 1.5, elapsed
        assert len(server.requests) == 12
        assert app.sink.flush(15)
        assert app.sink.failed > 0  # the 2 s client timeout fired


def test_http_errors_are_counted_not_raised():
    with EventsServer(status=400) as events:
        sink = EventSink(events.url)
        sink.post([{"type": "session_end", "session": "s"}])
        sink.post([{"type": "bogus"}])  # invalid: dropped before sending
        assert sink.flush(5)
        sink.close()
    assert sink.failed == 1 and sink.sent == 0 and sink.dropped == 1
    assert len(events.bodies) == 1


def test_after_flush_a_failed_post_is_in_the_error_counts_and_logged():
    """flush() returns once every delivery is counted, and a failure's error is recorded (and its
    one warning logged) before it counts: here logging takes 0.3 s, which flush() must wait for."""
    url = closed_port_url()
    kind = f"events POST to {events_endpoint(url)}"

    class Slow(logging.Handler):
        seen = ""

        def emit(self, record: logging.LogRecord) -> None:
            time.sleep(0.3)
            self.seen = record.getMessage()

    # the errors are counted process-wide by kind: a port an earlier test saw fail was logged then
    logged_before = stats()["errors"].get(kind, 0) > 0
    slow = Slow(logging.WARNING)
    frameworks_logger = logging.getLogger("agentkv.frameworks")
    frameworks_logger.addHandler(slow)
    try:
        sink = EventSink(url, transport=httpx.HTTPTransport(retries=0))
        sink.post([{"type": "session_end", "session": "s"}])
        assert sink.flush(5)
        assert sink.failed == 1 and stats()["errors"][kind] >= 1
        assert logged_before or kind in slow.seen
        sink.close()
    finally:
        frameworks_logger.removeHandler(slow)


def test_a_worker_that_cannot_build_its_client_drops_its_events_instead_of_leaving_flush_waiting():
    sink = EventSink(closed_port_url(), api_key="clé")  # httpx encodes header values as ASCII
    sink.post([{"type": "session_end", "session": "s"}])
    started = time.monotonic()
    assert sink.flush(5) and time.monotonic() - started < 2
    sink.post([{"type": "session_end", "session": "t"}])  # closed: dropped at once
    assert sink.flush(1)
    assert sink.sent == 0 and sink.failed == 0 and sink.dropped == 2 and stats()["errors"]["events worker"] >= 1
    sink.close()


def test_every_endpoint_gets_every_event_and_one_down_endpoint_does_not_stop_the_others():
    server = FakeOpenAI()
    thread = thread_id()
    down = closed_port_url()
    with EventsServer() as first, EventsServer() as second:
        app = instrument(fan_out_app(server), events_url=[first.url, down, second.url + "/v1", first.url])
        assert app.sink.urls == (events_endpoint(first.url), events_endpoint(down), events_endpoint(second.url))
        app.invoke({"notes": []}, cfg(thread))
        app.end_session(thread)
        assert app.sink.flush(10)
    for replica in (first, second):
        kinds = [(e["type"], e.get("session")) for e in replica.events()]
        assert ("session_start", thread) in kinds and ("session_end", thread) in kinds
    assert [e["id"] for e in first.events()] == [e["id"] for e in second.events()]
    assert app.sink.failed == len(first.events()) and app.sink.sent == 2 * len(first.events())


# --------------------------------------------------------------------------------------
# A server that accepts connections and never answers
# --------------------------------------------------------------------------------------


def _wait_until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_silent_server_costs_counted_events_and_a_bounded_close():
    server = FakeOpenAI()
    thread = thread_id()
    dropped_before = stats()["counts"].get("events_dropped", 0)
    with SilentServer() as silent:
        sink = EventSink(silent.url, timeout=30.0)  # a client timeout longer than any wait below
        app = InstrumentedGraph(fan_out_app(server), sink=sink)  # posts the graph facts: 1 event
        _wait_until(lambda: silent.accepted == 1)  # the worker is now stuck on that POST
        app.invoke({"notes": []}, cfg(thread))  # facts + session_start: 2 more
        app.end_session(thread)  # session_end: 1 more
        assert len(server.requests) == 6  # the app itself is unaffected
        assert (sink.sent, sink.failed, sink.dropped, sink.pending) == (0, 0, 0, 4)
        started = time.perf_counter()
        sink.close()
        elapsed = time.perf_counter() - started
        assert CLOSE_TIMEOUT - 0.05 <= elapsed <= CLOSE_TIMEOUT + 0.5
        assert (sink.sent, sink.failed, sink.dropped, sink.pending) == (0, 0, 4, 0)
        sink.post([session_event("session_end", thread)])  # after close: dropped at once, counted
        assert (sink.sent, sink.failed, sink.dropped, sink.pending) == (0, 0, 5, 0)
    assert stats()["counts"]["events_dropped"] - dropped_before == 5


def test_a_silent_server_times_out_into_failed_deliveries():
    with SilentServer() as silent, SilentServer() as other:
        sink = EventSink([silent.url, other.url], timeout=0.3)
        sink.post([session_event("session_start", "s"), session_event("session_end", "s")])
        assert sink.flush(5)
        sink.close()
    assert (sink.sent, sink.failed, sink.dropped, sink.pending) == (0, 4, 0, 0)  # 2 events x 2 endpoints


_EXIT_SCRIPT = """
import atexit, sys, time
sys.path.insert(0, {root!r})
marks = {{}}
atexit.register(lambda: print(f"exit wait {{time.monotonic() - marks['posted']:.3f}}", flush=True))
from agentkv.frameworks._events import get_sink, session_event
from tests.frameworks._fakes import SilentServer
silent = SilentServer().__enter__()
sink = get_sink(silent.url)
sink.post([session_event("session_start", "s1")])
sink.post([session_event("session_end", "s1")])
marks["posted"] = time.monotonic()
"""


def test_events_still_pending_at_interpreter_exit_are_counted_and_exit_is_bounded():
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT.format(root=root)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    waited = float(done.stdout.split("exit wait ")[1])
    assert waited <= CLOSE_TIMEOUT + 0.5
    assert "sent 0, failed 0, dropped 2" in done.stderr


def test_closing_one_apps_sink_leaves_the_other_apps_with_the_same_url_posting():
    """Apps with the same events URL share one sink (one thread); closing one app's detaches that
    app only, and the shared sink closes with the last app."""
    server = FakeOpenAI()
    thread = thread_id()
    with EventsServer() as events:
        chat = instrument(fan_out_app(server), events_url=events.url)
        summarizer = instrument(fan_out_app(server), events_url=events.url)
        summarizer.sink.close()
        dropped = chat.sink.dropped
        chat.invoke({"notes": []}, cfg(thread))
        assert chat.sink.flush(5) and chat.sink.dropped == dropped
        assert ("session_start", thread) in [(e["type"], e.get("session")) for e in events.events()]
        summarizer.sink.post([session_event("session_end", thread)])  # after its close: dropped, counted
        assert chat.sink.dropped == dropped + 1
        summarizer.sink.close()  # once only: the chat app still holds the sink
        assert not chat.sink.sink._closed and chat.sink.sink is summarizer.sink.sink  # shared
        chat.sink.close()
        assert chat.sink.sink._closed
