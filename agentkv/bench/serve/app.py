"""The app ``agentkv bench serve`` drives: ``examples/langgraph_supervisor.py``, loaded from the checkout."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from agentkv.bench.serve_args import REPO_ROOT

__all__ = ["EXAMPLE", "load_example"]

EXAMPLE = REPO_ROOT / "examples" / "langgraph_supervisor.py"


def load_example() -> ModuleType:
    """``examples/langgraph_supervisor.py`` as a module (it lives in the repository, not the package)."""
    name = "agentkv_example_langgraph_supervisor"
    if name in sys.modules:
        return sys.modules[name]
    if not EXAMPLE.is_file():
        raise FileNotFoundError(f"{EXAMPLE} not found: agentkv bench serve runs from a source checkout")
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
