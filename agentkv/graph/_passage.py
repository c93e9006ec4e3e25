"""First-passage probabilities of the agent chain: at which dispatch an agent is first called."""

from __future__ import annotations

import numpy as np

__all__ = ["by_origin", "first_passage_steps", "first_passage_within"]


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
