"""The shell certificate of the top-N sets of a block of queries, for every N (SPEC §6d).

The engine's form of :func:`tl_geometry.functional.shell_bounds`, same definition, same numbers:
per row (query head, query) and N, with ``a_j = α_j‖v_j‖`` and ``s = Σ_{i∈S_N} α_i v_i``::

    L_j = | ‖s‖ − a_j |                          (D_j ≥ L_j, reverse triangle inequality)
    E   = S_N ∪ (the K unselected keys with the smallest L_j; ties → lower index)
    P̲ = N / (N + |{j∉S : D̲_j ≤ ρ_max}|)       R̲ = |{i∈S : D_i < min_{j∉S} D̲_j}| / N

for ``K = 0`` (norm-only) and ``K = N`` at once, in the E-form of §6d
(``E_j = α_j(α_j‖v_j‖² − 2⟨v_j, s⟩) = D_j² − ‖s‖²`` for exact keys, ``Λ_j = L_j² − ‖s‖²``
lowered by :data:`~tl_geometry.functional.shell.SLACK` for the others). The ranks, the key order
(its first N keys are ``S_N``), ``α`` and ``‖v‖²`` are computed once per block; per N, one stable
sort of the ``L_j`` picks the ``K = N`` extra keys. ``⟨v_j, s⟩`` is an elementwise product summed
over ``d``, so bit-identical keys get bit-identical E and exact ties stay exact. Queries are
taken in sub-blocks whose temporaries stay under :data:`SHELL_ELEMENTS` elements.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..functional.bounds import extreme_over, harmonic_mean
from ..functional.dtypes import COMPUTE_DTYPE
from ..functional.selection import inverse_permutation
from ..functional.shell import SLACK

#: Elements of one ``[row, key]`` or ``[row, 2N, d]`` temporary held at once.
SHELL_ELEMENTS = 1 << 21
#: The two budgets reported (SPEC §6d): ``K = 0`` and ``K = N``.
SHELL_KINDS = ("shell", "shell_n")


def shell_block(
    alpha: Float[Tensor, "group rep query key"],
    key_mask: Bool[Tensor, "query key"],
    ranks: Int[Tensor, "group rep query key"],
    values: Float[Tensor, "group key d"],
    n_values: list[int],
) -> Float[Tensor, "group rep query kind n 3"]:
    """Shell lower bounds ``(P̲, R̲, F̲)`` for ``K = 0`` and ``K = N`` (``kind``), every N, NaN
    where N is outside ``1 ≤ N < |valid keys|``. ``alpha`` is 0 outside ``key_mask`` (query head
    ``(g, r)`` reads value group ``g``); ``ranks`` as SPEC §2 (``S_N`` = ranks < N)."""
    n_g, n_r, n_q, n_key = alpha.shape
    d = values.shape[-1]
    out = torch.full((n_g, n_r, n_q, len(SHELL_KINDS), len(n_values), 3), torch.nan,
                     dtype=COMPUTE_DTYPE, device=alpha.device)
    if n_q == 0:
        return out
    order = inverse_permutation(ranks)  # keys by rank: S_N = order[..., :N]
    norms = torch.linalg.vector_norm(values, dim=-1)  # [g, k]
    square = (values * values).sum(-1)  # ‖v‖², elementwise: duplicates stay bit-identical
    a = alpha.abs() * norms[:, None, None]  # a_j = ‖y_j‖, [g, r, q, k]
    valid_count = key_mask.sum(-1)  # [q]
    for i, n in enumerate(n_values):
        if not 1 <= n < n_key:
            continue  # no row holds N + 1 keys: NaN
        per_row = max(n_key * 4, 2 * n * d)
        step = max(1, SHELL_ELEMENTS // (n_g * n_r * per_row))
        for q0 in range(0, n_q, step):
            q = slice(q0, q0 + step)
            bound = _shell_n(alpha[:, :, q], key_mask[q], ranks[:, :, q], order[:, :, q], a[:, :, q],
                             values, square, n)
            in_range = (valid_count[q] > n)[None, None, :, None, None]
            out[:, :, q, :, i] = torch.where(in_range, bound, torch.nan)
    return out


def _shell_n(alpha: Tensor, key_mask: Tensor, ranks: Tensor, order: Tensor, a: Tensor,
             values: Tensor, square: Tensor, n: int) -> Tensor:
    """``[g, r, q, kind, (P, R, F)]`` of one N for one sub-block of queries."""
    n_g, n_r, n_q, n_key = alpha.shape
    d = values.shape[-1]
    # A stride-0 view: gathering from it reads only the gathered rows, never a [g, r, q, k, d] copy.
    grid = values[:, None, None].expand(n_g, n_r, n_q, n_key, d)
    sq = square[:, None, None].expand(n_g, n_r, n_q, n_key)

    def exact(index: Tensor, s: Tensor) -> Tensor:  # E_j = α_j(α_j‖v_j‖² − 2⟨v_j, s⟩) of keys ``index``
        v = grid.gather(-2, index.unsqueeze(-1).expand(*index.shape, d))
        a_e = alpha.gather(-1, index)
        return a_e * (a_e * sq.gather(-1, index) - 2 * (v * s.unsqueeze(-2)).sum(-1))

    sel_index = order[..., :n]
    v_sel = grid.gather(-2, sel_index.unsqueeze(-1).expand(*sel_index.shape, d))
    s = (alpha.gather(-1, sel_index).unsqueeze(-1) * v_sel).sum(-2)  # [g, r, q, d]
    del v_sel
    norm_s = torch.linalg.vector_norm(s, dim=-1).unsqueeze(-1)
    unselected = key_mask & (ranks >= n)
    shell = (norm_s - a).abs()  # L_j
    lam = a * (a - 2 * norm_s) - SLACK * (a + norm_s) ** 2  # Λ_j = L_j² − ‖s‖², lowered a hair
    e_sel = exact(sel_index, s)
    e_max = e_sel.amax(-1, keepdim=True)  # ρ_max² − ‖s‖² (every slot is selected in range)

    # K = 0: every unselected key by its norm alone.
    contaminating = [(unselected & ~(lam > e_max)).sum(-1)]
    lower_min = [extreme_over(lam, unselected, "min")]

    # K = N: the N unselected keys of smallest L_j (stable sort: ties → lower index) exactly.
    near = torch.sort(torch.where(unselected, shell, torch.inf), dim=-1, stable=True).indices[..., :n]
    near_ok = unselected.gather(-1, near)  # False for padding slots (fewer than N unselected)
    e_ext = exact(near, s)
    only_norm = unselected.scatter(-1, near, torch.zeros_like(near_ok))  # the rest: norms only
    contaminating.append((near_ok & ~(e_ext > e_max)).sum(-1) + (only_norm & ~(lam > e_max)).sum(-1))
    lower_min.append(torch.minimum(extreme_over(e_ext, near_ok, "min"), extreme_over(lam, only_norm, "min")))

    n_t = torch.tensor(float(n), dtype=COMPUTE_DTYPE, device=alpha.device)
    kinds = []
    for count, low in zip(contaminating, lower_min):
        recalled = (e_sel < low.unsqueeze(-1)).sum(-1)
        precision, recall = n_t / (n_t + count), recalled / n_t
        kinds.append(torch.stack([precision, recall, harmonic_mean(precision, recall)], dim=-1))
    return torch.stack(kinds, dim=-2)
