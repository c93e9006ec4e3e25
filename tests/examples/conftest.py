"""Shared fixtures for the example and ``agentkv bench serve`` tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def example():
    """``examples/langgraph_supervisor.py`` as a module."""
    from agentkv.bench.serve import load_example

    return load_example()
