"""agentkv: agent-aware KV-cache runtime for multi-agent LLM apps served by vLLM.

The client core never imports vllm; the vLLM side lives in ``server_patch``.
"""

from .protocol import PROTOCOL_VERSION, AgentTag

__version__ = "0.1.0"

__all__ = ["PROTOCOL_VERSION", "AgentTag", "__version__"]
