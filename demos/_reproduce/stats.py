"""Small statistics over heads: NaN-aware means and medians, Spearman ρ without scipy."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor


def mean(x: Tensor) -> float:
    """Mean of the finite entries (NaN when there are none)."""
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else math.nan


def median(x: Tensor) -> float:
    """Median of the finite entries (the mean of the two middle ones for an even count)."""
    x = x[torch.isfinite(x)].double()
    return float(x.quantile(0.5)) if x.numel() else math.nan


def fraction(condition: Tensor, among: Tensor | None = None) -> float:
    """Share of ``among`` (default: all) entries where ``condition`` holds."""
    among = torch.ones_like(condition, dtype=torch.bool) if among is None else among
    n = int(among.sum())
    return float((condition & among).sum()) / n if n else math.nan


def per_n(x: Tensor) -> list[float]:
    """``[layer, head, n]`` → the mean over heads of each N."""
    return [mean(x[..., i]) for i in range(x.shape[-1])]


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their average rank."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    _, inverse = np.unique(x, return_inverse=True)
    sums = np.bincount(inverse, weights=ranks)
    return (sums / np.bincount(inverse))[inverse]


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman rank correlation over the pairs where both are finite (NaN for < 3 pairs or a
    constant side)."""
    a, b = x.flatten().double().numpy(), y.flatten().double().numpy()
    keep = np.isfinite(a) & np.isfinite(b)
    if keep.sum() < 3:
        return math.nan
    return pearson(torch.from_numpy(_ranks(a[keep])), torch.from_numpy(_ranks(b[keep])))


def pearson(x: Tensor, y: Tensor) -> float:
    """Pearson correlation over the pairs where both are finite."""
    x, y = x.flatten().double(), y.flatten().double()
    keep = torch.isfinite(x) & torch.isfinite(y)
    x, y = x[keep] - x[keep].mean(), y[keep] - y[keep].mean()
    denominator = float((x.square().sum() * y.square().sum()).sqrt())
    return float((x * y).sum()) / denominator if denominator > 0 else math.nan
