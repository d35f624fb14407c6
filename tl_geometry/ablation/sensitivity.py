"""Single-head sensitivity and the critical-head rule; a set of heads against random sets of
the same size (SPEC §7, ours)."""

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
    empirical_p,
    null_z,
    paired_window_se,
)
from .hooks import Mode, ablated_losses, check_hooks, positive_int, prepare_ablation

#: ``k`` of the robust-outlier flag (reported, not the critical rule): Iglewicz & Hoaglin's cut
#: on the modified z-score, ``0.6745 (x − median) / MAD > 3.5``.
CRITICAL_K = 3.5
_MAD_TO_SIGMA = 1.4826  # MAD × 1.4826 estimates σ for normal data


@dataclass
class HeadSensitivity:
    """Loss of the model with each head alone ablated, on one batch of tokens.

    ``loss[l, h]``: the mean next-token loss with head ``(l, h)`` ablated (NaN if not scored);
    ``base_loss``: the unablated one. ``window_loss[l, h, b]`` and ``base_window_loss[b]``: the
    same on window ``b`` alone, over its ``window_weight[b]`` valid predictions, for the SE of
    each increase (SPEC §7; ``None`` for an object built without them: no SE, no critical head).
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
        """SE of :attr:`loss_increase` over windows (SPEC §7, ours): of the prediction-weighted
        mean of the paired changes ``L_b(ablated) − L_b(dense)``
        (:func:`~tl_geometry.functional.uncertainty.paired_window_se`); NaN with < 2 windows."""
        if (self.window_loss is None or self.base_window_loss is None or self.window_weight is None
                or self.n_windows == 0):  # no window with a prediction: no SE, as with one window
            return torch.full_like(self.loss, torch.nan, dtype=torch.float64)
        return paired_window_se(self.window_loss - self.base_window_loss, self.window_weight)

    def interval(self, level: float = CRITICAL_LEVEL) -> tuple[Tensor, Tensor]:
        """``(low, high)``: the Student-t interval ``ΔL ∓ t_{level, n−1} · SE`` (ours)."""
        return confidence_interval(self.loss_increase, self.loss_increase_se, max(self.n_windows, 1), level)

    def critical_mask(self, *, min_nats: float = CRITICAL_MIN_NATS,
                      min_fraction: float = CRITICAL_MIN_FRACTION,
                      level: float = CRITICAL_LEVEL) -> Bool[Tensor, "layer head"]:
        """``[layer, head]`` bool: the critical heads of :func:`critical_heads`."""
        check_thresholds(min_nats, min_fraction)
        low, _ = self.interval(level)
        return critical_mask(low, self.base_loss, min_nats, min_fraction)

    def criticality(self, *, min_nats: float = CRITICAL_MIN_NATS,
                    min_fraction: float = CRITICAL_MIN_FRACTION,
                    level: float = CRITICAL_LEVEL) -> list[list[str]]:
        """``[layer][head]``: SPEC §7's outcome, "critical", "not critical" or "undecided"
        (:func:`critical_heads`); "not scored" for a head not swept or without an SE."""
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
        """:func:`mad_outliers` of the loss increases (reported, not a criterion, SPEC §7)."""
        return mad_outliers(self.loss_increase, k)

    def to_pandas(self, k: float = CRITICAL_K):
        """One row per head: ``layer, head, loss, loss_increase, loss_increase_se, ci_low,
        ci_high`` (95 %), ``critical``, ``criticality`` and ``outlier`` (:meth:`outliers`)."""
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
        """Heatmap of the loss increase, critical heads outlined
        (:func:`tl_geometry.views.plots.sensitivity_plot`)."""
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

    ``loss[l, h] = CE(model with z_{l,h} ablated)`` over the valid positions of ``tokens``. The
    batch is stacked ``G = batch_heads`` times (default: as many as fit
    :data:`~tl_geometry.forward.losses.MEMORY_BUDGET_BYTES`), a different head ablated in each
    copy, so the sweep takes ``⌈L·H / G⌉`` forwards. ``mode="mean"`` uses each head's mean ``z``
    over ``reference_tokens`` (default: ``tokens``); ``heads`` limits the sweep (the rest is NaN).
    Each loss is also kept per window, so each ``ΔL`` has its SE and :func:`critical_heads` can
    tell an effect from noise: give at least 2 windows (a ``UserWarning`` otherwise).

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
    window_loss = torch.full((n_layers, n_heads, tokens.shape[0]), float("nan"), dtype=torch.float64)
    loss[pairs[:, 0], pairs[:, 1]] = windows.total
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

    Head ``h`` is critical when the lower end of the ``level`` interval of its loss increase,
    ``ΔL_h − t_{level, n−1} · SE_h`` (:attr:`HeadSensitivity.loss_increase_se`), is at least
    ``max(min_nats, min_fraction · L_dense)`` (by default 0.1 nats or 5 % of the dense loss): a
    large effect, beyond noise. Where the upper end stays below that it is not critical; in
    between, undecided (:meth:`HeadSensitivity.criticality`). A median + k·MAD rule alone would
    flag effects that are tiny or within the noise; it is reported apart (:func:`mad_outliers`).
    A head not scored, or a sweep on fewer than 2 windows (no SE), gives no critical head.

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
    """Heads whose loss increase is a robust outlier, largest first (reported beside SPEC §7's
    critical rule, not a criterion): ``x_h > m + k · 1.4826 · MAD`` and ``x_h > 0``, with ``m``
    the median of the scored (non-NaN) increases and ``MAD = median(|x − m|)``; ``1.4826 · MAD``
    estimates the bulk's sd without being pulled by the outliers."""
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


@dataclass
class AblationVsRandom:
    """The loss increase of one set of heads (``heads``, sorted pairs), with its SE over windows
    (paired, SPEC §7), next to that of each random set ``random_sets[r]`` of the same size."""

    heads: list[tuple[int, int]]
    base_loss: float
    loss: float
    loss_increase_se: float
    random_sets: Bool[Tensor, "sample layer head"]
    random_loss: Float[Tensor, " sample"]
    random_increase_se: Float[Tensor, " sample"]
    same_layers: bool = False
    seed: int = 0
    mode: str = "zero"
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def loss_increase(self) -> float:
        """``ΔL = L(set ablated) − L(dense)``."""
        return self.loss - self.base_loss

    @property
    def random_increase(self) -> Float[Tensor, " sample"]:
        """``ΔL`` of each random set."""
        return self.random_loss - self.base_loss

    @property
    def n_random(self) -> int:
        return int(self.random_loss.numel())

    @property
    def random_mean(self) -> float:
        """Mean ``ΔL`` of the random sets (the null's mean)."""
        return null_z(self.loss_increase, self.random_increase)[0]

    @property
    def random_sd(self) -> float:
        """Sample sd (``n − 1``) of the random sets' ``ΔL``; NaN for fewer than 2 sets."""
        return null_z(self.loss_increase, self.random_increase)[1]

    @property
    def z(self) -> float:
        """``(ΔL − random_mean) / random_sd``; NaN where the sd is NaN or 0."""
        return null_z(self.loss_increase, self.random_increase)[2]

    @property
    def p_value(self) -> float:
        """One-sided empirical p-value ``(1 + #{random ΔL ≥ ΔL}) / (1 + n_random)``: how often
        random sets of the same size hurt at least as much (never below ``1 / (1 + n_random)``)."""
        return empirical_p(self.loss_increase, self.random_increase)

    def to_pandas(self):
        """One row per set: ``set`` (``"chosen"`` / ``"random"``), ``sample`` (<NA> for the
        chosen set), ``heads`` (``"L1H5 L3H0"``), ``loss``, ``loss_increase``, ``loss_increase_se``."""
        import pandas as pd

        rows = [{"set": "chosen", "sample": None, "heads": _names(self.heads), "loss": self.loss,
                 "loss_increase": self.loss_increase, "loss_increase_se": self.loss_increase_se}]
        for r in range(self.n_random):
            pairs = [tuple(p) for p in self.random_sets[r].nonzero().tolist()]
            rows.append({"set": "random", "sample": r, "heads": _names(pairs),
                         "loss": float(self.random_loss[r]),
                         "loss_increase": float(self.random_increase[r]),
                         "loss_increase_se": float(self.random_increase_se[r])})
        table = pd.DataFrame(rows)
        table["sample"] = table["sample"].astype("Int64")
        return table

    def summary(self) -> str:
        """One paragraph: the set's ΔL ± SE against the random sets' mean ± sd, z and p."""
        where = "the same layers" if self.same_layers else "all heads"
        return (f"{len(self.heads)} heads {self.mode}-ablated: ΔL = {self.loss_increase:+.4f} ± "
                f"{self.loss_increase_se:.4f} (SE over windows); {self.n_random} random sets of "
                f"{len(self.heads)} heads from {where} (seed {self.seed}): mean "
                f"{self.random_mean:+.4f}, sd {self.random_sd:.4f}; z = {self.z:.2f}, "
                f"empirical p = {self.p_value:.3g}")

    def __repr__(self) -> str:
        return f"AblationVsRandom({self.summary()})"


def _names(pairs: Iterable[tuple[int, int]]) -> str:
    return " ".join(f"L{layer}H{head}" for layer, head in pairs)


def random_head_sets(
    chosen: Bool[Tensor, "layer head"], n_random: int, *, same_layers: bool = False, seed: int = 0
) -> Bool[Tensor, "sample layer head"]:
    """``n_random`` independent random sets with as many heads as ``chosen`` (which they may
    coincide with): uniform over all heads or, with ``same_layers``, inside each layer with
    ``chosen``'s count per layer; seeded by ``torch.Generator().manual_seed(seed)``."""
    n_layers, n_heads = chosen.shape
    gen = torch.Generator().manual_seed(seed)
    # One draw of shape [n_random, 1, L·H] consumes the generator as [n_random, L·H] does: the
    # uniform sets are the same whichever branch shaped them.
    pool = (n_layers, n_heads) if same_layers else (1, n_layers * n_heads)
    rank = torch.rand(n_random, *pool, generator=gen).argsort(-1).argsort(-1)  # uniform permutations
    count = chosen.sum(-1)[None, :, None] if same_layers else int(chosen.sum())
    return (rank < count).reshape(n_random, n_layers, n_heads)


def ablation_vs_random(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    heads: Iterable[tuple[int, int]] | Bool[Tensor, "layer head"],
    *,
    n_random: int = 100,
    same_layers: bool = False,
    seed: int = 0,
    mode: Mode = "zero",
    attention_mask: Tensor | None = None,
    reference_tokens: Tensor | None = None,
    reference_attention_mask: Tensor | None = None,
    batch_size: int | None = None,
    progress: bool = True,
) -> AblationVsRandom:
    """Loss increase of ablating ``heads`` together, against random sets of the same size
    (SPEC §7, ours).

    ``heads`` (pairs or a bool mask, not empty) and ``n_random`` sets from
    :func:`random_head_sets` are ablated as replicas of the batch in stacked forwards
    (``batch_size`` per forward; default: by memory budget), zeroed or, with ``mode="mean"``, at
    their mean over ``reference_tokens`` (default ``tokens``). Reported: the set's ``ΔL`` with
    its paired SE, and against the random sets' ``ΔL`` their mean and sd,
    ``z = (ΔL − mean) / sd`` and the empirical p-value ``(1 + #{random ΔL ≥ ΔL}) / (1 + n_random)``.

    Examples:
        >>> cmp = tl_geometry.ablation.ablation_vs_random(model, tokens, [(1, 5), (1, 4)],  # doctest: +SKIP
        ...                                           n_random=50)
        >>> cmp.z, cmp.p_value; print(cmp.summary())                                         # doctest: +SKIP
    """
    # The model's hook_z is checked below, once the heads are known to be valid.
    tokens, n_layers, n_heads, progress = prepare_ablation(
        model, tokens, mode, reference_tokens, reference_attention_mask, progress, check_z=False)
    positive_int("n_random", n_random)
    positive_int("batch_size", batch_size, allow_none=True)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}.")
    chosen = _forward.head_mask(heads, n_layers, n_heads)
    if not chosen.any():
        raise ValueError("heads is empty: give the (layer, head) pairs of the set to compare, e.g. [(1, 5)].")
    check_hooks(model, range(n_layers))
    start = time.perf_counter()
    sets = random_head_sets(chosen, n_random, same_layers=same_layers, seed=seed)
    base, dense, windows = ablated_losses(
        model, tokens, torch.cat([chosen[None], sets]), mode, attention_mask=attention_mask,
        reference_tokens=reference_tokens, reference_attention_mask=reference_attention_mask,
        per_forward=batch_size, progress=progress, label="ablation vs random", unit="set")
    assert windows is not None  # the chosen set is not empty
    se = paired_window_se(windows.loss - dense.loss, dense.weight)
    total = windows.total
    metadata = {"tokens": list(tokens.shape), "n_windows": int((dense.weight > 0).sum()),
                "seconds": time.perf_counter() - start, "masked": attention_mask is not None}
    return AblationVsRandom(
        heads=[tuple(p) for p in chosen.nonzero().tolist()], base_loss=base, loss=float(total[0]),
        loss_increase_se=float(se[0]),
        random_sets=sets, random_loss=total[1:], random_increase_se=se[1:],
        same_layers=bool(same_layers), seed=seed, mode=mode, metadata=metadata,
    )
