"""The client side's packages import each other only through public names."""

import ast
from pathlib import Path

import agentkv.client

ROOT = Path(__file__).parents[2] / "agentkv"
PACKAGES = ("client", "frameworks", "warmup")


def _private_imports(path: Path, own: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("agentkv"):
            parts = str(node.module).split(".")
            foreign = parts[:2] != ["agentkv", own]
            if foreign and any(p.startswith("_") for p in parts[1:]) and node.module != "agentkv._bounded":
                found.append(f"{path.name}: from {node.module} import ...")
            if foreign and any(alias.name.startswith("_") for alias in node.names):
                found.append(f"{path.name}: from {node.module} import {[a.name for a in node.names]}")
    return found


def test_no_module_imports_another_packages_private_names():
    found = [hit for pkg in PACKAGES for path in (ROOT / pkg).glob("*.py") for hit in _private_imports(path, pkg)]
    assert found == []


def test_the_client_core_exports_every_name_it_lists():
    assert all(hasattr(agentkv.client, name) for name in agentkv.client.__all__)
    assert sorted(agentkv.client.__all__) == sorted(set(agentkv.client.__all__))


def test_frameworks_and_warmup_reexport_the_core_objects():
    import agentkv.frameworks
    import agentkv.warmup

    for name in agentkv.frameworks.__all__:
        if hasattr(agentkv.client, name):
            assert getattr(agentkv.frameworks, name) is getattr(agentkv.client, name)
    assert agentkv.warmup.on_response is agentkv.client.on_response
    assert agentkv.warmup.TaggedResponse is agentkv.client.TaggedResponse
