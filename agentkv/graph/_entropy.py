"""Predictability R = 1 - H(next | current) / H(next), of learned counts or of a known chain."""

from __future__ import annotations

import numpy as np

__all__ = ["entropy", "predictability_of_counts", "transition_entropy_ratio"]


def entropy(p: np.ndarray) -> float:
    """Shannon entropy (bits) of a distribution; zero entries are skipped."""
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum()) if p.size else 0.0


def predictability_of_counts(counts: np.ndarray) -> float:
    """R from transition counts (row: from, column: to); 0 without counts, 1 when next is certain."""
    total = counts.sum()
    if total <= 0:
        return 0.0
    h_next = entropy(counts.sum(axis=0) / total)
    if h_next <= 1e-12:
        return 1.0
    # H(next | current) = -sum_ij C_ij/N log2(C_ij / C_i.)
    rows = counts.sum(axis=1, keepdims=True)
    ratio = np.divide(counts, rows, out=np.ones_like(counts), where=counts > 0)
    h_cond = float(-(counts * np.log2(ratio)).sum() / total)
    return float(min(1.0, max(0.0, 1.0 - h_cond / h_next)))


def transition_entropy_ratio(matrix: np.ndarray, stationary: np.ndarray) -> float:
    """R of a known chain: 1 - H(next | current) / H(next) under distribution ``stationary``."""
    h_cond = float(sum(stationary[i] * entropy(matrix[i]) for i in range(len(stationary))))
    h_next = entropy(stationary @ matrix)
    return 1.0 if h_next <= 1e-12 else 1.0 - h_cond / h_next

