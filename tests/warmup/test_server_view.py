"""What the coordinator reads from ``/agentkv/v1/view`` or ``/metrics`` (Prometheus text) and how it is configured."""

import dataclasses
import threading

import httpx
import pytest

from agentkv.client import ErrorCounter
from agentkv.protocol import VIEW_PATH
from agentkv.warmup import WarmupConfig, WarmupCoordinator, view_of
from agentkv.warmup._server import ServerView, WarmupServer, anchor_resident, merge_views, parse_server_view

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 3.0
# TYPE agentkv_kv_free_blocks gauge
agentkv_kv_free_blocks 17.0
# TYPE agentkv_anchor_length_blocks gauge
agentkv_anchor_length_blocks{agent="planner"} 4.0
agentkv_anchor_length_blocks{agent="we\\"ird\\\\name"} 2.0
# TYPE agentkv_anchor_resident_blocks gauge
agentkv_anchor_resident_blocks{agent="planner"} 4.0
agentkv_anchor_resident_blocks{agent="we\\"ird\\\\name"} 1.0
"""


def test_metrics_are_summed_over_engines_and_labels_unescaped():
    view = parse_server_view(METRICS)
    assert (view.running, view.waiting, view.free_blocks) == (3.0, 3.0, 17)
    assert view.anchors == {"planner": (4, 4), 'we"ird\\name': (1, 2)}
    assert view.resident("planner") is True
    assert view.resident('we"ird\\name') is False
    assert view.resident("unknown") is None


def test_an_anchor_not_learned_yet_is_judged_by_the_anchor_the_caller_holds():
    # [cached leading blocks of the agent's latest first call, 0]: no learned length yet
    view = view_of({"anchors": {"planner": [4, 4], "coder": [5, 0]}})
    assert view.resident("coder") is None  # a chat-replay anchor: its length unknown here too
    assert view.resident("coder", 5) is True and view.resident("coder", 6) is False
    assert view.resident("planner", 9) is True  # a learned length wins over the caller's guess
    assert view.resident("unknown", 1) is None
    assert [anchor_resident(*pair) for pair in [(3, 4, None), (4, 4, None), (0, 0, None), (0, 0, 2), (2, 0, 2)]] \
        == [False, True, None, False, True]


@pytest.mark.parametrize(("outcomes", "survival"), [
    ([0, 0], 1.0),  # no outcome yet: warm-ups get their chance
    ([3, 1], 0.8),  # (useful + 1) / (useful + failed + 1)
    ([0, 4], 0.2),
    ([1, -1], None), ([1], None), ("3,1", None), ([1.5, 0], None), (None, None),  # not said: unpriced
])
def test_the_view_tells_how_many_warmups_survived(outcomes, survival):
    document = {"anchors": {}} if outcomes is None else {"anchors": {}, "warmups": outcomes}
    assert view_of(document).survival == survival


def test_a_vanilla_server_says_nothing_about_anchors_or_room():
    view = parse_server_view("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0.0\n")
    assert (view.running, view.waiting, view.free_blocks, view.anchors) == (None, 0.0, None, {})


def test_keyword_settings_override_the_config():
    base = WarmupConfig(r_min=0.5, queue_size=4)
    coord = WarmupCoordinator("http://127.0.0.1:9/v1", base, max_per_second=3.0)
    assert coord.config == dataclasses.replace(base, max_per_second=3.0)
    assert coord.base_url == "http://127.0.0.1:9"
    assert coord.policy == base.policy()
    assert WarmupCoordinator("http://127.0.0.1:9").config == WarmupConfig()
    with pytest.raises(TypeError):
        WarmupCoordinator("http://127.0.0.1:9", no_such_setting=1)


VIEW = {"waiting": 2, "running": 1, "free_blocks": 17, "anchors": {"planner": [4, 4], "coder": [1, 3]}}


def _server(handler, clock=lambda: 0.0) -> tuple[WarmupServer, list[str]]:
    asked: list[str] = []

    def transport(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return handler(request)

    client = httpx.Client(transport=httpx.MockTransport(transport), base_url="http://test")
    return WarmupServer(client, ErrorCounter(), clock, stats_interval=2.0, metrics_interval=0.5, model=None), asked


def test_an_agentkv_server_is_read_through_its_view_not_metrics():
    server, asked = _server(lambda request: httpx.Response(200, json=VIEW))
    view = server.view()
    assert (view.waiting, view.running, view.free_blocks) == (2.0, 1.0, 17)
    assert view.resident("planner") is True and view.resident("coder") is False and view.resident("x") is None
    assert asked == [VIEW_PATH]
    server.view()  # cached for metrics_interval
    assert asked == [VIEW_PATH] and not server.errors.by_kind


def test_a_server_without_the_view_is_read_through_metrics_from_then_on():
    now = [0.0]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404) if request.url.path == VIEW_PATH else httpx.Response(200, text=METRICS)

    server, asked = _server(handler, clock=lambda: now[0])
    assert server.view().free_blocks == 17
    now[0] = 1.0
    server.view()
    assert asked == [VIEW_PATH, "/metrics", "/metrics"] and not server.errors.by_kind


def test_a_malformed_view_is_counted_and_reads_as_unknown():
    server, _ = _server(lambda request: httpx.Response(200, json={"anchors": [1, 2]}))
    view = server.view()
    assert (view.waiting, view.free_blocks, view.anchors) == (None, None, {})
    assert server.errors.by_kind == {f"GET {VIEW_PATH}": 1}


def test_behind_a_router_an_anchor_on_any_replica_is_resident_and_the_load_is_the_mean():
    on_first = view_of({"waiting": 0, "running": 3, "free_blocks": 10, "anchors": {"planner": [4, 4], "coder": [0, 3]},
                        "predictability": 0.8, "next": {"planner": ["coder", 0.9]}, "block_size": 16,
                        "warmups": [3, 1]})
    on_second = view_of({"waiting": 1, "running": 1, "free_blocks": 30, "anchors": {"coder": [3, 3], "planner": [2, 4]},
                         "predictability": 0.7, "next": {}, "warmups": [1, 0]})
    unreadable = ServerView()
    merged = merge_views([on_first, unreadable, on_second])
    assert merged.resident("planner") is True and merged.resident("coder") is True
    assert (merged.waiting, merged.running, merged.free_blocks) == (0.5, 2.0, 20)  # the unreadable one says nothing
    assert merged.outcomes == (4, 1) and merged.survival == 5 / 6
    assert (merged.predictability, merged.successors, merged.block_size) == (0.8, {"planner": ("coder", 0.9)}, 16)
    assert merge_views([on_first]) is on_first
    assert merge_views([on_second, ServerView(anchors={"coder": (1, 3)})]).anchors["coder"] == (3, 3)
    assert merge_views([unreadable, ServerView()]) == ServerView()


def test_behind_a_router_the_view_is_read_from_each_replica_not_the_router():
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(f"{request.url.host}{request.url.path}")
        if request.url.host == "replica1" and request.url.path == VIEW_PATH:
            return httpx.Response(404)  # a vanilla replica: its /metrics from then on
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        return httpx.Response(200, json=VIEW)

    def client(host: str) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(handler), base_url=f"http://{host}")

    now = [0.0]
    server = WarmupServer(client("router"), ErrorCounter(), lambda: now[0], stats_interval=2.0, metrics_interval=0.5,
                          model=None, replicas=[client("replica0"), client("replica1")])
    view = server.view()
    assert sorted(asked) == [f"replica0{VIEW_PATH}", f"replica1{VIEW_PATH}", "replica1/metrics"]  # read concurrently
    assert (view.waiting, view.running, view.free_blocks) == (2.5, 2.0, 17)
    assert view.resident("planner") is True and view.resident("coder") is False
    now[0] = 1.0
    server.view()
    assert sorted(asked[3:]) == [f"replica0{VIEW_PATH}", "replica1/metrics"] and not server.errors.by_kind


def test_the_replicas_views_are_read_at_once_not_one_after_another():
    # each replica answers only once all three are being read: one after another, the first read
    # would wait on the barrier until it broke, and every view would read as unknown
    barrier = threading.Barrier(3, timeout=10)

    def handler(request: httpx.Request) -> httpx.Response:
        barrier.wait()
        return httpx.Response(200, json=VIEW)

    def client(host: str) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(handler), base_url=f"http://{host}")

    server = WarmupServer(client("router"), ErrorCounter(), lambda: 0.0, stats_interval=2.0, metrics_interval=0.5,
                          model=None, replicas=[client(f"replica{i}") for i in range(3)])
    view = server.view()
    assert view.resident("planner") is True and not server.errors.by_kind


def test_replica_urls_are_taken_as_server_roots():
    assert WarmupCoordinator("http://127.0.0.1:9", replicas="http://127.0.0.1:10/v1/").config.replicas \
        == ("http://127.0.0.1:10",)
    assert WarmupCoordinator("http://127.0.0.1:9", replicas=["http://a:1/v1", "http://b:2"]).config.replicas \
        == ("http://a:1", "http://b:2")


@pytest.mark.parametrize(("base", "replicas"), [("localhost:8000", ()), ("http://127.0.0.1:9", ("10.0.0.1:8000",)),
                                                ("http://:8000", ())])
def test_a_url_naming_no_server_is_refused_when_the_coordinator_is_built(base, replicas):
    """``localhost:8000`` parses as scheme ``localhost``: taken as given, no response ever matched
    it and no warm-up was sent, silently."""
    with pytest.raises(ValueError, match="a server base URL is http"):
        WarmupCoordinator(base, replicas=replicas)


@pytest.mark.server
def test_a_plain_vllm_is_read_through_its_own_metrics(vanilla_server):
    """Against a real vLLM without agentkv: no view (404), so the load comes from vLLM's own
    ``/metrics``; nothing there says where anchors are, which blocks no warm-up."""
    with httpx.Client(base_url=vanilla_server.base_url, timeout=10, trust_env=False) as client:
        server = WarmupServer(client, ErrorCounter(), lambda: 0.0, stats_interval=2.0, metrics_interval=0.5,
                              model=None)
        view = server.view()
    assert (view.waiting, view.running) == (0.0, 0.0) and view.free_blocks is None
    assert view.resident("coder") is None and not server.errors.by_kind
