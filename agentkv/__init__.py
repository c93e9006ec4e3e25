"""agentkv: agent-aware KV-cache runtime for multi-agent LLM apps served by vLLM.

The client core never imports vllm; the vLLM side lives in ``server_patch``.
"""

from typing import Any

from .protocol import PROTOCOL_VERSION, AgentTag

__version__ = "0.1.0"

__all__ = ["PROTOCOL_VERSION", "AgentTag", "__version__", "agent", "instrument"]


def __getattr__(name: str) -> Any:
    # Lazy: the core must not require langgraph (agentkv.instrument) nor import the openai patch.
    if name == "instrument":
        from .frameworks.langgraph import instrument

        return instrument
    if name == "agent":
        from .client import agent

        return agent
    raise AttributeError(f"module 'agentkv' has no attribute {name!r}")
