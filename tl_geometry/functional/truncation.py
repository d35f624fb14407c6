"""Certified top-N truncation of one attention row (SPEC §10, ours, after Tzachristas et al.).

For one query with valid keys ``T_t``, weights ``α`` and a selection ``H ⊂ T_t`` of size ``N``
(the top-N set by default)::

    τ_N  = Σ_{j∈T_t∖H} α_j                         the tail mass left out
    o    = Σ_{j∈T_t} α_j v_j                        the head's output (value space, before W_O)
    κ_N  = Σ_{j∈H} α_j                              the kept mass (1 − τ_N where Σ α = 1)
    o_N  = Σ_{j∈H} α_j v_j / κ_N                    the renormalised top-N output
    o − o_N = τ_N (μ_T − μ_H)                       μ_H, μ_T: the kept / left-out weighted means
    truncation_error = ‖o − o_N‖ / ‖o‖

``τ_N`` is also the total-variation distance between ``α`` and its renormalised truncation.

The kept mass is summed in float64 over the selected keys themselves, never formed as ``1 − τ_N``
(SPEC §10): a float32 row sums to 1 only within about 1e-7, so where little is kept, ``1 − τ_N``
is that round-off and not the selection's weight. Edge cases: ``N`` outside ``1 ≤ N < |T_t|``
gives NaN for both (as every metric, SPEC §2); ``o = 0`` gives a NaN error (no relative error of
a zero output); a kept mass below :data:`~.dtypes.KEPT_MASS_MIN` (1e-6) gives a NaN error, its
reason being that round-off of ``α`` would decide it. The engine computes the same figures for
the top-N and sink-removed sets (``tl_geometry.engine``); this is the direct vector form.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from .dtypes import COMPUTE_DTYPE, KEPT_MASS_MIN, as_compute
from .separability import check_rows, check_selection


class Truncation(NamedTuple):
    """The truncation figures of SPEC §10, each of the rows' shape; NaN where undefined. Its
    fields are :data:`~.separability.TRUNCATION_NAMES`, the names on the result's metric axis."""

    tail_mass: Float[Tensor, "*batch"]
    """``τ_N = Σ_{j∉H} α_j``: the attention left outside the selection."""
    truncation_error: Float[Tensor, "*batch"]
    """``‖o − o_N‖ / ‖o‖`` of the renormalised selection ``o_N = Σ_H α_j v_j / Σ_H α_j``."""


def truncation(
    alpha: Float[Tensor, "*abatch key"],
    values: Float[Tensor, "*vbatch key d"],
    n: int,
    *,
    key_mask: Bool[Tensor, "*mbatch key"] | None = None,
    selected: Bool[Tensor, "*sbatch key"] | None = None,
) -> Truncation:
    """Tail mass ``τ_N`` and relative output error of the renormalised top-``n`` set (SPEC §10).

    Arguments as :func:`~tl_geometry.functional.separability`'s. Float64, NaN where ``n`` is
    outside ``1 ≤ n < |valid keys|``; a NaN error where ``o = 0`` or the kept mass ``Σ_H α`` is
    below ``KEPT_MASS_MIN`` (1e-6).

    >>> alpha = torch.tensor([0.5, 0.25, 0.25])
    >>> values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    >>> out = truncation(alpha, values, 1)
    >>> out.tail_mass.item(), round(out.truncation_error.item(), 4)   # o = (0.5, 0.5), o_1 = (1, 0)
    (0.5, 1.0)
    """
    check_rows(alpha, values, n)
    key_mask, selected = check_selection(alpha, n, key_mask, selected)
    alpha, values = as_compute(alpha), as_compute(values)
    key_mask, selected = torch.broadcast_tensors(key_mask, selected)
    weights = torch.where(key_mask, alpha, 0.0)
    kept = torch.where(selected, weights, 0.0)
    tail = (weights - kept).sum(-1)
    # o and s as (weights @ values): the batch dimensions of values are never expanded per key.
    o = (weights.unsqueeze(-2) @ values).squeeze(-2)
    s = (kept.unsqueeze(-2) @ values).squeeze(-2)
    keep = kept.sum(-1)  # κ_N over the selected keys themselves, never 1 − τ_N (module docstring)
    enough = keep >= KEPT_MASS_MIN
    o_n = s / torch.where(enough, keep, 1.0).unsqueeze(-1)
    norm_o = torch.linalg.vector_norm(o, dim=-1)
    error = torch.linalg.vector_norm(o - o_n, dim=-1) / norm_o
    error = torch.where((norm_o > 0) & enough, error, torch.nan)
    n_keys = key_mask.sum(-1)
    defined = (n >= 1) & (n < n_keys)
    nan = torch.tensor(torch.nan, dtype=COMPUTE_DTYPE, device=tail.device)
    return Truncation(torch.where(defined, tail, nan), torch.where(defined, error, nan))
