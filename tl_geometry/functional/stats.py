"""Rank statistics shared by the capacity study, its views and the report.

Spearman's ρ with average ranks for ties, over the finite pairs only: NumPy in, a float out.
"""

from __future__ import annotations

import math

import numpy as np
from jaxtyping import Float
from torch import Tensor


def spearman(x: Float[Tensor, ...], y: Float[Tensor, ...]) -> float:
    """Spearman's rank correlation (average ranks for ties) over the pairs where both are
    finite; NaN with fewer than 3 pairs or a constant side.

    >>> spearman(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([10.0, 9.0, 2.0, 1.0]))
    -1.0
    """
    a, b = x.flatten().double().cpu().numpy(), y.flatten().double().cpu().numpy()
    keep = np.isfinite(a) & np.isfinite(b)
    if keep.sum() < 3:
        return math.nan
    ra, rb = average_ranks(a[keep]), average_ranks(b[keep])
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denominator) if denominator > 0 else math.nan


def average_ranks(x: np.ndarray) -> np.ndarray:
    """0-based ranks of ``x`` with ties given the mean of their ranks.

    >>> average_ranks(np.array([3.0, 1.0, 3.0])).tolist()
    [1.5, 0.0, 1.5]
    """
    order = np.argsort(x, kind="stable")
    _, first, counts = np.unique(x[order], return_index=True, return_counts=True)
    ranks = np.empty(len(x))
    ranks[order] = np.repeat(first + (counts - 1) / 2, counts)
    return ranks
