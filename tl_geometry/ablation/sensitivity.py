"""Single-head sensitivity sweep and the critical-head rule (SPEC §7)."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..forward import hooks as _forward
from ..forward import losses as _losses
from ..functional.uncertainty import (
    CRITICAL_LEVEL,
    CRITICAL_MIN_FRACTION,
    CRITICAL_MIN_NATS,
    CRITICALITY,
    check_thresholds,
    confidence_interval,
    critical_mask,
    criticality,
    paired_window_se,
)
from .hooks import Mode
from .run import ablated_losses, positive_int, prepare_ablation

#: ``k`` of the robust-outlier flag (reported, not the critical rule): Iglewicz & Hoaglin's cut
#: on the modified z-score, ``0.6745 (x − median) / MAD > 3.5``.
CRITICAL_K = 3.5
_MAD_TO_SIGMA = 1.4826  # MAD × 1.4826 estimates σ for normal data


@dataclass
class HeadSensitivity:
    """Loss of the model with each head alone ablated, on one batch of tokens.

    ``loss[l, h]`` is the mean next-token cross-entropy with head ``(l, h)`` ablated (NaN for a
    head that was not scored); ``base_loss`` is the unablated loss, the model's own
    ``return_type="loss"``. ``window_loss[l, h, b]`` and ``base_window_loss[b]`` are the same
    losses on each window (sequence) ``b`` alone, over its ``window_weight[b]`` valid
    predictions: the paired per-window changes give every loss increase its standard error
    (:attr:`loss_increase_se`, SPEC §7). ``None`` for an object built without them (then the SE
    is NaN and no head is critical).
    """

    base_loss: float
    loss: Float[Tensor, "layer head"]
    mode: str = "zero"
    metadata: dict[str, Any] = field(default_factory=dict)
    window_loss: Float[Tensor, "layer head window"] | None = None
    base_window_loss: Float[Tensor, " window"] | None = None
    window_weight: Float[Tensor, " window"] | None = None

    @property
    def loss_increase(self) -> Float[Tensor, "layer head"]:
        """``loss − base_loss`` per head: the damage of removing that head alone."""
        return self.loss - self.base_loss

    @property
    def n_windows(self) -> int:
        """Windows with at least one valid prediction (0 without per-window losses)."""
        return 0 if self.window_weight is None else int((self.window_weight > 0).sum())

    @property
    def loss_increase_se(self) -> Float[Tensor, "layer head"]:
        """Standard error of :attr:`loss_increase` over windows (SPEC §7, ours): the per-window
        changes ``L_b(ablated) − L_b(dense)`` are paired, and
        :func:`~tl_geometry.functional.uncertainty.paired_window_se` gives the SE of their
        prediction-weighted mean (``sd / sqrt(n_windows)`` for windows of one length). NaN with
        fewer than 2 windows, or without per-window losses."""
        if (self.window_loss is None or self.base_window_loss is None or self.window_weight is None
                or self.n_windows == 0):  # no window with a prediction: no SE, as with one window
            return torch.full_like(self.loss, torch.nan, dtype=torch.float64)
        return paired_window_se(self.window_loss - self.base_window_loss, self.window_weight)

    def interval(self, level: float = CRITICAL_LEVEL) -> tuple[Tensor, Tensor]:
        """``(low, high)`` ``[layer, head]``: the Student-t interval of each loss increase at
        ``level`` over the windows, ``ΔL ∓ t_{level, n−1} · SE`` (ours); NaN without an SE."""
        return confidence_interval(self.loss_increase, self.loss_increase_se, max(self.n_windows, 1), level)

    def critical_mask(self, *, min_nats: float = CRITICAL_MIN_NATS,
                      min_fraction: float = CRITICAL_MIN_FRACTION,
                      level: float = CRITICAL_LEVEL) -> Bool[Tensor, "layer head"]:
        """``[layer, head]`` bool: the critical heads of :func:`critical_heads`. Thresholds that
        are not finite numbers ≥ 0 are refused, as there."""
        check_thresholds(min_nats, min_fraction)
        low, _ = self.interval(level)
        return critical_mask(low, self.base_loss, min_nats, min_fraction)

    def criticality(self, *, min_nats: float = CRITICAL_MIN_NATS,
                    min_fraction: float = CRITICAL_MIN_FRACTION,
                    level: float = CRITICAL_LEVEL) -> list[list[str]]:
        """``[layer][head]``: SPEC §7's outcome per head, "critical" (the interval's lower end
        reaches the threshold), "not critical" (its upper end stays below) or "undecided";
        "not scored" for a head that was not swept or has no standard error. Thresholds that
        are not finite numbers ≥ 0 are refused, as in :func:`critical_heads`."""
        check_thresholds(min_nats, min_fraction)
        low, high = self.interval(level)
        codes = criticality(low, high, self.base_loss, min_nats, min_fraction)
        return [["not scored" if math.isnan(c) else CRITICALITY[int(c)] for c in row]
                for row in codes.tolist()]

    def critical(self, *, min_nats: float = CRITICAL_MIN_NATS, min_fraction: float = CRITICAL_MIN_FRACTION,
                 level: float = CRITICAL_LEVEL) -> list[tuple[int, int]]:
        """Critical heads (:func:`critical_heads`, SPEC §7), largest effect first."""
        return critical_heads(self, min_nats=min_nats, min_fraction=min_fraction, level=level)

    def outliers(self, k: float = CRITICAL_K) -> list[tuple[int, int]]:
        """Heads whose loss increase is a robust outlier of the sweep (:func:`mad_outliers`):
        reported beside the critical rule, not a criterion (SPEC §7)."""
        return mad_outliers(self.loss_increase, k)

    def to_pandas(self, k: float = CRITICAL_K):
        """Long table, one row per head: ``layer, head, loss, loss_increase, loss_increase_se,
        ci_low, ci_high`` (the 95 % interval), ``critical`` (SPEC §7's rule), ``criticality``
        (critical / not critical / undecided, :meth:`criticality`) and ``outlier`` (the median
        + ``k``·1.4826·MAD flag, reported only)."""
        import pandas as pd

        n_layers, n_heads = self.loss.shape
        low, high = self.interval()
        outlier = torch.zeros(n_layers, n_heads, dtype=torch.bool)
        for layer, head in self.outliers(k):
            outlier[layer, head] = True
        return pd.DataFrame({
            "layer": torch.arange(n_layers).repeat_interleave(n_heads).numpy(),
            "head": torch.arange(n_heads).repeat(n_layers).numpy(),
            "loss": self.loss.flatten().numpy(),
            "loss_increase": self.loss_increase.flatten().numpy(),
            "loss_increase_se": self.loss_increase_se.flatten().numpy(),
            "ci_low": low.flatten().numpy(),
            "ci_high": high.flatten().numpy(),
            "critical": self.critical_mask().flatten().numpy(),
            "criticality": [c for row in self.criticality() for c in row],
            "outlier": outlier.flatten().numpy(),
        })

    def top(self, k: int = 10):
        """The ``k`` heads whose removal costs the most, as rows of :meth:`to_pandas`."""
        table = self.to_pandas()
        return table.sort_values("loss_increase", ascending=False, kind="stable").head(k)

    def plot(self, ax: Any = None):
        """Heatmap of the loss increase, layer × head, critical heads outlined
        (:func:`tl_geometry.views.plots.sensitivity_plot`): a figure built without pyplot, which
        a notebook shows once, as an image; with ``ax``, drawn there and ``ax`` returned (the figure
        is the caller's to show)."""
        from ..views.plots import sensitivity_plot

        return sensitivity_plot(self, ax)


def head_sensitivity(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    mode: Mode = "zero",
    *,
    attention_mask: Tensor | None = None,
    reference_tokens: Tensor | None = None,
    reference_attention_mask: Tensor | None = None,
    heads: Iterable[tuple[int, int]] | None = None,
    batch_heads: int | None = None,
    progress: bool = True,
) -> HeadSensitivity:
    """Loss increase when each head alone is ablated: a ``[layer, head]`` table (SPEC §7).

    ``loss[l, h] = CE(model with z_{l,h} ablated)``, the mean next-token cross-entropy over the
    valid positions of ``tokens``. The batch is stacked ``G`` times (``G = batch_heads``, by
    default as many as fit :data:`~tl_geometry.forward.losses.MEMORY_BUDGET_BYTES`) and copy
    ``g`` has a different head ablated, so one forward scores ``G`` heads and the sweep takes
    ``⌈L·H / G⌉`` forwards instead of ``L·H``. ``mode="mean"`` replaces a head by its mean
    ``z`` over ``reference_tokens`` (default: ``tokens``). ``heads`` limits the sweep to some
    heads (the others are NaN).

    Each loss is also kept per window (sequence) of ``tokens``, from the same forwards plus one
    unablated forward, so each ``ΔL`` comes with its standard error over windows
    (:attr:`HeadSensitivity.loss_increase_se`) and the critical-head rule of SPEC §7 can tell an
    effect from noise (:func:`critical_heads`). Give at least 2 windows (a ``UserWarning``
    otherwise: no SE, no critical head); more windows, narrower intervals.

    Examples:
        >>> sens = tl_geometry.ablation.head_sensitivity(model, tokens)        # doctest: +SKIP
        >>> sens.top(5); sens.critical()                              # doctest: +SKIP
    """
    tokens, n_layers, n_heads, progress = prepare_ablation(
        model, tokens, mode, reference_tokens, reference_attention_mask, progress)
    positive_int("batch_heads", batch_heads, allow_none=True)
    wanted = torch.ones(n_layers, n_heads, dtype=torch.bool) if heads is None else (
        _forward.head_mask(heads, n_layers, n_heads))
    pairs = wanted.nonzero()  # [k, 2], layer-major
    if len(pairs) == 0:
        raise ValueError("heads is empty: nothing to score.")
    # One replica per head: replica r removes exactly head pairs[r].
    remove = torch.zeros(len(pairs), n_layers, n_heads, dtype=torch.bool)
    remove[torch.arange(len(pairs)), pairs[:, 0], pairs[:, 1]] = True
    per_forward = batch_heads or _losses.replicas_per_forward(model, *tokens.shape)
    if int(_losses.valid_targets(tokens, attention_mask).any(-1).sum()) < 2:  # before the sweep
        warnings.warn(
            "head_sensitivity got one window with next-token predictions: a loss increase has no "
            "standard error over windows, so no head can be critical (SPEC §7). Pass ≥ 2 "
            "windows, e.g. tl_geometry.text_windows(model, n_seqs=4).", UserWarning, stacklevel=2)
    start = time.perf_counter()
    base, dense, windows = ablated_losses(
        model, tokens, remove, mode, attention_mask=attention_mask, reference_tokens=reference_tokens,
        reference_attention_mask=reference_attention_mask, per_forward=per_forward, progress=progress,
        label="head sensitivity", unit="head")
    assert windows is not None  # pairs is not empty
    loss = torch.full((n_layers, n_heads), float("nan"), dtype=torch.float64)
    loss[pairs[:, 0], pairs[:, 1]] = windows.total
    window_loss = torch.full((n_layers, n_heads, tokens.shape[0]), float("nan"), dtype=torch.float64)
    window_loss[pairs[:, 0], pairs[:, 1]] = windows.loss
    metadata = {"tokens": list(tokens.shape), "heads_per_forward": per_forward,
                "forwards": -(-len(pairs) // per_forward), "seconds": time.perf_counter() - start,
                "masked": attention_mask is not None}
    return HeadSensitivity(base, loss, mode, metadata, window_loss, dense.loss[0], dense.weight)


def critical_heads(
    sensitivity: HeadSensitivity,
    *,
    min_nats: float = CRITICAL_MIN_NATS,
    min_fraction: float = CRITICAL_MIN_FRACTION,
    level: float = CRITICAL_LEVEL,
) -> list[tuple[int, int]]:
    """Critical heads of a sensitivity sweep (SPEC §7, ours), largest loss increase first.

    Head ``h`` is critical when the lower end of the ``level`` (95 %) interval of its loss
    increase over windows, ``ΔL_h − t_{level, n−1} · SE_h`` (SE:
    :attr:`HeadSensitivity.loss_increase_se`, paired over the ``n`` windows), is at least
    ``max(min_nats, min_fraction · L_dense)`` — by default 0.1 nats or 5 % of the dense loss,
    whichever is larger: a large effect, beyond noise. Where the upper end stays below that the
    head is not critical; in between it is undecided (:meth:`HeadSensitivity.criticality`).

    A robust-outlier rule alone (median + k·MAD) is not enough: it flags heads whose effect is
    tiny in absolute terms, or is within the noise of a few windows. The MAD flag is still
    reported (:meth:`HeadSensitivity.outliers`, the ``outlier`` column of ``to_pandas()``). A
    head that was not scored, or a sweep on fewer than 2 windows (no SE), gives no critical head.

    Examples:
        >>> tl_geometry.ablation.critical_heads(sens)          # doctest: +SKIP
        [(1, 5), (11, 2)]
    """
    if not isinstance(sensitivity, HeadSensitivity):
        raise ValueError(
            "critical_heads takes a HeadSensitivity (from head_sensitivity): the rule needs each "
            "loss increase's standard error over windows and the dense loss, not a tensor of "
            "increases alone. For the old robust-outlier flag use "
            "tl_geometry.ablation.mad_outliers(increases)."
        )
    check_thresholds(min_nats, min_fraction)
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95, got {level!r}.")
    flagged = sensitivity.critical_mask(min_nats=min_nats, min_fraction=min_fraction, level=level)
    return _largest_first(flagged, sensitivity.loss_increase)


def mad_outliers(
    increase: Float[Tensor, "layer head"], k: float = CRITICAL_K
) -> list[tuple[int, int]]:
    """Heads whose loss increase is a robust outlier of the sweep, largest first (reported
    beside SPEC §7's critical rule, not a criterion).

    With ``x`` the loss increases of all scored heads, ``m = median(x)`` and
    ``MAD = median(|x − m|)``, head ``h`` is an outlier when ``x_h > m + k · 1.4826 · MAD`` and
    ``x_h > 0``. ``1.4826 · MAD`` estimates the standard deviation of the bulk without being
    pulled by the outliers themselves; ``k = 3.5`` is Iglewicz & Hoaglin's cut on the modified
    z-score. NaN entries are ignored.
    """
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not k >= 0:
        raise ValueError(f"k must be a number ≥ 0, got {k!r}.")
    if not isinstance(increase, Tensor) or increase.ndim != 2:
        raise ValueError("mad_outliers takes a [layer, head] tensor of loss increases.")
    x = increase.double()
    scored = x[~x.isnan()]
    if scored.numel() == 0:
        return []
    median = scored.quantile(0.5)  # the midpoint median (Tensor.median takes the lower middle)
    mad = (scored - median).abs().quantile(0.5)
    return _largest_first((x > median + k * _MAD_TO_SIGMA * mad) & (x > 0), x)


def _largest_first(flagged: Bool[Tensor, "layer head"], x: Float[Tensor, "layer head"]) -> list[tuple[int, int]]:
    idx = flagged.nonzero()
    order = x[idx[:, 0], idx[:, 1]].argsort(descending=True, stable=True)
    return [tuple(pair) for pair in idx[order].tolist()]
