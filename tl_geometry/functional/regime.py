"""Regime diagnostics (SPEC §6c): how well a head's values fit the sink-aware regime of §6b.

Per head: the coefficient of variation of the non-sink value norms, κ, and a least-squares fit
``cos(v_i, v_j) ≈ a·exp(−λ|i−j|) + b`` over non-sink pairs (negative cosines kept).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .bounds import PairStats, pair_stats
from .dtypes import COMPUTE_DTYPE
from .figures import labels


class RegimeDiagnostics(NamedTuple):
    """How well a head's values fit the regime (SPEC §6c), each field ``[*batch]``; the fields
    are :data:`REGIME_FIELDS` (``decay`` is λ)."""

    norm_cv: Float[Tensor, "*batch"]
    """Coefficient of variation of the non-sink value norms."""
    kappa: Float[Tensor, "*batch"]
    """‖v_sink‖ / mean non-sink norm."""
    a: Float[Tensor, "*batch"]
    decay: Float[Tensor, "*batch"]
    """λ of ``cos(v_i, v_j) ≈ a·exp(−λ|i−j|) + b`` over non-sink pairs."""
    b: Float[Tensor, "*batch"]
    fit_mae: Float[Tensor, "*batch"]
    """Mean absolute error of that fit over the pairs."""


#: The regime figures in storage order (the result's ``regime_field`` axis, :data:`.figures.FIGURES`).
REGIME_FIELDS = labels("regime_field")

#: λ grid of the coherence fit (per-token decay rates from 1e-3 to 10).
DECAY_GRID = torch.logspace(-3, 1, 81, dtype=COMPUTE_DTYPE)


def regime_diagnostics(
    values: Float[Tensor, "*batch key d"],
    sink: Int[Tensor, "*ibatch"] | int,
    key_mask: Bool[Tensor, "*mbatch key"] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> RegimeDiagnostics:
    """Norm spread, κ and the fit ``cos(v_i, v_j) ≈ a·exp(−λ|i−j|) + b`` of SPEC §6c: per λ of
    :data:`DECAY_GRID` the closed-form least-squares ``a, b`` over the non-sink pairs (sampled as
    in :func:`~.bounds.fit_regime`); the λ with the smallest squared error wins."""
    return diagnostics_from_pairs(pair_stats(values, sink, key_mask, generator))


def diagnostics_from_pairs(stats: PairStats) -> RegimeDiagnostics:
    """:func:`regime_diagnostics` from precomputed :class:`PairStats`."""
    norms, not_sink, cos, pair_ok, lag = stats.norms, stats.not_sink, stats.cos, stats.pair_ok, stats.lag
    count = not_sink.sum(-1)
    mean = torch.where(not_sink, norms, 0).sum(-1) / count
    var = torch.where(not_sink, (norms - mean.unsqueeze(-1)) ** 2, 0).sum(-1) / count
    kappa = stats.sink_norm / mean
    # The fit's design x = exp(−λ·lag) depends on a pair only through its lag, an integer in
    # [0, key): sum the pairs' weights and cosines per lag once, then fit on [grid, lag] instead
    # of exponentiating every (λ, pair).
    n_lag = stats.norms.shape[-1]
    index = lag.to(device=cos.device, dtype=torch.long).expand(cos.shape)  # lag may be a CPU sample
    w = pair_ok.to(COMPUTE_DTYPE)
    y = torch.where(pair_ok, cos, 0)
    zeros = torch.zeros((*cos.shape[:-1], n_lag), dtype=COMPUTE_DTYPE, device=cos.device)
    w_lag = zeros.scatter_add(-1, index, w)  # [*batch, lag]
    wy_lag = zeros.scatter_add(-1, index, y)
    grid = DECAY_GRID.to(cos.device)
    x = torch.exp(-grid[:, None] * torch.arange(n_lag, dtype=COMPUTE_DTYPE, device=cos.device))
    sw = w.sum(-1, keepdim=True)  # [*batch, 1]
    sy = y.sum(-1, keepdim=True)
    sx, sxx, sxy = w_lag @ x.T, w_lag @ (x * x).T, wy_lag @ x.T  # [*batch, grid]
    det = sw * sxx - sx * sx
    a = torch.where(det.abs() > 1e-12, (sw * sxy - sx * sy) / det, 0.0)
    b = (sy - a * sx) / sw
    syy = (y * y).sum(-1, keepdim=True)
    # Σ w (y − a x − b)² expanded, per λ.
    sse = syy + a * a * sxx + b * b * sw - 2 * a * sxy - 2 * b * sy + 2 * a * b * sx
    best = sse.argmin(-1, keepdim=True)
    a, b = a.gather(-1, best).squeeze(-1), b.gather(-1, best).squeeze(-1)
    decay = grid[best.squeeze(-1)]
    fit = x[best.squeeze(-1)] * a.unsqueeze(-1) + b.unsqueeze(-1)  # [*batch, lag]
    mae = (w * (y - fit.gather(-1, index)).abs()).sum(-1) / sw.squeeze(-1)
    return RegimeDiagnostics(var.sqrt() / mean, kappa, a, decay, b, mae)
