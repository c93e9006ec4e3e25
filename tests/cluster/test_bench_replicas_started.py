"""``agentkv bench serve --replicas 2`` as a user runs it: the command starts the single servers, both
kinds of replicas and a router in front of each, runs every setup, and stops everything it started."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from agentkv.__main__ import main
from tests.conftest import model_servers

pytestmark = pytest.mark.server


def _routers() -> set[int]:
    """vllm-router processes (a Python entry point: its script is the first or second argument)."""
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if any(Path(arg).name == "vllm-router" for arg in (p.info["cmdline"] or [])[:2])}


def test_a_replicated_run_starts_what_it_needs_and_stops_it(tiny_model_dir, tmp_path, capsys):
    servers, routers = model_servers(tiny_model_dir), _routers()
    main(["bench", "serve", "--replicas", "2", "--router", "round_robin", "--model", "tiny", "--blocks", "181",
          "--rates", "4", "--sessions", "2", "--block-sessions", "2", "--warmup-sessions", "0", "--turns", "2",
          "--tool-gap", "0.05", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "serve.json").read_text())
    rows = {(row["setup"], row["server"]): row for row in result["rows"]}
    assert set(rows) == {(setup, server) for setup in ("single", "round_robin/session")
                         for server in ("vanilla", "agentkv")}
    for row in rows.values():
        assert (row["turns"], row["errors"]) == (4, 0), row.get("failures")
    for server in ("vanilla", "agentkv"):  # round robin: both replicas took prompts
        shares = rows[("round_robin/session", server)]["engine_share"]
        assert len(shares) == 2 and all(share > 0 for share in shares), shares
    assert "up: single servers (180 blocks)" in capsys.readouterr().out
    assert model_servers(tiny_model_dir) <= servers and _routers() <= routers  # all of its own stopped
