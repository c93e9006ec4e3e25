"""vLLM schedulers with agentkv's eviction: ``--scheduler-cls server_patch.scheduler.AgentKVScheduler``.

``AgentKVScheduler`` extends the synchronous ``Scheduler`` (CPU, where async scheduling
is off); ``AgentKVAsyncScheduler`` extends ``AsyncScheduler`` (GPU default). Both only
add bookkeeping around vLLM's own methods; vLLM keeps every scheduling decision.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ._compat import gate
from ._control import ControlServer, control_endpoint
from ._logging import configure_logging
from ._persist import PeriodicSave
from ._runtime import AgentKVRuntime, RuntimeConfig

__all__ = ["AgentKVAsyncScheduler", "AgentKVScheduler"]

logger = logging.getLogger("agentkv.server")


class _AgentKVMixin:
    """Wraps the scheduler entry points; every one runs under the runtime's lock."""

    agentkv: AgentKVRuntime

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        configure_logging()
        result = gate()
        config = RuntimeConfig.from_env()
        # On a vLLM the gate could not verify (opted into LRU) nothing of vLLM's is wrapped or read,
        # so that a missing seam cannot break the engine; nothing is learned, restored or saved either.
        self._agentkv_hooked = result.enabled
        if not result.enabled:
            config = dataclasses.replace(config, enabled=False, snapshot_path=None)
        elif config.enabled and not self.kv_cache_manager.enable_caching:  # type: ignore[attr-defined]
            # --no-enable-prefix-caching: no block is ever reused, so there is no order to choose
            logger.warning("agentkv: prefix caching is off; eviction stays vLLM's own (nothing is reused)")
            config = dataclasses.replace(config, enabled=False)
        self.agentkv = AgentKVRuntime(config, background=True)  # no step waits for a table rebuild
        if self._agentkv_hooked:
            self.agentkv.install(self.kv_cache_manager)  # type: ignore[attr-defined]
            # read under the runtime's lock, which every scheduler entry point holds too
            self.agentkv.queue_lengths = lambda: (len(self.waiting), len(self.running))  # type: ignore[attr-defined]
        self._agentkv_control = ControlServer(control_endpoint(os.getppid()), self.agentkv.handle)
        self._agentkv_saver = (
            PeriodicSave(self.agentkv.save_if_changed, config.snapshot_interval)
            if config.snapshot_path and config.snapshot_interval > 0
            else None
        )
        logger.info(
            "agentkv: survival-scored eviction %s on vLLM %s (control %s)",
            "enabled" if config.enabled else "disabled (plain LRU)",
            result.version,
            self._agentkv_control.endpoint,
        )

    def add_request(self, request: Any) -> None:
        with self.agentkv.lock:
            if self._agentkv_hooked:
                self.agentkv.on_add_request(request)
            super().add_request(request)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        with self.agentkv.lock:
            if self._agentkv_hooked:
                self.agentkv.refresh()
            return super().schedule(*args, **kwargs)  # type: ignore[misc]

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        with self.agentkv.lock:
            return super().update_from_output(*args, **kwargs)  # type: ignore[misc]

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        with self.agentkv.lock:
            return super().finish_requests(*args, **kwargs)  # type: ignore[misc]

    def shutdown(self) -> None:
        try:
            if self._agentkv_saver is not None:
                self._agentkv_saver.close()
            self.agentkv.save_if_changed()  # the middleware's save at SIGINT/SIGTERM may have written it
        finally:
            self._agentkv_control.close()
            super().shutdown()  # type: ignore[misc]


class AgentKVScheduler(_AgentKVMixin, Scheduler):
    """vLLM's synchronous Scheduler with agentkv's survival-scored eviction."""


class AgentKVAsyncScheduler(_AgentKVMixin, AsyncScheduler):
    """vLLM's AsyncScheduler with agentkv's survival-scored eviction."""
