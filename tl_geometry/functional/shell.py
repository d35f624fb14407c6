"""The shell certificate: lower bounds on P_N, R_N, F_N from a few exact distances (SPEC §6d).

For one query with valid keys ``T_t``, a selection ``S`` of size ``N``, contributions
``y_j = α_j v_j`` with norms ``a_j = ‖y_j‖`` and aggregate ``s = Σ_{i∈S} y_i``::

    L_j  = | ‖s‖ − a_j |                      reverse triangle inequality: D_j ≥ L_j
    E    = S ∪ (the K unselected keys with the smallest L_j; ties → lower index)
    D̲_j = D_j for j ∈ E,   D̲_j = L_j for j ∉ E
    P̲ = N / (N + |{j∉S : D̲_j ≤ max_S D}|)      R̲ = |{i∈S : D_i < min_{j∉S} D̲_j}| / N
    F̲ = harmonic mean of P̲, R̲

``K = 0`` reads the exact geometry of the selection and one norm per other key; ``K = T − N``
is exact (equal to :func:`~tl_geometry.functional.separability`). Only the ``N + K`` vectors of
``E`` are gathered per row, so a row costs ``O((N + K)·d + T)``.

Every comparison is made in the "E-form", free of the cancellation in ``D² = ‖y‖² − 2⟨y, s⟩ +
‖s‖²``: for exact keys ``E_j = α_j(α_j‖v_j‖² − 2⟨v_j, s⟩) = D_j² − ‖s‖²``, and for the others
``Λ_j = a_j(a_j − 2‖s‖) = L_j² − ‖s‖² ≤ E_j``. Comparing ``L_j`` with a distance ``D ≥ 0`` is
comparing their squares (both sides are ≥ 0), hence ``Λ_j`` with ``E``. ``Λ_j`` is lowered by a
relative hair (:data:`SLACK`) so that rounding can never lift it above the ``E_j`` it bounds
(for instance a duplicate of a selected key, where ``D_j = L_j`` exactly): the certificate
stays sound in floating point, at the price of counting an exact tie with ``L_j`` as
contamination.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from .bounds import Bounds, extreme_over, harmonic_mean
from .dtypes import COMPUTE_DTYPE, as_compute
from .heads import broadcast_shapes
from .selection import top_n_ranks
from .separability import check_int, check_rows, check_selection

#: Relative amount by which the norm-only quantity ``Λ_j`` is lowered, times ``(a_j + ‖s‖)²``:
#: far above float64 rounding of a d ≤ 10⁴ dot product, far below any real separation.
SLACK = 1e-10


def _first(mask: Bool[Tensor, "*batch key"], m: int) -> tuple[Tensor, Tensor]:
    """Indices of the first ``m`` True keys of every row (in index order) and whether each
    gathered slot really is True (rows with fewer than ``m`` keys are padded)."""
    order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices[..., :m]
    return order, mask.gather(-1, order)


def shell_bounds(
    alpha: Float[Tensor, "*abatch key"],
    values: Float[Tensor, "*vbatch key d"],
    n: int,
    *,
    k: int = 0,
    key_mask: Bool[Tensor, "*mbatch key"] | None = None,
    selected: Bool[Tensor, "*sbatch key"] | None = None,
) -> Bounds:
    """Shell certificate (SPEC §6d): sound lower bounds on Euclidean ``P_N, R_N, F_N`` per row.

    Arguments as :func:`~tl_geometry.functional.separability`'s, plus ``k``: the budget ``K``
    of unselected keys whose distance is computed exactly (``k ≥ T − N`` gives the exact P, R,
    F). Each bound is float64 ``[...]``, never above separability's value; NaN where ``n`` is
    outside ``1 ≤ n < |valid keys|``.

    >>> alpha = torch.tensor([0.1, 0.6, 0.3])
    >>> values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    >>> shell_bounds(alpha, values, 2).precision.item()    # ‖s‖ = 0.9, a_0 = 0.1: L_0 = 0.8
    1.0
    """
    check_rows(alpha, values, n)
    check_int(k, "k")
    if k < 0:
        raise ValueError(f"k (the number of unselected keys measured exactly) must be ≥ 0, "
                         f"got {k}.")
    key_mask, selected = check_selection(alpha, n, key_mask, selected)
    in_range = (n >= 1) & (n < key_mask.sum(-1))

    n_key, d = values.shape[-2:]
    rows = broadcast_shapes(
        broadcast_shapes(tuple(alpha.shape[:-1]), tuple(values.shape[:-2])),
        broadcast_shapes(tuple(key_mask.shape[:-1]), tuple(selected.shape[:-1])),
    )
    alpha = as_compute(alpha).expand(*rows, n_key)
    values = as_compute(values)
    key_mask, selected = key_mask.expand(*rows, n_key), selected.expand(*rows, n_key)
    # A stride-0 view: gathering from it reads only the gathered rows, never a [*rows, key, d] copy.
    expanded = values.expand(*rows, n_key, d)

    def gather(index: Tensor) -> tuple[Tensor, Tensor]:  # α and v of the keys ``index`` per row
        vectors = expanded.gather(-2, index.unsqueeze(-1).expand(*index.shape, d))
        return alpha.gather(-1, index), vectors

    m_sel = max(0, min(n, n_key))
    sel_index, sel_ok = _first(selected, m_sel)
    a_sel, v_sel = gather(sel_index)
    s = ((a_sel * sel_ok).unsqueeze(-1) * v_sel).sum(-2)  # [*rows, d]
    norm_s = torch.linalg.vector_norm(s, dim=-1).unsqueeze(-1)

    # Norm-only side: a_j = |α_j|·‖v_j‖, one norm per distinct value row.
    a = alpha.abs() * torch.linalg.vector_norm(values, dim=-1)
    unselected = key_mask & ~selected
    shell = (norm_s - a).abs()  # L_j
    extra = unselected & (top_n_ranks(-shell, unselected) < k)  # the K nearest shells, ties → lower
    lam = a * (a - 2 * norm_s) - SLACK * (a + norm_s) ** 2  # Λ_j = L_j² − ‖s‖², lowered a hair

    # Exact side: E_j for the selection and the K extra keys, one gather of N + K vectors per row.
    ext_index, ext_ok = _first(extra, max(0, min(k, n_key)))
    index = torch.cat([sel_index, ext_index], dim=-1)
    a_e, v_e = gather(index)
    # Elementwise products summed over d: bit-identical keys (duplicates) get bit-identical E.
    e = a_e * (a_e * (v_e * v_e).sum(-1) - 2 * (v_e * s.unsqueeze(-2)).sum(-1))
    e_sel, e_ext = e[..., :m_sel], e[..., m_sel:]

    e_max = extreme_over(e_sel, sel_ok, "max").unsqueeze(-1)  # ρ_max² − ‖s‖²
    only_norm = unselected & ~extra
    # "not farther than ρ_max": NaN counts against precision, as in separability.
    contaminating = (ext_ok & ~(e_ext > e_max)).sum(-1) + (only_norm & ~(lam > e_max)).sum(-1)
    lower_min = torch.minimum(extreme_over(e_ext, ext_ok, "min"), extreme_over(lam, only_norm, "min"))
    recalled = (sel_ok & (e_sel < lower_min.unsqueeze(-1))).sum(-1)

    n_t = torch.tensor(float(n), dtype=COMPUTE_DTYPE, device=alpha.device)
    precision = n_t / (n_t + contaminating)
    recall = recalled / n_t
    nan = torch.tensor(torch.nan, dtype=COMPUTE_DTYPE, device=alpha.device)
    precision, recall = (torch.where(in_range.expand(rows), x, nan) for x in (precision, recall))
    return Bounds(precision, recall, harmonic_mean(precision, recall))
