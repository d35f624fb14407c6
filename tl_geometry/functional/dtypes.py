"""The compute dtype and the cosine η of every metric (SPEC §1, §3–4), and the cast to it."""

from __future__ import annotations

import torch

#: Every metric is computed in this dtype, whatever the cache dtype (SPEC §1: "float32 or
#: better"). float64 keeps exact ties (duplicated vectors) exact and makes the factored
#: distance ‖y_i − s‖² = α_i²‖v_i‖² − 2α_i⟨v_i, s⟩ + ‖s‖² accurate where it cancels.
COMPUTE_DTYPE = torch.float64

#: η of the cosine distance and of every cosine in SPEC §3–4.
COSINE_EPS = 1e-12

#: Below this kept mass ``Σ_{j∈H} α_j`` the relative truncation error is NaN (SPEC §10): the
#: renormalisation ``1/Σ_H α`` would then amplify the round-off of ``α`` (about 1e-7 for a
#: float32 pattern) into the figure, so two forwards equal to float precision could disagree.
KEPT_MASS_MIN = 1e-6


def as_compute(x: torch.Tensor) -> torch.Tensor:
    """Return ``x`` in :data:`COMPUTE_DTYPE` (a new tensor when a cast is needed, never in place)."""
    return x.to(COMPUTE_DTYPE)
