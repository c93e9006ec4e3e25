"""agentkv's vLLM extension (no fork): survival-scored eviction inside unmodified vLLM.

Start it with ``agentkv serve MODEL [vllm args]``, or by hand (docs/server.md):
``--scheduler-cls server_patch.scheduler.AgentKVScheduler``
``--middleware server_patch.middleware.AgentKVMiddleware --enable-prompt-tokens-details``.
Importing this package does not import vllm; its submodules do.
"""

SCHEDULER = "server_patch.scheduler.AgentKVScheduler"
ASYNC_SCHEDULER = "server_patch.scheduler.AgentKVAsyncScheduler"
MIDDLEWARE = "server_patch.middleware.AgentKVMiddleware"

__all__ = ["ASYNC_SCHEDULER", "MIDDLEWARE", "SCHEDULER"]
