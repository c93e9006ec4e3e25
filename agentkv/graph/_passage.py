"""First-passage probabilities of the agent chain: at which dispatch an agent is first called."""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["PassageBuilder", "by_origin", "first_passage_steps", "first_passage_within", "padded_passage",
           "passage_size"]


def first_passage_within(matrix: np.ndarray, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """H[i, a] = P(the chain started at i visits a at some step 1..horizon); returns (H_K, H_{K-1})."""
    steps = first_passage_steps(matrix, horizon, tolerance=0.0)
    within = np.cumsum(steps, axis=0) if len(steps) else np.zeros((1, *matrix.shape))
    previous = within[-2] if len(within) > 1 else np.zeros(matrix.shape)
    return np.clip(within[-1], 0.0, 1.0), np.clip(previous, 0.0, 1.0)


def first_passage_steps(matrix: np.ndarray, max_steps: int, *, tolerance: float) -> np.ndarray:
    """F[k-1, i, a] = P(the chain started at i first visits a at step k), k = 1..K.

    K = max_steps, or the first step at which no first visit is more likely than ``tolerance``.
    Recursion on all targets at once: F_1 = P, F_k[i, a] = sum_{j != a} P[i, j] F_{k-1}[j, a].
    The table is stored by origin (one start's K rows in one block, what its readers take), and
    returned as a (K, i, a) view of that storage: ``by_origin`` of it copies nothing.
    """
    n = matrix.shape[0]
    if n == 0:
        return np.zeros((0, 0, 0))
    out = [matrix]
    current = matrix
    while len(out) < max_steps:
        current = matrix @ current - matrix * np.diag(current)[None, :]
        out.append(current)
        if float(current.max()) < tolerance:
            break
    table = np.stack(out, axis=1)
    np.clip(table, 0.0, 1.0, out=table)
    return table.transpose(1, 0, 2)


def by_origin(passage: np.ndarray) -> np.ndarray:
    """``passage`` (K, i, a) as a contiguous (i, K, a) array: one start's rows in one block.

    A table from ``first_passage_steps`` is already stored so: its view is returned as it is.
    """
    return np.ascontiguousarray(passage.transpose(1, 0, 2))


def padded_passage(passage: np.ndarray, agents: int) -> np.ndarray:
    """``passage`` (K, i, a) of a chain's first agents, for the chain of ``agents`` agents that
    grew from it by appending: no first visit to or from an agent added since (0 until a table
    of the grown chain is built). Stored by origin, as ``first_passage_steps`` stores it."""
    steps, n, _ = passage.shape
    table = np.zeros((agents, steps, agents))
    table[:n, :, :n] = by_origin(passage)
    return table.transpose(1, 0, 2)


def passage_size(built: int | None, agents: int) -> int:
    """The chain size to key a first-passage table on, ``built`` the size of the current one: from
    ``PassageBuilder.MIN_AGENTS`` agents on, ``built`` until the chain has 5% more agents (the ones
    added since are padded in: no first visit to or from them), so that a chain gaining agents one
    by one is not rebuilt at each (a 600-agent replay spent most of its time there); else ``agents``."""
    if built is not None and PassageBuilder.MIN_AGENTS <= built <= agents < built + max(1, built // 20):
        return built
    return agents


class PassageBuilder:
    """``first_passage_steps`` of the latest chain submitted, built off the caller's thread.

    At hundreds of agents a table takes tens of milliseconds (24 dense matrix products), a stall
    of the scheduler step that rebuilds it; the caller keeps scoring with its current table and
    takes the new one when ``take`` returns it. Invariants: ``take`` returns only whole tables,
    each once, the newest finished; a submit while a build runs replaces the job waiting behind
    it (at most one waits). One daemon thread, started by the first submit, waits for jobs.
    A chain of fewer than ``MIN_AGENTS`` agents is built in ``submit`` (half a millisecond at
    most: not worth reading an older table meanwhile), and so is every chain with
    ``background=False`` (replays: simulated time must not depend on a thread's speed).
    """

    MIN_AGENTS = 64

    def __init__(self, *, background: bool = True) -> None:
        self.background = background
        self._ready = threading.Condition()
        self._job: tuple[np.ndarray, int, float] | None = None
        self._done: np.ndarray | None = None
        self._worker: threading.Thread | None = None

    def submit(self, matrix: np.ndarray, max_steps: int, *, tolerance: float) -> None:
        """Build the table of ``matrix`` (which the caller no longer modifies)."""
        if not self.background or len(matrix) < self.MIN_AGENTS:
            self._done = first_passage_steps(matrix, max_steps, tolerance=tolerance)
            return
        with self._ready:
            self._job = (matrix, max_steps, tolerance)
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="agentkv-passage", daemon=True)
                self._worker.start()
            self._ready.notify()

    def take(self) -> np.ndarray | None:
        """The newest table finished since the last ``take``, or None."""
        with self._ready:
            done, self._done = self._done, None
        return done

    def _run(self) -> None:
        while True:
            with self._ready:
                while self._job is None:
                    self._ready.wait()
                (matrix, max_steps, tolerance), self._job = self._job, None
            table = first_passage_steps(matrix, max_steps, tolerance=tolerance)  # numpy releases the GIL
            with self._ready:
                self._done = table
