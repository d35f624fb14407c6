"""Deterministic lower bounds on geometric precision and recall (SPEC §3, §6).

Two families:

* **Inversion certificates** (SPEC §3, §6a), exact for any selection:
  ``P_N ≥ N / (N + GInv_N)`` and ``R_N ≥ max(0, 1 − GInv_N / N)``.
* **Sink-aware constant-norm regime bounds** (SPEC §6b, ours following the paper's
  assumptions; Euclidean distance). From an attention row and the regime parameters alone —
  non-sink norm ``ν`` with relative spread ``δ``, sink norm ``[κ⁻ν, κ⁺ν]``, non-sink coherence
  ``cos(v_k, v_l) ∈ [c⁻, c⁺]`` and sink coherence ``cos(v_sink, v_k) ∈ [σ⁻, σ⁺]`` — they bound
  every selected distance from above and every unselected one from below::

      UB(D_i)² = Σ_{k∈S∖i} (a_k⁺)² + Σ_{k≠l∈S∖i} max a_k a_l c_kl
      LB‖s‖²   = Σ_{k∈S} (a_k⁻)² + Σ_{k≠l∈S} min a_k a_l c_kl
      LB(D_j)  = max(LB‖s‖ − a_j⁺, sqrt(max(0, LB‖s‖² − 2 Σ_{k∈S} max a_j a_k c_jk + (a_j⁻)²)))
      R̲ = |{i∈S : UB(D_i) < min_{j∉S} LB(D_j)}| / N
      P̲ = N / (N + |{j∉S : LB(D_j) ≤ max_{i∈S} UB(D_i)}|)

  with ``a_k = α_k‖v_k‖ ∈ [a_k⁻, a_k⁺]``. Since ``a ≥ 0``, the extremes of ``a_k a_l c`` over
  the boxes are at corners: ``max = a⁺a⁺c⁺`` if ``c⁺ ≥ 0`` else ``a⁻a⁻c⁺``, and
  ``min = a⁻a⁻c⁻`` if ``c⁻ ≥ 0`` else ``a⁺a⁺c⁻``; the pair sums then factor through
  ``(Σ x)² − Σ x²``, so every bound costs O(key) per row.

With parameters that are the observed extremes of the data (``fit_regime(mode="certificate")``)
the bounds are certificates: the measured values can never fall below them. With robust
quantiles (``mode="predict"``) they are predicted envelopes.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .dtypes import COMPUTE_DTYPE, as_compute
from .separability import check_int, check_selection


class Bounds(NamedTuple):
    """Lower bounds on precision, recall and F-score, each of the rows' shape."""

    precision: Float[Tensor, "*batch"]
    recall: Float[Tensor, "*batch"]
    f_score: Float[Tensor, "*batch"]


def harmonic_mean(p: Tensor, r: Tensor) -> Tensor:
    """``F = 2PR / (P + R)`` elementwise, 0 where ``R = 0`` and NaN where either is NaN (the
    F-score of SPEC §3 from precision and recall, or of their bounds)."""
    f = torch.where(r > 0, 2 * p * r / (p + r), torch.zeros_like(p))
    return torch.where(torch.isnan(p) | torch.isnan(r), torch.nan, f)


def inversion_bounds(n: Tensor | int, inversions: Float[Tensor, "*batch"]) -> Bounds:
    """Inversion certificates ``P ≥ N/(N + GInv)``, ``R ≥ max(0, 1 − GInv/N)`` (SPEC §3); NaN
    where the inversions are (an undefined N).

    >>> inversion_bounds(2, torch.tensor([0.0, 1.0, 4.0])).recall.tolist()
    [1.0, 0.5, 0.0]
    """
    inversions = as_compute(inversions)
    n = torch.as_tensor(n, dtype=COMPUTE_DTYPE)
    precision = n / (n + inversions)
    recall = (1 - inversions / n).clamp_min(0)
    recall = torch.where(torch.isnan(inversions), inversions, recall)
    return Bounds(precision, recall, harmonic_mean(precision, recall))


class RegimeParams(NamedTuple):
    """Sink-aware constant-norm regime of one head (SPEC §6b), each field ``[*batch]``.

    Non-sink norms lie in ``[ν(1−δ), ν(1+δ)]``, the sink norm in ``[κ⁻ν, κ⁺ν]``; non-sink pair
    cosines in ``[c⁻, c⁺]``; sink-to-other cosines in ``[σ⁻, σ⁺]``.
    """

    nu: Float[Tensor, "*batch"]
    delta: Float[Tensor, "*batch"]
    kappa_lo: Float[Tensor, "*batch"]
    kappa_hi: Float[Tensor, "*batch"]
    c_lo: Float[Tensor, "*batch"]
    c_hi: Float[Tensor, "*batch"]
    sigma_lo: Float[Tensor, "*batch"]
    sigma_hi: Float[Tensor, "*batch"]


#: Relative widening of certificate intervals, for float64 round-off in the measured distances.
SLACK = 1e-9

#: Pairs of keys above which ``fit_regime`` samples cosines instead of using all of them.
MAX_PAIRS = 1 << 17

#: Elements of ``[key, key]`` Gram blocks (or sampled ``[pair, d]`` products) held at once;
#: heads are processed in groups under this budget, one at a time when a single block exceeds it.
PAIR_CHUNK = 1 << 22


class PairStats(NamedTuple):
    """Cosines of a head's key pairs and what the regime needs besides (see :func:`pair_stats`)."""

    cos: Float[Tensor, "*batch pair"]
    pair_ok: Bool[Tensor, "*batch pair"]
    lag: Float[Tensor, " pair"]
    sink_cos: Float[Tensor, "*batch key"]
    not_sink: Bool[Tensor, "*batch key"]
    norms: Float[Tensor, "*batch key"]
    sink_norm: Float[Tensor, "*batch"]


def pair_stats(
    values: Float[Tensor, "*batch key d"],
    sink: Int[Tensor, "*ibatch"] | int,
    key_mask: Bool[Tensor, "*mbatch key"] | None = None,
    generator: torch.Generator | None = None,
) -> PairStats:
    """Cosines of the non-sink key pairs and of the sink to every key, per head: all ``i < j``
    pairs up to :data:`MAX_PAIRS`, else MAX_PAIRS pairs drawn uniformly (``i ≠ j``, with
    replacement) from ``generator`` (default: seed 0). Cosines are exact (no η): a certificate's
    interval must contain the true ones."""
    values = as_compute(values)
    if key_mask is None:
        key_mask = torch.ones(values.shape[:-1], dtype=torch.bool, device=values.device)
    key_mask = key_mask.expand(values.shape[:-1])
    sink = torch.as_tensor(sink, device=values.device).expand(values.shape[:-2])
    n_key, d = values.shape[-2:]
    norms = torch.linalg.vector_norm(values, dim=-1)
    unit = values / norms.unsqueeze(-1).clamp_min(1e-300)
    keys = torch.arange(n_key, device=values.device)
    not_sink = key_mask & (keys != sink.unsqueeze(-1))
    sampled = n_key * (n_key - 1) // 2 > MAX_PAIRS
    if sampled:
        g = generator if generator is not None else torch.Generator().manual_seed(0)
        i = torch.randint(n_key, (MAX_PAIRS,), generator=g)
        j = (i + torch.randint(1, n_key, (MAX_PAIRS,), generator=g)) % n_key
    else:
        i, j = torch.triu_indices(n_key, n_key, offset=1, device=values.device)
    flat = unit.reshape(-1, n_key, d)
    # A head's whole Gram block is one fast matmul; gathering the sampled pairs' rows instead
    # reads 2·MAX_PAIRS·d floats, which is ~30× slower at T = 1024. Beyond the budget (very
    # long contexts, always sampled) the sampled rows are multiplied directly.
    by_gram = n_key * n_key <= PAIR_CHUNK
    per_head = n_key * n_key if by_gram else i.numel() * d
    step = max(1, PAIR_CHUNK // per_head)
    parts = []
    for lo in range(0, flat.shape[0], step):
        block = flat[lo : lo + step]
        if by_gram:
            parts.append((block @ block.transpose(-1, -2))[:, i, j])
        else:
            parts.append((block[:, i] * block[:, j]).sum(-1))
    cos = torch.cat(parts).reshape(*values.shape[:-2], i.numel()).clamp(-1, 1)
    sink_unit = unit.gather(-2, sink[..., None, None].expand(*sink.shape, 1, d))
    sink_cos = (unit * sink_unit).sum(-1).clamp(-1, 1)
    sink_norm = norms.gather(-1, sink.unsqueeze(-1)).squeeze(-1)
    pair_ok = not_sink[..., i] & not_sink[..., j]
    lag = (i - j).abs().to(COMPUTE_DTYPE)
    return PairStats(cos, pair_ok, lag, sink_cos, not_sink, norms, sink_norm)


def extreme_over(x: Tensor, ok: Tensor, which: str) -> Tensor:
    """Max (or min) of ``x`` over the ``ok`` entries of the last axis; ∓inf where there are none
    (also on an empty axis, a one-key sequence's pairs, where torch's reductions refuse)."""
    fill = -torch.inf if which == "max" else torch.inf
    if x.shape[-1] == 0:
        return torch.full(x.shape[:-1], fill, dtype=x.dtype, device=x.device)
    masked = torch.where(ok, x, fill)
    return masked.amax(-1) if which == "max" else masked.amin(-1)


def _masked_quantiles(x: Tensor, ok: Tensor, q: float) -> tuple[Tensor, Tensor]:
    """Quantiles ``q`` and ``1 − q`` of ``x`` over entries where ``ok`` (NaN where none), along
    the last dim (one sort for both)."""
    if x.shape[-1] == 0:
        nan = torch.full(x.shape[:-1], torch.nan, dtype=x.dtype, device=x.device)
        return nan, nan
    x = torch.where(ok, x, torch.nan)
    both = torch.nanquantile(x, torch.tensor([q, 1 - q], dtype=x.dtype, device=x.device), dim=-1)
    return both[0], both[1]


def fit_regime(
    values: Float[Tensor, "*batch key d"],
    sink: Int[Tensor, "*ibatch"] | int,
    key_mask: Bool[Tensor, "*mbatch key"] | None = None,
    *,
    mode: Literal["certificate", "predict"] = "certificate",
    quantile: float = 0.05,
    generator: torch.Generator | None = None,
) -> RegimeParams:
    """Regime parameters of SPEC §6b from a head's value vectors ``[*batch, key, d]``: the
    observed extremes over the valid keys (``"certificate"``) or their ``quantile`` and
    ``1 − quantile`` quantiles (``"predict"``). Beyond :data:`MAX_PAIRS` pairs are sampled, and
    a certificate from sampled extremes is an estimate (a warning says so).

    >>> v = torch.tensor([[0.1, 0.0], [1.0, 0.0], [0.0, 1.0]])
    >>> p = fit_regime(v, torch.tensor(0))
    >>> [round(float(x), 3) for x in (p.nu, p.delta, p.kappa_lo, p.c_hi, p.sigma_hi)]
    [1.0, 0.0, 0.1, 0.0, 1.0]
    """
    if mode not in ("certificate", "predict"):
        raise ValueError(f"mode must be 'certificate' or 'predict', got {mode!r}.")
    return params_from_pairs(pair_stats(values, sink, key_mask, generator), mode, quantile)


def params_from_pairs(
    stats: PairStats, mode: Literal["certificate", "predict"] = "certificate", quantile: float = 0.05
) -> RegimeParams:
    """:func:`fit_regime` from precomputed :class:`PairStats` (share them across modes)."""
    certificate = mode == "certificate"
    if certificate and stats.lag.numel() >= MAX_PAIRS:
        import warnings

        warnings.warn(
            f"Pair cosines are sampled ({MAX_PAIRS} pairs), so the certificate's coherence "
            "interval is estimated, not observed in full.",
            stacklevel=3,
        )
    samples = ((stats.norms, stats.not_sink), (stats.cos, stats.pair_ok),
               (stats.sink_cos, stats.not_sink))
    if certificate:
        (lo_n, hi_n), (c_lo, c_hi), (s_lo, s_hi) = (
            (extreme_over(x, ok, "min"), extreme_over(x, ok, "max")) for x, ok in samples
        )
        # Widen by float64 round-off so the bounds stay conservative.
        lo_n, hi_n = lo_n * (1 - SLACK), hi_n * (1 + SLACK)
        c_lo, c_hi, s_lo, s_hi = c_lo - SLACK, c_hi + SLACK, s_lo - SLACK, s_hi + SLACK
    else:
        (lo_n, hi_n), (c_lo, c_hi), (s_lo, s_hi) = (
            _masked_quantiles(x, ok, quantile) for x, ok in samples
        )
    nu = (lo_n + hi_n) / 2
    delta = torch.where(hi_n + lo_n > 0, (hi_n - lo_n) / (hi_n + lo_n), 0.0)
    # With every non-sink norm zero (ν = 0) κ is infinite; regime_bounds then reads the sink's
    # norm interval as [κ⁻ν, κ⁺ν] = NaN, which its comparisons treat conservatively.
    kappa = stats.sink_norm / nu
    kappa_lo, kappa_hi = (kappa * (1 - SLACK), kappa * (1 + SLACK)) if certificate else (kappa,) * 2
    # Without a second non-sink key there is no pair: any cosine is possible.
    c_lo, c_hi = torch.nan_to_num(c_lo, posinf=-1.0), torch.nan_to_num(c_hi, neginf=1.0)
    c_lo, c_hi = torch.where(c_lo > c_hi, -1.0, c_lo), torch.where(c_lo > c_hi, 1.0, c_hi)
    return RegimeParams(nu, delta, kappa_lo, kappa_hi, c_lo.clamp(-1, 1), c_hi.clamp(-1, 1),
                        s_lo.clamp(-1, 1), s_hi.clamp(-1, 1))


def regime_bounds(
    alpha: Float[Tensor, "*batch key"],
    params: RegimeParams,
    n: int,
    *,
    sink: Int[Tensor, "*ibatch"] | int = 0,
    key_mask: Bool[Tensor, "*mbatch key"] | None = None,
    selected: Bool[Tensor, "*sbatch key"] | None = None,
) -> Bounds:
    """Lower bounds P̲, R̲, F̲ of the top-``n`` set from ``α`` and the regime alone (SPEC §6b).

    ``params`` fields broadcast against the rows' leading dimensions (one regime per head).
    Euclidean distance only. NaN where ``n`` is outside ``1 ≤ n < |valid keys|``.

    >>> p = RegimeParams(*(torch.tensor(x) for x in (1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0)))
    >>> regime_bounds(torch.tensor([0.1, 0.6, 0.3]), p, 1).recall.item()  # orthogonal unit values
    1.0
    """
    alpha = as_compute(alpha)
    check_int(n, "n")
    key_mask, selected = check_selection(alpha, n, key_mask, selected, inside_mask=False)
    ub, lb_d, sel = _regime_distances(alpha, params, torch.as_tensor(sink, device=alpha.device),
                                      key_mask, selected)
    unsel = key_mask & ~sel
    max_ub = torch.where(sel, ub, -torch.inf).amax(-1, keepdim=True)
    min_lb = torch.where(unsel, lb_d, torch.inf).amin(-1, keepdim=True)
    n_t = torch.as_tensor(float(n), dtype=COMPUTE_DTYPE, device=alpha.device)
    # NaN (a degenerate regime) certifies nothing: it is never "below" and always "within".
    recall = (sel & (ub < min_lb)).sum(-1) / n_t
    contaminating = (unsel & ~(lb_d > max_ub)).sum(-1)
    precision = n_t / (n_t + contaminating)
    defined = (n_t >= 1) & (n_t < key_mask.sum(-1))
    nan = torch.tensor(torch.nan, dtype=COMPUTE_DTYPE, device=alpha.device)
    out = (precision, recall, harmonic_mean(precision, recall))
    return Bounds(*(torch.where(defined, x, nan) for x in out))


def _corner(c: Tensor, if_positive: Tensor, if_negative: Tensor) -> Tensor:
    """Per row, ``if_positive`` where ``c ≥ 0`` else ``if_negative`` (the corner rule, a ≥ 0)."""
    return torch.where(c >= 0, if_positive, if_negative)


def _pair_sum(weights: Tensor, scale: Tensor, members: Tensor, drop: Tensor | None, zero: Tensor) -> Tensor:
    """Σ_{k≠l ∈ members∖drop} scale·w_k w_l, per row (``drop`` leaves one key out per key)."""
    w = torch.where(members, weights, zero)
    total, squares = w.sum(-1, keepdim=True), (w * w).sum(-1, keepdim=True)
    if drop is not None:  # leave-one-out over the last axis
        total, squares = total - torch.where(drop, w, zero), squares - torch.where(drop, w * w, zero)
    return scale * (total * total - squares)


def _regime_distances(alpha: Tensor, params: RegimeParams, sink: Tensor, key_mask: Tensor,
                      selected: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``UB(D_i)`` of the selected keys, ``LB(D_j)`` of every key (SPEC §6b, module docstring)
    and the selected valid keys, from the intervals ``[a⁻, a⁺]`` of ``a_k = α_k‖v_k‖``."""
    p = RegimeParams(*(as_compute(x).unsqueeze(-1) for x in params))
    zero = torch.zeros((), dtype=COMPUTE_DTYPE, device=alpha.device)
    # Norm intervals from the regime (the sink: κν; the rest: ν(1 ± δ)) times α.
    is_sink = (torch.arange(alpha.shape[-1], device=alpha.device) == sink.unsqueeze(-1)) & key_mask
    a_lo = alpha * torch.where(is_sink, p.kappa_lo * p.nu, p.nu * (1 - p.delta))
    a_hi = alpha * torch.where(is_sink, p.kappa_hi * p.nu, p.nu * (1 + p.delta))
    sel = selected & key_mask
    sel_ns = sel & ~is_sink
    sink_sel = (sel & is_sink).any(-1, keepdim=True)
    # The sink's a interval as a per-row scalar, [..., 1].
    sink_a_lo = torch.where(is_sink, a_lo, zero).sum(-1, keepdim=True)
    sink_a_hi = torch.where(is_sink, a_hi, zero).sum(-1, keepdim=True)

    # UB(D_i) for selected i: sqrt(Σ_{S∖i}(a⁺)² + max pair terms over S∖i).
    sq_hi = torch.where(sel, a_hi * a_hi, zero)
    # i non-sink: drop i; i sink: none.
    ns_pairs = _pair_sum(_corner(p.c_hi, a_hi, a_lo), p.c_hi, sel_ns, sel_ns, zero)
    ws_ns = torch.where(sel_ns, _corner(p.sigma_hi, a_hi, a_lo), zero)
    sum_ws = ws_ns.sum(-1, keepdim=True) - torch.where(sel_ns, ws_ns, zero)  # S∖i non-sink
    sink_w = _corner(p.sigma_hi, sink_a_hi, sink_a_lo)
    sink_pairs = torch.where(sink_sel & ~is_sink, 2 * p.sigma_hi * sink_w * sum_ws, zero)
    ub = (sq_hi.sum(-1, keepdim=True) - sq_hi + ns_pairs + sink_pairs).clamp_min(0).sqrt()

    # LB‖s_N‖²: Σ_S (a⁻)² plus the smallest pair terms over S, [..., 1].
    w_ms = torch.where(sel_ns, _corner(p.sigma_lo, a_lo, a_hi), zero)
    sink_w_min = _corner(p.sigma_lo, sink_a_lo, sink_a_hi)
    # 2·σ·w_sink·Σ_{k∈S, non-sink} w_k, only when the sink is selected.
    sink_term = 2 * p.sigma_lo * sink_w_min * w_ms.sum(-1, keepdim=True)
    lb_s_sq = (
        torch.where(sel, a_lo * a_lo, zero).sum(-1, keepdim=True)
        + _pair_sum(_corner(p.c_lo, a_lo, a_hi), p.c_lo, sel_ns, None, zero)
        + torch.where(sink_sel, sink_term, zero)
    ).clamp_min(0)

    # LB(D_j) = max(LB‖s‖ − a_j⁺, sqrt(LB‖s‖² − 2 max⟨y_j, s⟩ + (a_j⁻)²)), where
    # max ⟨y_j, s⟩ ≤ Σ_{k∈S} max a_j a_k c_jk, for every unselected j.
    # j non-sink: non-sink partners with c⁺, the sink partner with σ⁺; j sink: all with σ⁺.
    ns_hi = a_hi * torch.where(sel_ns, a_hi, zero).sum(-1, keepdim=True)
    ns_lo = a_lo * torch.where(sel_ns, a_lo, zero).sum(-1, keepdim=True)
    cross_sink_partner = _corner(p.sigma_hi, a_hi * sink_a_hi, a_lo * sink_a_lo) * p.sigma_hi
    cross_j = torch.where(
        is_sink,
        _corner(p.sigma_hi, ns_hi, ns_lo) * p.sigma_hi,
        _corner(p.c_hi, ns_hi, ns_lo) * p.c_hi + torch.where(sink_sel, cross_sink_partner, zero),
    )
    lb_d = torch.maximum(
        lb_s_sq.sqrt() - a_hi,
        (lb_s_sq - 2 * cross_j + a_lo * a_lo).clamp_min(0).sqrt(),
    ).clamp_min(0)
    return ub, lb_d, sel
