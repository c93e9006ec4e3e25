"""The seam between the replay engine and its eviction policies.

``Simulator`` is what a policy may use of the engine (the structural type ``Replay``
satisfies); ``Policy`` holds the hooks the engine calls, in scheduler order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from server_patch._free_queue import ScoredFreeBlockQueue

if TYPE_CHECKING:
    from .plan import TapePlan
    from .tape import TapeRequest

__all__ = ["Policy", "ScoredPolicy", "Simulator"]


class Simulator(Protocol):
    """One simulated engine as its policy sees it.

    ``kv``/``pool``: the real vLLM manager and its block pool; ``plan``: the tape being
    replayed; ``next_index``: the next tape request to start (requests start in tape order).
    """

    plan: TapePlan
    kv: KVCacheManager
    pool: BlockPool
    next_index: int

    def clock(self) -> float:
        """Simulated seconds since the tape's start."""
        ...

    def waiting(self) -> bool:
        """A request has arrived and waits to start."""
        ...

    def warmup(self, agent: str, segments: Sequence[tuple[str, int]], add_request: Callable[[Request], None]) -> bool:
        """Issue a prefill-only warm-up of ``segments`` now; False when it does not fit without waiting."""
        ...


class Policy:
    """Hooks the replay engine calls, in scheduler order; the default is vanilla vLLM."""

    name = "lru"
    tagged = True  # requests carry agentkv tags in extra_args (inert without the runtime)
    sessions = True  # ... naming their session, parent and step, and an X-Session-ID; False: the agent alone

    def install(self, sim: Simulator) -> None:
        """Called once on a fresh manager, before the first request."""

    def on_arrival(self, sim: Simulator, request: Request, record: TapeRequest) -> None:
        """The engine received a request (the scheduler's ``add_request``)."""

    def before_schedule(self, sim: Simulator) -> None:
        """Start of a scheduling step (the runtime's ``refresh`` point)."""

    def on_start(self, sim: Simulator, request: Request, record: TapeRequest) -> None:
        """The request was admitted: its blocks are allocated and its hit recorded."""

    def before_free(self, sim: Simulator, request: Request, record: TapeRequest) -> None:
        """The request finished and its output blocks are cached; its blocks are freed next."""

    def pin_for(self, sim: Simulator, request: Request, record: TapeRequest) -> float:
        """Seconds to keep a finished request's blocks referenced before freeing them (0: free now)."""
        return 0.0

    def on_finish(self, sim: Simulator, request: Request, record: TapeRequest) -> None:
        """The request finished; its blocks were just freed."""

    def on_session_end(self, sim: Simulator, session: str) -> None:
        """The session's last request finished (the app knows its session is over)."""

    def stats(self) -> dict[str, Any]:
        return {}


class ScoredPolicy(Policy, ABC):
    """A policy that orders eviction with a ScoredFreeBlockQueue: ``group_of`` + ``score``.

    Eviction key of a free cached block = score(group) + decay * t_free (smallest first),
    so with ``decay = 0`` ties between groups of equal score fall back to LRU order.
    ``dynamic`` policies have their scores re-read at every scheduling step.
    """

    decay = 0.0
    dynamic = True

    @abstractmethod
    def group_of(self, block: KVCacheBlock) -> Hashable:
        """The eviction group of a freed block (called once, when it is freed)."""

    @abstractmethod
    def score(self, group: Hashable) -> float:
        """Log-space score of a group: smaller is evicted first, -inf first of all."""

    def install(self, sim: Simulator) -> None:
        self.sim = sim
        self.queue = ScoredFreeBlockQueue.replace(sim.pool, self.group_of, clock=sim.clock, decay=self.decay)
        self.queue.set_group_scores(self.score)

    def before_schedule(self, sim: Simulator) -> None:
        if self.dynamic:
            self.queue.set_group_scores(self.score)
