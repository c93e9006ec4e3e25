"""Stopping a replica behind the real vllm-router: a module of its own, so its cluster (module scope)
is one that no other test needs afterwards."""

from __future__ import annotations

import httpx
import pytest

from agentkv.protocol import AgentTag

from .conftest import BLOCK
from .test_cluster import _complete, _tokens

pytestmark = pytest.mark.server


def test_stopping_a_replica_mid_run_loses_no_retryable_request(cluster):
    failures = []
    with httpx.Client(base_url=cluster.url, timeout=120, trust_env=False) as client:
        for i in range(12):
            if i == 4:
                cluster.processes[1].stop()  # replica 1 dies between requests
            try:
                _complete(client, _tokens(f"after-stop-{i}", 2 * BLOCK), AgentTag("writer", f"stop-{i}", ""))
            except httpx.HTTPError as exc:
                failures.append((i, repr(exc)))
    assert failures == []
