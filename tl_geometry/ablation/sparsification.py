"""Structured sparsification: keep a fraction of heads, remove the rest by an order (SPEC §7)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..forward import hooks as _forward
from ..functional.uncertainty import paired_window_se
from . import hooks as _hooks
from .hooks import ablated_losses, positive_int, prepare_ablation
from .orderings import Ordering

#: Fractions of heads kept at which ``sparsification_curve`` measures the loss by default.
DEFAULT_RETENTION = (1.0, 0.9, 0.75, 0.5, 0.25)
COLUMNS = ("ordering", "seed", "retention", "n_removed", "loss", "perplexity", "loss_increase",
           "loss_increase_se")


def check_retention(retention: Any) -> tuple[float, ...]:
    """Fractions of heads to keep: numbers in ``[0, 1]``, each once (a repeat would run the same
    setting twice and print it as two rows)."""
    if isinstance(retention, (str, bytes)) or not isinstance(retention, Iterable) or any(
            isinstance(r, bool) or not isinstance(r, (int, float)) for r in retention):
        raise ValueError(f"retention must be fractions of heads kept, e.g. (1.0, 0.5), got {retention!r}.")
    values = tuple(float(r) for r in retention)
    if not values or any(not 0.0 <= r <= 1.0 for r in values):  # NaN fails too
        raise ValueError(f"retention must be fractions in [0, 1], got {values}.")
    if len(set(values)) != len(values):
        raise ValueError(f"retention lists a fraction twice: {values}; give each once.")
    return values


def heads_kept(retention: float, n_total: int) -> int:
    """``round(r · n_total)`` with halves rounded up: ``⌊r · n_total + 1/2⌋`` heads are kept."""
    return math.floor(retention * n_total + 0.5)


@dataclass
class SparsificationCurve:
    """Loss and perplexity after removing the first heads of each order, per retention.

    ``rows``: one dict per (ordering, seed, retention) with the keys of :data:`COLUMNS`, where
    ``loss_increase_se`` is the paired SE over windows (SPEC §7, ours; NaN with < 2 windows, 0
    for a row that removes nothing). ``window_loss[i, b]``: row ``i``'s loss on window ``b``;
    ``base_window_loss[b]``, ``window_weight[b]``: the dense loss and valid predictions there.
    """

    rows: list[dict[str, Any]]
    base_loss: float
    mode: str = "zero"
    metadata: dict[str, Any] = field(default_factory=dict)
    window_loss: Tensor | None = None
    base_window_loss: Tensor | None = None
    window_weight: Tensor | None = None

    def to_pandas(self):
        """The :data:`COLUMNS`; seed is <NA> for deterministic orders."""
        import pandas as pd

        table = pd.DataFrame(self.rows, columns=list(COLUMNS))
        table["seed"] = table["seed"].astype("Int64")
        return table

    def summary(self):
        """Loss per ordering (rows) and retention (columns); random orders as mean ± std."""
        table = self.to_pandas()
        grouped = table.groupby(["ordering", "retention"], sort=False)["loss"]
        stats = grouped.agg(["mean", "std", "count"]).reset_index()
        stats["cell"] = [
            f"{m:.3f}" if c == 1 else f"{m:.3f} ± {0.0 if math.isnan(s) else s:.3f}"
            for m, s, c in zip(stats["mean"], stats["std"], stats["count"])
        ]
        return stats.pivot(index="ordering", columns="retention", values="cell").loc[
            list(dict.fromkeys(table["ordering"])), sorted(set(table["retention"]), reverse=True)
        ]

    def plot(self, ax: Any = None):
        """Loss against retention, one line per ordering; random as mean ± std
        (:func:`tl_geometry.views.plots.sparsification_plot`)."""
        from ..views.plots import sparsification_plot

        return sparsification_plot(self, ax)


def _as_orderings(orders: Any) -> list[Ordering]:
    if isinstance(orders, Ordering):
        return [orders]
    if isinstance(orders, Mapping):
        return [Ordering(str(name), tuple(map(tuple, heads))) for name, heads in orders.items()]
    if isinstance(orders, Sequence) and orders and all(isinstance(o, Ordering) for o in orders):
        return list(orders)
    if isinstance(orders, (Sequence, Tensor)):  # one bare order of (layer, head) pairs
        return [Ordering("custom", tuple(map(tuple, orders.tolist() if isinstance(orders, Tensor) else orders)))]
    raise ValueError("order must be an Ordering, a list of them, a dict {name: [(layer, head), ...]}, "
                     "or one list of (layer, head) pairs.")


def _order_index(order: Ordering, n_layers: int, n_heads: int) -> Int[Tensor, " k"]:
    """Flat head indices of a full removal order, checked to be a permutation of all heads."""
    pairs = torch.tensor(order.heads, dtype=torch.long).reshape(-1, 2)
    if len(pairs) != n_layers * n_heads:
        raise ValueError(f"Ordering {order.name!r} lists {len(pairs)} heads; a removal order must "
                         f"list all {n_layers} × {n_heads} = {n_layers * n_heads} heads once.")
    # head_mask names the first out-of-range or repeated pair.
    _forward.head_mask([tuple(p) for p in pairs.tolist()], n_layers, n_heads)
    return pairs[:, 0] * n_heads + pairs[:, 1]


def sparsification_curve(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    order: Any,
    retention: Sequence[float] = DEFAULT_RETENTION,
    *,
    mode: _hooks.Mode = "zero",
    attention_mask: Tensor | None = None,
    reference_tokens: Tensor | None = None,
    reference_attention_mask: Tensor | None = None,
    batch_size: int | None = None,
    progress: bool = True,
) -> SparsificationCurve:
    """Loss and perplexity on ``tokens`` when only ``round(r·L·H)`` heads are kept (SPEC §7).

    For each order (an :class:`Ordering` or list of them, a dict ``{name: [(layer, head), ...]}``
    or one full list of pairs) and retention ``r``, the first ``L·H − ⌊r·L·H + ½⌋`` heads of the
    order are ablated together (zeroed, or with ``mode="mean"`` at their mean over
    ``reference_tokens``, default ``tokens``) and ``loss`` and ``perplexity = exp(loss)`` are
    measured on ``tokens``, held out from the orders' text; ``r = 1`` gives exactly the model's
    own loss. Settings are stacked ``batch_size`` per forward (default: by memory budget).

    Examples:
        >>> curve = tl_geometry.ablation.sparsification_curve(model, held_out, orders)  # doctest: +SKIP
        >>> curve.summary()                                                     # doctest: +SKIP
    """
    tokens, n_layers, n_heads, progress = prepare_ablation(
        model, tokens, mode, reference_tokens, reference_attention_mask, progress)
    retention = check_retention(retention)
    positive_int("batch_size", batch_size, allow_none=True)
    orders = _as_orderings(order)
    n_total = n_layers * n_heads
    start = time.perf_counter()
    # One removal mask per (order, retention) that removes something.
    rows: list[dict[str, Any]] = []
    masks: list[Tensor] = []
    for ordering in orders:
        flat = _order_index(ordering, n_layers, n_heads)
        for r in retention:
            n_removed = n_total - heads_kept(r, n_total)
            rows.append({"ordering": ordering.name, "seed": ordering.seed, "retention": r,
                         "n_removed": n_removed})
            if n_removed:
                mask = torch.zeros(n_total, dtype=torch.bool)
                mask[flat[:n_removed]] = True
                masks.append(mask.reshape(n_layers, n_heads))
    remove = torch.stack(masks) if masks else torch.zeros(0, n_layers, n_heads, dtype=torch.bool)
    base, dense, windows = ablated_losses(
        model, tokens, remove, mode, attention_mask=attention_mask, reference_tokens=reference_tokens,
        reference_attention_mask=reference_attention_mask, per_forward=batch_size, progress=progress,
        label="sparsification", unit="setting")
    ablated: Iterator[tuple[float, Tensor, float]] = iter(())
    if windows is not None:
        se = paired_window_se(windows.loss - dense.loss, dense.weight)
        ablated = iter(zip(windows.total.tolist(), windows.loss, se.tolist()))
    window_loss = []
    for row in rows:
        # Retention 1 removes nothing: the model's own loss, exactly, and no change to err on.
        loss, per_window, se_row = next(ablated) if row["n_removed"] else (base, dense.loss[0], 0.0)
        row.update(loss=loss, perplexity=math.exp(loss), loss_increase=loss - base, loss_increase_se=se_row)
        window_loss.append(per_window)
    metadata = {"tokens": list(tokens.shape), "n_heads_total": n_total, "forwards_of_settings": len(masks),
                "seconds": time.perf_counter() - start, "masked": attention_mask is not None}
    return SparsificationCurve(rows, base, mode, metadata, torch.stack(window_loss), dense.loss[0],
                               dense.weight)
