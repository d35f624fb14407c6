"""Uncertainty of loss changes over windows, and a set of heads against random sets (SPEC §7, ours).

Pure arithmetic: tensors (or floats) in, tensors (or floats) out. The input checks raise a
``ValueError`` that names the argument, its value and the fix, rather than return a number from
nonsense or let torch fail inside.
"""

from __future__ import annotations

import math
import numbers

import torch
from jaxtyping import Bool, Float
from torch import Tensor

#: SPEC §7: a critical head raises the loss by at least this many nats ...
CRITICAL_MIN_NATS = 0.1
#: ... or by this fraction of the dense (unablated) loss, whichever is larger ...
CRITICAL_MIN_FRACTION = 0.05
#: ... with the whole interval of the increase at this level above that threshold.
CRITICAL_LEVEL = 0.95
#: The outcomes of :func:`criticality`, in its codes' order (0, 1, 2).
CRITICALITY = ("not critical", "undecided", "critical")


def check_window_weight(weight: object, n_windows: int, name: str = "weight") -> None:
    """Refuse ``weight`` unless it is one finite, non-negative prediction count per window (a 1-D
    tensor of ``n_windows`` entries) with a positive total (else the weighted mean is no loss)."""
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1:
        shape = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{name} must be a 1-D tensor with one prediction count per window, got "
                         f"{shape}. Pass the per-window counts, e.g. window_losses(...).weight.")
    if len(weight) != n_windows:
        raise ValueError(f"{name} has {len(weight)} entries but the losses have {n_windows} windows "
                         "(their last axis): pass one prediction count per window, in the losses' "
                         "window order.")
    w = weight.double()
    bad = ~(torch.isfinite(w) & (w >= 0))
    if bad.any():
        at = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name} must hold each window's number of valid predictions, finite and "
                         f"≥ 0, got {w[at].item()!r} at window {at}. Pass the prediction counts "
                         "(e.g. window_losses(...).weight), not losses or signed weights.")
    if not w.sum() > 0:
        raise ValueError(f"{name} sums to 0: no window has a valid prediction, so no loss is "
                         "defined. Pass windows with at least one next-token prediction (≥ 2 "
                         "real tokens each).")


def check_window_indices(windows: object, n_windows: int, name: str = "windows") -> torch.Tensor:
    """``windows`` (a tensor or a sequence of ints) as a 1-D integer tensor of indices into
    ``n_windows`` windows: one bootstrap resample, repeats allowed, not empty. Refused: a batch
    of resamples, float or bool indices, and indices outside ``0 … n_windows − 1``."""
    if not isinstance(windows, torch.Tensor):
        try:
            windows = torch.as_tensor(windows)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{name} must be a 1-D tensor of window indices, got "
                             f"{type(windows).__name__}: pass e.g. torch.tensor([0, 2, 2]).") from None
    if windows.ndim != 1:
        raise ValueError(f"{name} must be 1-D (the window indices of one resample), got shape "
                         f"{list(windows.shape)}: pass one resample at a time (one row of a "
                         "[resample, k] draw), and loop over the rows.")
    if windows.dtype == torch.bool or windows.is_floating_point() or windows.is_complex():
        hint = ("a bool mask: pass mask.nonzero().flatten() for its indices" if windows.dtype == torch.bool
                else f"pass integer indices, e.g. {name}.long() of whole numbers or torch.randint(0, n, (n,))")
        raise ValueError(f"{name} must hold integer window indices, got dtype {windows.dtype}: {hint}.")
    if windows.numel() == 0:
        raise ValueError(f"{name} is empty: a resample needs at least one window index.")
    low, high = int(windows.min()), int(windows.max())
    if low < 0 or high >= n_windows:
        raise ValueError(f"{name} holds index {low if low < 0 else high}, outside 0 … {n_windows - 1} "
                         f"(there are {n_windows} windows): pass indices into the windows, "
                         f"0 ≤ i < {n_windows}.")
    return windows


def window_mean(
    loss: Float[Tensor, "*set window"], weight: Float[Tensor, " window"], windows: Tensor | None = None,
) -> Float[Tensor, "*set"]:
    """``Σ_b w_b L_b / Σ_b w_b`` over the windows ``windows`` (a 1-D tensor of indices into the
    last axis, repeats counted again: one bootstrap resample, SPEC §8; default all windows), with
    ``w_b`` window ``b``'s number of valid predictions: on all windows, the loss over every
    prediction of the batch. A window without predictions (``w_b = 0``, its loss NaN) adds
    nothing; NaN for a resample that draws only such windows. Inputs are checked by
    :func:`check_window_weight` and :func:`check_window_indices`.

    >>> window_mean(torch.tensor([2.0, 4.0]), torch.tensor([1.0, 3.0])).item()
    3.5
    >>> window_mean(torch.tensor([2.0, 4.0]), torch.tensor([1.0, 3.0]), torch.tensor([0, 0])).item()
    2.0
    """
    if not isinstance(loss, torch.Tensor) or loss.ndim == 0:
        raise ValueError("loss must be a tensor whose last axis is the windows ([..., window]).")
    check_window_weight(weight, loss.shape[-1])
    if windows is not None:
        windows = check_window_indices(windows, loss.shape[-1]).to(weight.device)
        loss, weight = loss[..., windows], weight[windows]
    w = weight.double()
    # where, not a product: a window without predictions has a NaN loss, and NaN · 0 is NaN.
    return torch.where(w > 0, loss.double() * w, 0.0).sum(-1) / w.sum()


def paired_window_se(
    difference: Float[Tensor, "*set window"], weight: Float[Tensor, " window"]
) -> Float[Tensor, "*set"]:
    """Standard error of a loss change over windows, from its per-window changes (ours).

    The change ``Δ = Σ_b w_b d_b / Σ_b w_b`` of a loss weighted by the windows' prediction counts
    ``w_b`` (``d_b``: ablated minus dense on window ``b``, so paired) has the standard error of a
    weighted mean over the ``n`` windows with ``w_b > 0``:

        ``SE = sqrt( n/(n−1) · Σ_b w_b² (d_b − Δ)² ) / Σ_b w_b``

    With equal weights (windows of one length, no padding) this is ``sd(d) / sqrt(n)``
    (sample sd, ``n − 1``). Windows with ``w_b = 0`` (no valid prediction) are left out; NaN
    with a single such window (no spread to estimate), and where a used ``d_b`` is NaN.

    >>> paired_window_se(torch.tensor([1.0, 2.0, 3.0]), torch.ones(3))   # sd 1, n 3
    tensor(0.5774, dtype=torch.float64)
    """
    if not isinstance(difference, torch.Tensor) or difference.ndim == 0:
        raise ValueError("difference must be a tensor whose last axis is the windows ([..., window]).")
    check_window_weight(weight, difference.shape[-1])
    d, w = difference.double(), weight.double().to(difference.device)
    used = w > 0
    n = int(used.sum())
    if n < 2:
        return torch.full(d.shape[:-1], math.nan, dtype=torch.float64, device=d.device)
    w = torch.where(used, w, 0.0)
    d = torch.where(used, d, 0.0)  # an unused window's NaN loss must not reach the sums
    total = w.sum()
    mean = (w * d).sum(-1, keepdim=True) / total
    spread = (w.square() * (d - mean).square()).sum(-1)
    return (n / (n - 1) * spread).sqrt() / total


def _t_two_sided(t: float, df: int) -> float:
    """``P(|T| < t)`` for Student's t with an integer ``df`` ≥ 1 (Abramowitz & Stegun 26.7.3-4:
    exact finite sums in ``θ = atan(t / sqrt(df))``)."""
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df == 1:
        return 2 * theta / math.pi
    odd = df % 2
    term, total = 1.0, 1.0
    for k in range(1, (df - odd) // 2):  # even df: ratios (2k−1)/(2k); odd df: (2k)/(2k+1)
        term *= c2 * (2 * k - 1 + odd) / (2 * k + odd)
        total += term
    return 2 / math.pi * (theta + s * math.cos(theta) * total) if odd else s * total


def t_quantile(level: float, df: int) -> float:
    """The two-sided Student-t critical value: ``t`` with ``P(|T_df| < t) = level``.

    ``df = n − 1`` for a mean over ``n`` windows; exact for every integer ``df`` (bisection on
    the closed-form distribution function; beyond ``df = 1000`` within 1e-9 relative).
    ``t_quantile(0.95, 3) ≈ 3.182``, ``t_quantile(0.95, 30) ≈ 2.042``; NaN for ``df < 1``.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95, got {level!r}.")
    if df < 1:
        return math.nan
    if df > 1000:  # Cornish–Fisher, A&S 26.7.5 to df⁻³: the normal z alone is 0.1–0.2 % low here
        z = float(torch.special.ndtri(torch.tensor(0.5 + level / 2, dtype=torch.float64)))
        z2 = z * z
        g1 = (z2 + 1) * z / 4
        g2 = ((5 * z2 + 16) * z2 + 3) * z / 96
        g3 = (((3 * z2 + 19) * z2 + 17) * z2 - 15) * z / 384
        return z + g1 / df + g2 / df**2 + g3 / df**3
    low, high = 0.0, 1.0
    while _t_two_sided(high, df) < level:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        if _t_two_sided(mid, df) < level:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * high:
            break
    return (low + high) / 2


def confidence_interval(
    estimate: Float[Tensor, "*set"], se: Float[Tensor, "*set"], n_windows: int,
    level: float = CRITICAL_LEVEL,
) -> tuple[Float[Tensor, "*set"], Float[Tensor, "*set"]]:
    """``estimate ∓ t_{level, n−1} · se``: the Student-t interval of a mean over ``n_windows``
    windows (ours; with ≥ 30 windows it is within 4 % of ``± 1.96 se``). NaN where ``se`` is."""
    half = t_quantile(level, n_windows - 1) * se.double()
    return estimate.double() - half, estimate.double() + half


def check_thresholds(min_nats: object, min_fraction: object) -> None:
    """Refuse a threshold of SPEC §7's critical rule that is not a finite number ≥ 0 (with a
    negative one nearly every head is critical, with NaN or infinity none is)."""
    for name, value, default in (("min_nats", min_nats, CRITICAL_MIN_NATS),
                                 ("min_fraction", min_fraction, CRITICAL_MIN_FRACTION)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                math.isfinite(value) and float(value) >= 0):
            raise ValueError(f"{name} must be a number ≥ 0, not NaN or infinite; got {value!r}. "
                             f"Pass e.g. {name}={default} (the default, SPEC §7).")


def critical_threshold(dense_loss: float, min_nats: float = CRITICAL_MIN_NATS,
                       min_fraction: float = CRITICAL_MIN_FRACTION) -> float:
    """``max(min_nats, min_fraction · dense_loss)``: the smallest loss increase that can make a
    head critical (SPEC §7: 0.1 nats or 5 % of the dense loss, whichever is larger), thresholds
    checked by :func:`check_thresholds`."""
    check_thresholds(min_nats, min_fraction)
    return max(min_nats, min_fraction * dense_loss)


def criticality(
    low: Float[Tensor, "*head"], high: Float[Tensor, "*head"], dense_loss: float,
    min_nats: float = CRITICAL_MIN_NATS, min_fraction: float = CRITICAL_MIN_FRACTION,
) -> Float[Tensor, "*head"]:
    """SPEC §7's outcome per head from the interval ``[low, high]`` of its loss increase, with
    ``c = max(min_nats, min_fraction · dense_loss)``: 2 (critical) where ``low ≥ c``, 0 (not
    critical) where ``high < c``, 1 (undecided) otherwise; NaN where the interval is (an unscored
    head, or no standard error). Names: :data:`CRITICALITY`.

    >>> criticality(torch.tensor([0.3, 0.0, 0.05]), torch.tensor([0.5, 0.05, 0.4]), 4.0).tolist()
    [2.0, 0.0, 1.0]
    """
    threshold = critical_threshold(dense_loss, min_nats, min_fraction)
    low, high = low.double(), high.double()
    code = torch.where(low >= threshold, 2.0, torch.where(high < threshold, 0.0, 1.0))
    return torch.where(low.isnan() | high.isnan(), torch.nan, code)


def critical_mask(
    low: Float[Tensor, "*head"], dense_loss: float,
    min_nats: float = CRITICAL_MIN_NATS, min_fraction: float = CRITICAL_MIN_FRACTION,
) -> Bool[Tensor, "*head"]:
    """SPEC §7's critical heads: the lower end ``low`` of the loss increase's interval is at
    least ``max(min_nats, min_fraction · dense_loss)`` (a large effect, beyond noise). NaN (an
    unscored head, or no standard error) is never critical."""
    return low.double() >= critical_threshold(dense_loss, min_nats, min_fraction)


def null_z(observed: float, null: Float[Tensor, " sample"]) -> tuple[float, float, float]:
    """``(mean, sd, z)`` of ``observed`` against a null sample: the null's mean, its sample sd
    (``n − 1``) and ``z = (observed − mean) / sd``. ``sd`` is NaN for fewer than 2 samples and
    ``z`` NaN where ``sd`` is NaN or 0."""
    x = null.double().flatten()
    x = x[~x.isnan()]
    mean = float(x.mean()) if x.numel() else math.nan
    sd = float(x.std(correction=1)) if x.numel() >= 2 else math.nan
    z = (observed - mean) / sd if sd > 0 else math.nan
    return mean, sd, z


def empirical_p(observed: float, null: Float[Tensor, " sample"]) -> float:
    """One-sided empirical p-value ``(1 + #{null ≥ observed}) / (1 + n)`` (never 0: the observed
    set counts as one draw of the null). NaN samples are left out; NaN for a NaN ``observed``."""
    x = null.double().flatten()
    x = x[~x.isnan()]
    if math.isnan(observed):
        return math.nan
    return (1 + int((x >= observed).sum())) / (1 + x.numel())
