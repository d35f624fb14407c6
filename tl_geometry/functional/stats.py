"""Rank statistics: Spearman's ρ (a float) and the nearest-rank percentile of SPEC §10 (ours)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch
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


def nearest_rank_percentile(x: Float[Tensor, "sample ..."], q: float) -> Float[Tensor, "*batch"]:
    """The ``q``-quantile (``0 < q ≤ 1``) of the non-NaN values along the first axis, by
    nearest rank: the ``⌈q·c⌉``-th smallest of the ``c`` values; NaN where ``c = 0``.

    It is one of the values, and at least a fraction ``q`` of the values are ``≤`` it (NumPy's
    ``method="inverted_cdf"``; ours, SPEC §10).

    >>> nearest_rank_percentile(torch.tensor([[4.0], [1.0], [float("nan")], [3.0], [2.0]]), 0.9).tolist()
    [4.0]
    """
    if not 0 < q <= 1:
        raise ValueError(f"q must be in (0, 1], got {q!r}.")
    count = (~torch.isnan(x)).sum(0)
    if x.shape[0] == 0:
        return torch.full(x.shape[1:], torch.nan, dtype=x.dtype, device=x.device)
    # NaN sorts after every value (+inf included): the c values come first, in order.
    ordered = torch.sort(x, dim=0, stable=True).values
    # ⌈q·c⌉ in integers: q = 0.9 is 9/10 here, not the binary 0.9000000000000000222 (which
    # would make ⌈0.9·10⌉ = 10).
    ratio = Fraction(q).limit_denominator(1 << 20)
    rank = (count * ratio.numerator + ratio.denominator - 1) // ratio.denominator  # 1-based
    value = ordered.gather(0, (rank - 1).clamp_min(0).unsqueeze(0)).squeeze(0)
    return torch.where(count > 0, value, torch.nan)
