"""The tiny test model's build (``agentkv.testing.tiny_model``)."""

from __future__ import annotations

import os
import time

from agentkv.testing.tiny_model import build_tiny_model


def test_a_build_sweeps_what_a_killed_build_left(tmp_path):
    stale, fresh = tmp_path / ".model.tmp-old", tmp_path / ".model.tmp-now"  # killed an hour ago / building now
    for left in (stale, fresh):
        left.mkdir()
        (left / "config.json").write_text("{}")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert build_tiny_model(tmp_path / "model") == (tmp_path / "model").resolve()
    assert not stale.exists() and fresh.exists()
