"""What the coordinator reads from ``/metrics`` (Prometheus text) and how it is configured."""

import dataclasses

import pytest

from agentkv.warmup import WarmupConfig, WarmupCoordinator
from agentkv.warmup._server import parse_server_view

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
