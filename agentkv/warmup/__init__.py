"""Background anchor warm-up coordinator.

    from agentkv.warmup import WarmupCoordinator

    with WarmupCoordinator("http://127.0.0.1:8000"):
        app.invoke(...)            # any instrumented LangGraph / AutoGen / agentkv.agent() code

After each dispatch the coordinator predicts the next agent and, in the background, re-prefills
that agent's *anchor* (the exact prefix its calls share, captured from its real requests) with a
``max_tokens=1`` warm-up request. See ``docs/frameworks.md`` ("Warm-up").
"""

from agentkv.client import TaggedResponse, on_response

from ._anchors import Anchor, AnchorBook
from ._config import WarmupConfig
from ._coordinator import WarmupCoordinator
from ._decision import JobState, TargetState, TokenBucket, WarmupDecision, WarmupPolicy
from ._lint import Divergence, common_prefix
from ._server import view_of

__all__ = [
    "Anchor",
    "AnchorBook",
    "Divergence",
    "JobState",
    "TaggedResponse",
    "TargetState",
    "TokenBucket",
    "WarmupConfig",
    "WarmupCoordinator",
    "WarmupDecision",
    "WarmupPolicy",
    "common_prefix",
    "on_response",
    "view_of",
]
