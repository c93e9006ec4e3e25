"""Fixtures shared by the adapter tests: a scripted OpenAI server, fresh ids, the dispatches seen."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from agentkv.frameworks import Dispatch, on_dispatch

from ._fakes import FakeOpenAI


@pytest.fixture
def server() -> FakeOpenAI:
    return FakeOpenAI()


@pytest.fixture
def thread() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def session() -> str:
    return f"s-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def dispatches() -> Iterator[list[Dispatch]]:
    """Every dispatch recorded while the test runs."""
    seen: list[Dispatch] = []
    unsubscribe = on_dispatch(seen.append)
    yield seen
    unsubscribe()
