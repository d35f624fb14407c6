"""Retrieval capacity: the loss of top-``N`` attention on a scope, or on one layer / head at a
time, in batched forwards (method in docs/capacity.md)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..forward import hooks as _hooks
from ..forward.losses import (
    WindowLosses,
    model_loss,
    replicas_per_forward,
    stacked_window_losses,
    window_losses,
)
from ..inputs.facts import model_facts
from ..inputs.tokens import token_digest
from ..progress import check_progress, progress_counter
from . import topn as _topn
from .topn import SparsifyMode

#: The keys per query ``N`` that a capacity sweep measures by default.
DEFAULT_N_VALUES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_TOLERANCE = 0.05


def check_n_values(n_values: Any) -> tuple[int, ...]:
    if isinstance(n_values, (str, bytes)) or not isinstance(n_values, Iterable):
        raise ValueError(f"n_values must be a sequence of ints ≥ 1, e.g. (1, 2, 4, 8), got {n_values!r}.")
    values = tuple(n_values)
    if not values:
        raise ValueError("n_values is empty: give at least one N, e.g. (1, 2, 4, 8).")
    for i, n in enumerate(values):
        _topn.check_n(n, f"n_values[{i}]")
    if len(set(values)) != len(values):
        raise ValueError(f"n_values lists an N twice: {values}.")
    return values


def _check_tolerance(tolerance: Any) -> float:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not (
            math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a relative loss increase ≥ 0, e.g. 0.05, got {tolerance!r}.")
    return float(tolerance)


def _scope(model: Any, tokens: Any, layers: Any, heads: Any) -> tuple[Tensor, int, int, Tensor]:
    """Checked ``tokens``, the model's shape and the ``[layer, head]`` scope mask."""
    tokens = _hooks.check_tokens(tokens, model=model)
    n_layers, n_heads = model_facts(model).shape()
    mask = _topn.scope_mask(n_layers, n_heads, layers, heads)
    _topn.check_pattern_hooks(model, mask)
    return tokens, n_layers, n_heads, mask


def _losses(model: Any, tokens: Tensor, n: Tensor, masks: Tensor, mode: SparsifyMode,
            attention_mask: Tensor | None, batch_size: int | None, progress: bool, desc: str,
            metadata: dict[str, Any]) -> tuple[float, WindowLosses, Tensor, Tensor, dict[str, Any]]:
    """The dense loss and per-window losses, then each replica's loss and per-window losses
    (``[replica]``, ``[replica, window]``) with the heads ``masks[r]`` sparsified to ``n[r]`` keys
    (``n [R]``, or per head ``[R, layer, head]``), and the metadata (``metadata``'s keys after
    ``tokens``). Replicas with ``N ≥ pos`` change nothing and get the dense losses without a
    forward (so ``N ≥ T`` is exactly dense)."""
    start = time.perf_counter()
    dense = model_loss(model, tokens, attention_mask)
    dense_windows = window_losses(model, tokens, attention_mask)
    losses = torch.full((len(n),), dense, dtype=torch.float64)
    window = dense_windows.loss.expand(len(n), -1).clone()
    run = n < tokens.shape[1]
    forwards = 0
    if run.any():
        per_forward = batch_size or replicas_per_forward(model, *tokens.shape)
        n_run, masks_run, n_heads = n[run], masks[run], model_facts(model).shape()[1]
        bar = progress_counter(len(n_run), desc, "replica") if progress else None

        def hooks_for(lo: int, hi: int) -> _hooks.HookList:
            return _topn.pattern_hooks(n_run[lo:hi], masks_run[lo:hi], mode, n_heads)

        try:
            sparse = stacked_window_losses(model, tokens, len(n_run), hooks_for,
                                           attention_mask=attention_mask, per_forward=per_forward,
                                           progress=bar)
        finally:
            if bar is not None:
                bar.close()
        losses[run] = sparse.total
        window[run] = sparse.loss
        forwards = -(-int(run.sum()) // per_forward)
    metadata = {"tokens": list(tokens.shape), **metadata, "forwards": forwards,
                "seconds": time.perf_counter() - start, "masked": attention_mask is not None}
    return dense, dense_windows, losses, window, metadata


def _check_batch_size(batch_size: Any) -> None:
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int (replicas per forward), got {batch_size!r}.")


@dataclass
class RetrievalCapacity:
    """Loss against ``N`` when the heads in scope keep only each query's top-``N`` keys.

    ``loss[i]`` is the mean next-token loss at ``n_values[i]``; ``dense_loss`` the model's own.
    ``window_loss[i, b]``, ``dense_window_loss[b]`` and ``window_weight[b]``: the same on window
    ``b`` alone and its valid predictions, for an interval over windows (SPEC §8; ``None`` for
    an object built without them).
    """

    n_values: tuple[int, ...]
    loss: Float[Tensor, " n"]
    dense_loss: float
    mode: str = "renormalize"
    tolerance: float = DEFAULT_TOLERANCE
    scope: str = "all heads"
    metadata: dict[str, Any] = field(default_factory=dict)
    window_loss: Float[Tensor, "n window"] | None = None
    dense_window_loss: Float[Tensor, " window"] | None = None
    window_weight: Float[Tensor, " window"] | None = None

    @property
    def relative_increase(self) -> Float[Tensor, " n"]:
        """``(loss − dense_loss) / dense_loss`` per ``N``."""
        return (self.loss - self.dense_loss) / self.dense_loss

    @property
    def n_star(self) -> int | None:
        """Smallest ``N`` within ``tolerance`` of the dense loss; ``None`` if no ``N`` is."""
        ok = [n for n, r in zip(self.n_values, self.relative_increase.tolist()) if r <= self.tolerance]
        return min(ok) if ok else None

    def to_pandas(self):
        """One row per N: ``n, mode, scope, tolerance, loss, dense_loss, relative_increase,
        within_tolerance``."""
        import pandas as pd

        rel = self.relative_increase
        return pd.DataFrame({
            "n": list(self.n_values), "mode": self.mode, "scope": self.scope, "tolerance": self.tolerance,
            "loss": self.loss.numpy(), "dense_loss": self.dense_loss, "relative_increase": rel.numpy(),
            "within_tolerance": (rel <= self.tolerance).numpy(),
        })

    def plot(self, ax: Any = None):
        """Loss against ``N`` (log axis), the dense loss and its tolerance band, ``N*`` marked
        (:func:`tl_geometry.views.capacity.capacity_plot`)."""
        from ..views.capacity import capacity_plot

        return capacity_plot(self.to_pandas(), ax=ax)

    def __repr__(self) -> str:
        return (f"RetrievalCapacity(mode={self.mode!r}, scope={self.scope!r}, dense_loss="
                f"{self.dense_loss:.4f}, n_star={self.n_star})")


def retrieval_capacity(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    n_values: Sequence[int] = DEFAULT_N_VALUES,
    *,
    mode: SparsifyMode = "renormalize",
    tolerance: float = DEFAULT_TOLERANCE,
    layers: Iterable[int] | None = None,
    heads: Iterable[tuple[int, int]] | Bool[Tensor, "layer head"] | None = None,
    attention_mask: Tensor | None = None,
    batch_size: int | None = None,
    progress: bool = False,
) -> RetrievalCapacity:
    """Loss with every head in scope sparsified to its top-``N`` keys, for each ``N``.

    ``loss_N = CE(model with top_n_attention(N, mode) on the scope)`` over the valid positions
    of ``tokens``; ``N* = min{N : (loss_N − loss_dense) / loss_dense ≤ tolerance}``. The ``N``
    values run as stacked copies of the batch (``batch_size`` per forward, by default as many as
    fit the memory budget); ``N ≥`` the sequence length gives exactly the dense loss.

    Examples:
        >>> cap = tl_geometry.capacity.retrieval_capacity(model, tokens, (1, 2, 4, 8, 16, 32))  # doctest: +SKIP
        >>> cap.n_star, cap.to_pandas(); cap.plot()                                     # doctest: +SKIP
    """
    values = check_n_values(n_values)
    _topn.check_sparsify_mode(mode)
    tolerance = _check_tolerance(tolerance)
    _check_batch_size(batch_size)
    progress = check_progress(progress)
    tokens, _, _, mask = _scope(model, tokens, layers, heads)
    scope = ("all heads" if bool(mask.all()) else
             f"layers {mask.all(1).nonzero().flatten().tolist()}" if layers is not None else
             f"{int(mask.sum())} heads")
    dense, dense_windows, losses, per_window, metadata = _losses(
        model, tokens, torch.tensor(values), mask.expand(len(values), -1, -1), mode, attention_mask,
        batch_size, progress, "retrieval capacity", {})
    return RetrievalCapacity(values, losses, dense, mode, tolerance, scope, metadata, per_window,
                             dense_windows.loss[0], dense_windows.weight)


@dataclass
class CapacitySweep:
    """Loss with one layer (``by="layer"``) or one head (``by="head"``) alone sparsified.

    ``loss[i, l]`` (layer sweep) or ``loss[i, l, h]`` (head sweep) at ``N = n_values[i]``; NaN
    for what was not swept. ``window_loss[..., b]``, ``dense_window_loss[b]`` and
    ``window_weight[b]`` as in :class:`RetrievalCapacity`.
    """

    n_values: tuple[int, ...]
    loss: Float[Tensor, "n layer *head"]
    dense_loss: float
    by: str = "head"
    mode: str = "renormalize"
    metadata: dict[str, Any] = field(default_factory=dict)
    window_loss: Float[Tensor, "n layer *head window"] | None = None
    dense_window_loss: Float[Tensor, " window"] | None = None
    window_weight: Float[Tensor, " window"] | None = None

    @property
    def loss_increase(self) -> Float[Tensor, "n layer *head"]:
        """``loss − dense_loss``: the damage of sparsifying that layer or head alone."""
        return self.loss - self.dense_loss

    def to_pandas(self):
        """Long table: ``n, layer[, head], mode, loss, loss_increase``."""
        import pandas as pd

        index = torch.cartesian_prod(*(torch.arange(s) for s in self.loss.shape)).reshape(-1, self.loss.ndim)
        table: dict[str, Any] = {"n": torch.tensor(self.n_values)[index[:, 0]].numpy(), "layer": index[:, 1].numpy()}
        if self.by == "head":
            table["head"] = index[:, 2].numpy()
        table.update(mode=self.mode, loss=self.loss.flatten().numpy(),
                     loss_increase=self.loss_increase.flatten().numpy())
        return pd.DataFrame(table)

    def plot(self, n: int | None = None):
        """Heatmap of the loss increase at ``N = n`` (default the smallest): layer × head, or
        layer × N for a layer sweep (:func:`tl_geometry.views.capacity_sweep_plot`)."""
        from ..views.capacity import capacity_sweep_plot

        return capacity_sweep_plot(self, n)


def capacity_sweep(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    n_values: Sequence[int] = (4,),
    *,
    by: Literal["head", "layer"] = "head",
    mode: SparsifyMode = "renormalize",
    layers: Iterable[int] | None = None,
    heads: Iterable[tuple[int, int]] | None = None,
    attention_mask: Tensor | None = None,
    batch_size: int | None = None,
    progress: bool = False,
) -> CapacitySweep:
    """Loss when each head (or each layer) alone keeps only its top-``N`` keys, for each ``N``.

    One replica per (``N``, head) or (``N``, layer), ``batch_size`` per forward (default: by
    memory budget), so the sweep takes ``⌈|N|·L·H / batch_size⌉`` forwards. ``layers`` /
    ``heads`` limit the sweep (the rest is NaN).

    Examples:
        >>> sweep = tl_geometry.capacity.capacity_sweep(model, tokens, (2, 8), by="head")    # doctest: +SKIP
        >>> sweep.loss_increase[0]     # [layer, head] at N = 2                       # doctest: +SKIP
    """
    values = check_n_values(n_values)
    _topn.check_sparsify_mode(mode)
    _check_batch_size(batch_size)
    progress = check_progress(progress)
    if by not in ("head", "layer"):
        raise ValueError(f"by must be 'head' or 'layer', got {by!r}.")
    if by == "layer" and heads is not None:
        raise ValueError('heads limits a by="head" sweep; a layer sweep takes layers.')
    tokens, n_layers, n_heads, scope = _scope(model, tokens, layers, heads)
    # A unit is a (layer, head) pair, or a (layer,) of a layer sweep.
    units = scope.nonzero() if by == "head" else scope.any(1).nonzero()
    one = torch.zeros(len(units), n_layers, n_heads, dtype=torch.bool)
    alone = (torch.arange(len(units)), *units.T)  # replica r sparsifies unit r alone
    one[alone] = True
    n = torch.tensor(values).repeat_interleave(len(units))
    dense, dense_windows, losses, per_window, metadata = _losses(
        model, tokens, n, one.repeat(len(values), 1, 1), mode, attention_mask, batch_size, progress,
        f"capacity per {by}", {"tokens_digest": token_digest(tokens, attention_mask), "replicas": len(n)})
    shape = (len(values), *scope.shape[:units.shape[1]])
    loss = torch.full(shape, math.nan, dtype=torch.float64)
    window_loss = torch.full((*shape, tokens.shape[0]), math.nan, dtype=torch.float64)
    at = (torch.arange(len(values)).repeat_interleave(len(units)), *units.repeat(len(values), 1).T)
    loss[at], window_loss[at] = losses, per_window
    return CapacitySweep(values, loss, dense, by, mode, metadata, window_loss, dense_windows.loss[0],
                         dense_windows.weight)
