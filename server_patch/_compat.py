"""Version gate: agentkv extends vLLM only where it has checked every seam it relies on."""

from __future__ import annotations

import inspect
import logging
import os
import re
from dataclasses import dataclass

from agentkv.settings import env_switch

__all__ = [
    "SUPPORTED", "GateResult", "UnsupportedVLLM", "check_vllm", "gate", "is_supported_release", "supported_lines",
]

logger = logging.getLogger("agentkv.server")

# vLLM release lines whose v1/core code this extension was verified against.
SUPPORTED: tuple[str, ...] = ("0.32", "0.33")

# Methods and attributes the extension wraps or reads, per class.
_REQUIRED_METHODS: dict[str, tuple[str, ...]] = {
    "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue": (
        "popleft",
        "popleft_n",
        "remove",
        "append",
        "append_n",
        "prepend_n",
        "get_all_free_blocks",
    ),
    "vllm.v1.core.block_pool:BlockPool": ("get_new_blocks", "free_blocks", "touch", "cache_full_blocks",
                                         "get_cached_block", "get_num_free_blocks", "reset_prefix_cache"),
    "vllm.v1.core.kv_cache_manager:KVCacheManager": ("get_computed_blocks", "record_prefix_cache_stats"),
    "vllm.v1.core.sched.scheduler:Scheduler": ("add_request", "schedule", "update_from_output", "finish_requests"),
}
_REQUIRED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "vllm.v1.core.block_pool:BlockPool.cache_full_blocks": (
        "request",
        "blocks",
        "num_cached_blocks",
        "num_full_blocks",
        "block_size",
    ),
    "vllm.v1.core.kv_cache_manager:KVCacheManager.record_prefix_cache_stats": ("request", "num_hits"),
    "vllm.v1.request:Request.__init__": ("session_id", "sampling_params"),
}
_REQUIRED_SLOTS: tuple[str, ...] = (
    "block_id",
    "block_hash",
    "ref_cnt",
    "prev_free_block",
    "next_free_block",
    "is_null",
)


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM lacks something agentkv relies on."""


@dataclass(frozen=True)
class GateResult:
    version: str
    enabled: bool
    reason: str = ""


def _resolve(path: str) -> object:
    module_name, _, qualname = path.partition(":")
    obj: object = __import__(module_name, fromlist=["_"])
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# A final release, a post-release or a local build of one (0.32.0, 0.33.1.post1, 0.32.0+cpu);
# pre-releases and dev builds (0.33.0rc1, 0.33.0.dev12+g1234) are not the code that was checked.
_FINAL_RELEASE = re.compile(r"(\d+)\.(\d+)\.\d+(\.post\d+)?(\+[0-9A-Za-z.]+)?")


def is_supported_release(version: str) -> bool:
    """Whether ``version`` is a final release of one of the SUPPORTED release lines."""
    match = _FINAL_RELEASE.fullmatch(version.strip())
    return match is not None and f"{match[1]}.{match[2]}" in SUPPORTED


def supported_lines() -> str:
    """The SUPPORTED release lines as a user reads them: ``0.32.x, 0.33.x``."""
    return ", ".join(f"{line}.x" for line in SUPPORTED)


def check_vllm() -> str:
    """Return the vLLM version, or raise UnsupportedVLLM naming every missing seam."""
    try:
        import vllm
    except ImportError as exc:
        raise UnsupportedVLLM(f"vLLM is not importable: {exc}") from exc
    version = vllm.__version__
    problems = []
    if not is_supported_release(version):
        problems.append(f"vLLM {version} is not a supported release ({supported_lines()})")
    for path, methods in _REQUIRED_METHODS.items():
        try:
            cls = _resolve(path)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{path} is missing ({exc})")
            continue
        problems += [f"{path}.{m} is missing" for m in methods if not callable(getattr(cls, m, None))]
    for path, names in _REQUIRED_PARAMETERS.items():
        try:
            parameters = inspect.signature(_resolve(path)).parameters  # type: ignore[arg-type]
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            problems.append(f"{path} cannot be inspected ({exc})")
            continue
        problems += [f"{path} has no parameter {n!r}" for n in names if n not in parameters]
    try:
        block_cls = _resolve("vllm.v1.core.kv_cache_utils:KVCacheBlock")
        fields = set(getattr(block_cls, "__dataclass_fields__", {})) | set(dir(block_cls))
        problems += [f"KVCacheBlock.{f} is missing" for f in _REQUIRED_SLOTS if f not in fields]
    except (ImportError, AttributeError) as exc:
        problems.append(f"KVCacheBlock is missing ({exc})")
    if problems:
        raise UnsupportedVLLM("agentkv cannot extend this vLLM: " + "; ".join(problems))
    return version


def gate() -> GateResult:
    """Run the check at start-up: refuse loudly, or run as plain LRU if the user opted in.

    Opt-in: AGENTKV_ALLOW_LRU_FALLBACK=1. The extension then stays out of the eviction
    path entirely and says so in the log and in its stats.
    """
    try:
        return GateResult(check_vllm(), enabled=True)
    except UnsupportedVLLM as exc:
        if not env_switch(os.environ, "AGENTKV_ALLOW_LRU_FALLBACK", False):
            raise
        logger.error("%s; running as plain LRU because AGENTKV_ALLOW_LRU_FALLBACK=1", exc)
        import vllm

        return GateResult(vllm.__version__, enabled=False, reason=str(exc))
