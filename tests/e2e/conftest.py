"""The end-to-end tests share the session's ``agentkv_server`` with ``tests/server``.

``tests/server/test_integration.py`` asserts on counters the server keeps since it started (sessions
ended, anchor evictions, the learned transitions of its agents), and these tests end sessions, add
agents and evict blocks on purpose; so they run after every other test of the session.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if Path(str(item.path)).resolve().is_relative_to(_HERE)]
    if ours and len(ours) < len(items):
        mine = {id(item) for item in ours}
        items[:] = [item for item in items if id(item) not in mine] + ours
