"""The client side never imports vLLM (``pip install agentkv`` has none): every package an app
imports loads without it, in a fresh interpreter where vLLM is installed but must stay unloaded."""

from __future__ import annotations

import subprocess
import sys

CLIENT_MODULES = ("agentkv", "agentkv.client", "agentkv.protocol", "agentkv.graph", "agentkv.warmup",
                  "agentkv.frameworks", "agentkv.frameworks.langgraph", "agentkv.frameworks.autogen", "server_patch")


def test_the_client_packages_import_without_vllm():
    code = ("import importlib, sys\n"
            f"for name in {CLIENT_MODULES!r}:\n"
            "    importlib.import_module(name)\n"
            "loaded = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
            "print(','.join(loaded))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == ""
