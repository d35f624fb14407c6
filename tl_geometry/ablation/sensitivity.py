"""Single-head sensitivity sweep and the critical-head rule (SPEC §7)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..analyze.progress import check_progress
from . import hooks as _hooks
from .hooks import Mode

#: Default ``k`` of the critical-head rule: Iglewicz & Hoaglin's outlier cut on the modified
#: z-score, ``0.6745 (x − median) / MAD > 3.5``.
CRITICAL_K = 3.5
_MAD_TO_SIGMA = 1.4826  # MAD × 1.4826 estimates σ for normal data


@dataclass
class HeadSensitivity:
    """Loss of the model with each head alone ablated, on one batch of tokens.

    ``loss[l, h]`` is the mean next-token cross-entropy with head ``(l, h)`` ablated (NaN for a
    head that was not scored); ``base_loss`` is the unablated loss, the model's own
    ``return_type="loss"``.
    """

    base_loss: float
    loss: Float[Tensor, "layer head"]
    mode: str = "zero"
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def loss_increase(self) -> Float[Tensor, "layer head"]:
        """``loss − base_loss`` per head: the damage of removing that head alone."""
        return self.loss - self.base_loss

    def critical(self, k: float = CRITICAL_K) -> list[tuple[int, int]]:
        """Heads whose loss increase is an outlier (:func:`critical_heads`), largest first."""
        return critical_heads(self, k=k)

    def to_pandas(self, k: float = CRITICAL_K):
        """Long table: ``layer, head, loss, loss_increase, critical`` (one row per head)."""
        import pandas as pd

        n_layers, n_heads = self.loss.shape
        flagged = torch.zeros(n_layers, n_heads, dtype=torch.bool)
        for layer, head in self.critical(k):
            flagged[layer, head] = True
        return pd.DataFrame({
            "layer": torch.arange(n_layers).repeat_interleave(n_heads).numpy(),
            "head": torch.arange(n_heads).repeat(n_layers).numpy(),
            "loss": self.loss.flatten().numpy(),
            "loss_increase": self.loss_increase.flatten().numpy(),
            "critical": flagged.flatten().numpy(),
        })

    def top(self, k: int = 10):
        """The ``k`` heads whose removal costs the most, as rows of :meth:`to_pandas`."""
        table = self.to_pandas()
        return table.sort_values("loss_increase", ascending=False, kind="stable").head(k)

    def plot(self, ax: Any = None):
        """Heatmap of the loss increase, layer × head, critical heads outlined."""
        import matplotlib.pyplot as plt

        fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(6, 7))
        values = self.loss_increase.numpy()
        bound = float(abs(self.loss_increase).nan_to_num().max()) or 1.0  # white = no effect
        image = ax.imshow(values, aspect="auto", cmap="RdBu_r", vmin=-bound, vmax=bound)
        for layer, head in self.critical():
            ax.add_patch(plt.Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, ec="cyan", lw=1.5))
        ax.set(xlabel="head", ylabel="layer", title=f"Δ loss, one head {self.mode}-ablated (outlined: critical)")
        fig.colorbar(image, ax=ax, label="Δ loss (nats)")
        return fig


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
    default as many as fit :data:`~tl_geometry.ablation.hooks.MEMORY_BUDGET_BYTES`) and copy
    ``g`` has a different head ablated, so one forward scores ``G`` heads and the sweep takes
    ``⌈L·H / G⌉`` forwards instead of ``L·H``. ``mode="mean"`` replaces a head by its mean
    ``z`` over ``reference_tokens`` (default: ``tokens``). ``heads`` limits the sweep to some
    heads (the others are NaN).

    Examples:
        >>> sens = tl_geometry.head_sensitivity(model, tokens)        # doctest: +SKIP
        >>> sens.top(5); sens.critical()                              # doctest: +SKIP
    """
    _hooks.check_mode(mode)
    progress = check_progress(progress)
    tokens = _hooks.check_tokens(tokens, model=model)
    _hooks.check_reference(mode, reference_tokens, reference_attention_mask)
    n_layers, n_heads = _hooks.model_shape(model)
    _hooks.check_hooks(model, range(n_layers))
    if batch_heads is not None and (isinstance(batch_heads, bool) or not isinstance(batch_heads, int)
                                    or batch_heads < 1):
        raise ValueError(f"batch_heads must be a positive int, got {batch_heads!r}.")
    wanted = torch.ones(n_layers, n_heads, dtype=torch.bool) if heads is None else (
        _hooks.head_mask(heads, n_layers, n_heads))
    pairs = wanted.nonzero()  # [k, 2], layer-major
    if len(pairs) == 0:
        raise ValueError("heads is empty: nothing to score.")
    fill = None
    if mode == "mean":
        ref = tokens if reference_tokens is None else reference_tokens
        ref_mask = attention_mask if reference_tokens is None else reference_attention_mask
        fill = _hooks.mean_z(model, ref, range(n_layers), ref_mask)
    # One replica per head: replica r removes exactly head pairs[r].
    remove = torch.zeros(len(pairs), n_layers, n_heads, dtype=torch.bool)
    remove[torch.arange(len(pairs)), pairs[:, 0], pairs[:, 1]] = True

    start = time.perf_counter()
    base = _hooks.model_loss(model, tokens, attention_mask)
    per_forward = batch_heads or _hooks.replicas_per_forward(model, *tokens.shape)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(pairs), desc="head sensitivity", unit="head")
    try:
        losses = _hooks.replica_losses(model, tokens, remove, fill=fill, attention_mask=attention_mask,
                                       per_forward=per_forward, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    loss = torch.full((n_layers, n_heads), float("nan"), dtype=torch.float64)
    loss[pairs[:, 0], pairs[:, 1]] = losses
    metadata = {"tokens": list(tokens.shape), "heads_per_forward": per_forward,
                "forwards": -(-len(pairs) // per_forward), "seconds": time.perf_counter() - start,
                "masked": attention_mask is not None}
    return HeadSensitivity(base, loss, mode, metadata)


def critical_heads(
    sensitivity: HeadSensitivity | Float[Tensor, "layer head"], k: float = CRITICAL_K
) -> list[tuple[int, int]]:
    """Heads whose single-head loss increase is an outlier, largest effect first.

    Rule (robust, ours in its constants): with ``x`` the loss increases of all scored heads,
    ``m = median(x)`` and ``MAD = median(|x − m|)``, head ``h`` is critical when

        ``x_h > m + k · 1.4826 · MAD``   and   ``x_h > 0``.

    ``1.4826 · MAD`` estimates the standard deviation of the bulk without being pulled by the
    outliers themselves; the default ``k = 3.5`` is Iglewicz & Hoaglin's cut on the modified
    z-score. Only the upper tail counts: a head whose removal *lowers* the loss is not critical.
    A tensor argument is read as the loss increases themselves. NaN entries are ignored.

    Examples:
        >>> tl_geometry.critical_heads(sens)          # doctest: +SKIP
        [(0, 4), (1, 7)]
    """
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not k >= 0:
        raise ValueError(f"k must be a number ≥ 0, got {k!r}.")
    x = sensitivity.loss_increase if isinstance(sensitivity, HeadSensitivity) else sensitivity
    if not isinstance(x, Tensor) or x.ndim != 2:
        raise ValueError("critical_heads takes a HeadSensitivity or a [layer, head] tensor of loss increases.")
    x = x.double()
    scored = x[~x.isnan()]
    if scored.numel() == 0:
        return []
    median = scored.quantile(0.5)  # the midpoint median (Tensor.median takes the lower middle)
    mad = (scored - median).abs().quantile(0.5)
    flagged = (x > median + k * _MAD_TO_SIGMA * mad) & (x > 0)
    idx = flagged.nonzero()
    order = x[idx[:, 0], idx[:, 1]].argsort(descending=True, stable=True)
    return [tuple(pair) for pair in idx[order].tolist()]
