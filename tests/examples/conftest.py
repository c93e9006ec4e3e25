"""Shared helpers for the example and ``agentkv bench serve`` tests."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run this directory's server tests last.

    They send six agents and many sessions through the session-scoped ``agentkv_server``; tests
    elsewhere that assert the server's learned state (transitions, session counts) expect a server
    that has not seen them.
    """
    mine = {id(item) for item in items if HERE in Path(str(item.path)).parents and item.get_closest_marker("server")}
    if mine:
        items[:] = [item for item in items if id(item) not in mine] + [item for item in items if id(item) in mine]


@pytest.fixture(scope="session")
def example():
    """``examples/langgraph_supervisor.py`` as a module."""
    from agentkv.bench.serve import load_example

    return load_example()
