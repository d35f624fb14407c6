"""Geometric precision, recall, F-score, margin and inversion count of a key selection (SPEC §3).

For one query with valid keys ``T_t``, contributions ``y_i = α_i v_i`` and a selection
``S ⊂ T_t`` of size ``N``, with ``s = Σ_{i∈S} y_i`` and ``D_i = d(y_i, s)``::

    ρ_max = max_{i∈S} D_i          ρ_min = min_{j∈T_t∖S} D_j
    P = N / (N + |{j∉S : D_j ≤ ρ_max}|)      (closed outer ball: a tie is contamination)
    R = |{i∈S : D_i < ρ_min}| / N            (strict inner ball: a tie is not recalled)
    F = 2PR / (P + R)   (0 when R = 0)       γ = ρ_min − ρ_max
    GInv = Σ_{i∈S} Σ_{j∉S} 1{D_j ≤ D_i}
    P* = (P − N/|T_t|) / (1 − N/|T_t|)       F* = harmonic mean of P* and R (0 when either is 0)

``P*`` and ``F*`` are the chance-corrected scores (SPEC §3, ours): precision never falls below
its floor ``N/|T_t|`` (every unselected key inside the outer ball), so raw P and F rise at dense
N whatever the geometry; ``P*`` rescales that floor to 0.

The distances are computed from ``α``, ``‖v‖`` and ``⟨v_i, s⟩`` only (SPEC §1), so the
``[..., key, d]`` contributions are never formed per query.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .dtypes import COMPUTE_DTYPE, COSINE_EPS, as_compute
from .figures import labels
from .heads import first_duplicate, value_dots
from .selection import top_n_mask

Distance = Literal["euclidean", "cosine"]


class Separability(NamedTuple):
    """The separability figures of SPEC §3, each of the rows' shape; NaN where undefined."""

    precision: Float[Tensor, "*batch"]
    recall: Float[Tensor, "*batch"]
    f_score: Float[Tensor, "*batch"]
    margin: Float[Tensor, "*batch"]
    inversions: Float[Tensor, "*batch"]
    precision_cc: Float[Tensor, "*batch"]
    """Chance-corrected precision ``P* = (P − N/|T_t|) / (1 − N/|T_t|)`` (ours), in [0, 1]."""
    f_score_cc: Float[Tensor, "*batch"]
    """Harmonic mean of ``P*`` and ``R`` (0 when either is 0; ours)."""


#: Metric names in storage order (the result's ``metric`` axis, :data:`.figures.FIGURES`):
#: SPEC §3's (:class:`Separability`'s fields), then SPEC §10's.
METRIC_NAMES: tuple[str, ...] = labels("metric")
#: The truncation figures of SPEC §10 (:mod:`.truncation`, ours): tail mass ``τ_N`` and the
#: relative output error of the renormalised selection, at the end of the metric axis.
TRUNCATION_NAMES: tuple[str, ...] = METRIC_NAMES[len(Separability._fields):]


def distances(
    alpha: Float[Tensor, "*abatch key"],
    values: Float[Tensor, "*vbatch key d"],
    selected: Bool[Tensor, "*sbatch key"],
    distance: Distance = "euclidean",
    duplicates: Int[Tensor, "*vbatch key"] | None = None,
) -> Float[Tensor, "*batch key"]:
    """``D_i = d(α_i v_i, s)`` for every key, with ``s = Σ_{k∈S} α_k v_k`` (SPEC §3).

    Euclidean: ``D_i² = α_i²‖v_i‖² − 2α_i⟨v_i, s⟩ + ‖s‖²``. Cosine:
    ``D_i = 1 − α_i⟨v_i, s⟩ / (α_i‖v_i‖ ‖s‖ + η)``. In :data:`COMPUTE_DTYPE`.

    Keys with bit-identical ``α`` and ``v`` get bit-identical ``D`` (exact ties), using
    ``duplicates`` (:func:`first_duplicate` of ``values``; computed here when not given).
    """
    alpha, values = as_compute(alpha), as_compute(values)
    if duplicates is None:
        duplicates = first_duplicate(values)
    sq_norm_s, dots = value_dots(alpha * selected, values)
    sq_norm_v = (values * values).sum(-1)
    identity = torch.arange(values.shape[-2], device=duplicates.device).expand_as(duplicates)
    if not torch.equal(duplicates, identity):
        sq_norm_v = sq_norm_v.gather(-1, duplicates)
        index = duplicates.reshape((1,) * (dots.ndim - duplicates.ndim) + duplicates.shape)
        dots = dots.gather(-1, index.expand(dots.shape))
    if distance == "euclidean":
        sq = (alpha * alpha) * sq_norm_v - 2 * alpha * dots + sq_norm_s.unsqueeze(-1)
        return sq.clamp_min(0).sqrt()
    if distance == "cosine":
        norm_y = alpha * sq_norm_v.sqrt()
        norm_s = sq_norm_s.sqrt().unsqueeze(-1)
        return 1 - alpha * dots / (norm_y * norm_s + COSINE_EPS)
    raise ValueError(f"distance must be 'euclidean' or 'cosine', got {distance!r}.")


def scores_from_energies(
    energy: Float[Tensor, "*dbatch key"],
    selected: Bool[Tensor, "*sbatch key"],
    key_mask: Bool[Tensor, "*mbatch key"],
    n: Tensor,
) -> tuple[Separability, Tensor, Tensor]:
    """SPEC §3's figures of one selection per row (``n`` keys each) from any per-key ``energy``
    that orders the keys as their distances ``D`` do: ``D`` itself, the cosine distance, or the
    engine's Euclidean ``E = D² − ‖s‖²``.

    Every figure but the margin reads only that order. Returns the scores, the smallest energy
    outside the selection and the largest inside it; ``scores.margin`` is their difference, in
    the energy's units. Rows with ``n`` outside ``1 ≤ n < |T_t|`` are NaN.
    """
    energy, selected, key_mask = torch.broadcast_tensors(energy, selected, key_mask)
    unselected = key_mask & ~selected
    high_in = torch.where(selected, energy, -torch.inf).amax(-1)
    low_out = torch.where(unselected, energy, torch.inf).amin(-1)
    # Written as "not above the largest selected energy" so that a NaN counts against precision.
    contaminating = (unselected & ~(energy > high_in.unsqueeze(-1))).sum(-1)
    recalled = (selected & (energy < low_out.unsqueeze(-1))).sum(-1)
    n = n.to(COMPUTE_DTYPE)
    precision = n / (n + contaminating)
    recall = recalled / n
    f_score = torch.where(recall > 0, 2 * precision * recall / (precision + recall), 0.0)
    # GInv = Σ_{i∈S} |{j∉S : D_j ≤ D_i}|: count by binary search in the sorted unselected D.
    sorted_unselected = torch.where(unselected, energy, torch.inf).sort(-1).values
    probes = torch.where(selected, energy, -torch.inf).contiguous()
    below = torch.searchsorted(sorted_unselected, probes, right=True)
    inversions = (below * selected).sum(-1).to(COMPUTE_DTYPE)
    n_keys = key_mask.sum(-1)
    defined = (n >= 1) & (n < n_keys)
    floor = n / n_keys.to(COMPUTE_DTYPE)  # P* and F*, chance-corrected (ours)
    precision_cc = (precision - floor) / (1 - floor)
    f_cc = torch.where((precision_cc > 0) & (recall > 0),
                       2 * precision_cc * recall / (precision_cc + recall), 0.0)
    f_score_cc = torch.where(torch.isnan(precision_cc), torch.nan, f_cc)
    nan = torch.tensor(torch.nan, dtype=COMPUTE_DTYPE, device=energy.device)
    scores = Separability(*(torch.where(defined, x, nan) for x in (
        precision, recall, f_score, low_out - high_in, inversions, precision_cc, f_score_cc)))
    return scores, low_out, high_in


def check_int(value: object, name: str) -> None:
    """``TypeError`` unless ``value`` is an int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")


def check_rows(alpha: Tensor, values: Tensor, n: int) -> None:
    """The argument checks every row-wise scorer shares (``separability``, ``shell_bounds``,
    ``truncation``)."""
    check_int(n, "n")
    if alpha.ndim < 1 or values.ndim < 2 or values.shape[-2] != alpha.shape[-1]:
        raise ValueError(
            f"alpha must be [..., key] and values [..., key, d] with the same number of keys; "
            f"got alpha {tuple(alpha.shape)} and values {tuple(values.shape)}."
        )
    if not (alpha.is_floating_point() and values.is_floating_point()):
        raise TypeError("alpha and values must be floating-point tensors.")


def check_selection(
    alpha: Tensor, n: int, key_mask: Tensor | None, selected: Tensor | None,
    inside_mask: bool = True,
) -> tuple[Tensor, Tensor]:
    """``(key_mask, selected)``: all keys valid by default, the top-``n`` set by default; a given
    selection must be bool, hold ``n`` valid keys wherever ``n`` is in range and, with
    ``inside_mask``, no invalid key."""
    if key_mask is None:
        key_mask = torch.ones(alpha.shape, dtype=torch.bool, device=alpha.device)
    elif key_mask.dtype != torch.bool:
        raise TypeError(f"key_mask must be a bool tensor (True = valid key), got {key_mask.dtype}.")
    if selected is None:
        return key_mask, top_n_mask(alpha, n, key_mask)
    if selected.dtype != torch.bool:
        raise TypeError(f"selected must be a bool tensor, got {selected.dtype}.")
    if inside_mask and (selected & ~key_mask).any():
        raise ValueError("selected contains keys that key_mask marks invalid.")
    in_range = (n >= 1) & (n < key_mask.sum(-1))
    if (in_range & ((selected & key_mask).sum(-1) != n)).any():
        keys = "keys" if inside_mask else "valid keys"
        raise ValueError(f"selected must hold exactly n={n} {keys} in every row where n is in range.")
    return key_mask, selected


def separability(
    alpha: Float[Tensor, "*abatch key"],
    values: Float[Tensor, "*vbatch key d"],
    n: int,
    *,
    key_mask: Bool[Tensor, "*mbatch key"] | None = None,
    selected: Bool[Tensor, "*sbatch key"] | None = None,
    distance: Distance = "euclidean",
) -> Separability:
    """Geometric separability of the top-``n`` keys (or of ``selected``) of each row (SPEC §3).

    Args:
        alpha: attention rows ``[..., key]``.
        values: raw value vectors ``[..., key, d]`` (``y = α·v`` is formed inside). Leading
            dimensions broadcast against ``alpha``'s, so one ``[key, d]`` block can serve many
            queries without being copied.
        n: selection size ``N``.
        key_mask: True for keys that exist for the row (causal and not padding); default all.
        selected: score this selection instead of the top-``n`` set; it must hold ``n`` valid
            keys in every row where ``n`` is in range.
        distance: ``"euclidean"`` (default) or ``"cosine"``.

    Returns:
        :class:`Separability` with ``precision, recall, f_score, margin, inversions,
        precision_cc, f_score_cc``, each of
        shape ``[...]`` in float64; NaN where ``n`` is outside ``1 ≤ n < |valid keys|``.

    Examples:
        >>> alpha = torch.tensor([0.1, 0.6, 0.3])
        >>> values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
        >>> separability(alpha, values, 2).precision.item()
        1.0
    """
    check_rows(alpha, values, n)
    key_mask, selected = check_selection(alpha, n, key_mask, selected)
    dist = distances(alpha, values, selected, distance)
    n_rows = torch.full(dist.shape[:-1], float(n), dtype=COMPUTE_DTYPE, device=dist.device)
    return scores_from_energies(dist, selected, key_mask, n_rows)[0]
