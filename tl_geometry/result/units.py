"""The statistical unit of a per-head quantity (SPEC §4, ours): under GQA or MQA a value-only
quantity (κ, ``c_sink``, ``cos(v_sink, mean v)``, the regime diagnostics) is one measurement per
KV group (:func:`kv_reduce`); one that reads ``α``, or any in output space
(``y_i = α_i v_i W_O[h]``), is per query head.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..functional.regime import REGIME_FIELDS
from .protocol import AnalysisLike

#: Sink figures (SPEC §4) that read only the values: identical inside a KV group in value space.
VALUE_ONLY_SINK_FIELDS: tuple[str, ...] = ("norm_ratio", "cosine", "mean_cosine")
#: Every regime diagnostic (SPEC §6c) reads only the values.
VALUE_ONLY_REGIME_FIELDS: tuple[str, ...] = tuple(REGIME_FIELDS)
#: Relative and absolute tolerance of "identical inside a KV group" (the engine computes each
#: query head's copy of a group figure from the same values; float32 rounding stays far below).
RTOL, ATOL = 1e-5, 1e-7


def value_only_names() -> tuple[str, ...]:
    """Names of the value-only quantities (keys of ``HeadAnalysis.quantities()``)."""
    return (tuple(f"sink_{f}" for f in VALUE_ONLY_SINK_FIELDS)
            + tuple(f"regime_{f}" for f in VALUE_ONLY_REGIME_FIELDS))


def _same_in_groups(values: Tensor, group: int) -> bool:
    """Whether ``values [layer, head, ...]`` agree inside every run of ``group`` consecutive heads
    (NaN agrees with NaN)."""
    n_layers, n_heads = values.shape[:2]
    x = values.double().reshape(n_layers, n_heads // group, group, *values.shape[2:])
    first = x[:, :, :1]
    close = torch.isclose(x, first.expand_as(x), rtol=RTOL, atol=ATOL, equal_nan=True)
    return bool(close.all())


def kv_group_size(result: AnalysisLike) -> int:
    """Query heads per statistical unit of a value-only quantity: ``n_heads // n_kv_heads`` in
    value space, 1 in output space (values are per query head there). From
    ``metadata["n_kv_heads"]`` when recorded, else the largest divisor of ``n_heads`` inside
    whose runs of query heads every value-only figure is identical (1 when none is finite)."""
    meta: dict[str, Any] = result.metadata
    if meta.get("space", "value") == "output":
        return 1
    n_kv = meta.get("n_kv_heads")
    n_heads = result.n_heads
    if isinstance(n_kv, int) and not isinstance(n_kv, bool) and n_kv > 0 and n_heads % n_kv == 0:
        return n_heads // n_kv
    tensors = [result.sink_diagnostic(f) for f in VALUE_ONLY_SINK_FIELDS]
    if getattr(result, "regime", None) is not None:
        tensors += [result.regime_diagnostic(f) for f in VALUE_ONLY_REGIME_FIELDS]
    if not any(bool(t.isfinite().any()) for t in tensors):
        return 1
    for g in sorted((d for d in range(2, n_heads + 1) if n_heads % d == 0), reverse=True):
        if all(_same_in_groups(t, g) for t in tensors):
            return g
    return 1


def kv_reduce(values: Float[Tensor, "layer head *rest"], group: int, name: str = "values"
              ) -> Float[Tensor, "layer kv *rest"]:
    """``[layer, head, ...]`` → ``[layer, kv, ...]``: one entry per KV group of ``group``
    consecutive query heads (query head ``h`` reads KV head ``h // group``, SPEC §1).

    Raises ``ValueError`` when the entries of a group differ (beyond float rounding): the
    quantity reads more than the values and its unit is the query head.
    """
    if values.ndim < 2 or group < 1 or values.shape[1] % group:
        raise ValueError(f"{name} must be [layer, head, ...] with a head axis divisible by the "
                         f"group size {group}, got {tuple(values.shape)}.")
    if not _same_in_groups(values, group):
        raise ValueError(
            f"{name} differs between query heads of one KV group (groups of {group}): it is not a "
            "value-only quantity, so its statistical unit is the query head. Use it per query "
            "head, or pass a value-only figure (κ, c_sink, cos(v_sink, mean v), regime)."
        )
    return values[:, ::group]


def unit_text(result: AnalysisLike) -> str:
    """``"90 KV heads"`` (value space under GQA/MQA) or ``"270 heads"`` (one unit per query
    head): how many measurements a value-only count, median or share is over."""
    group = kv_group_size(result)
    n = result.n_layers * (result.n_heads // group)
    return f"{n} KV heads" if group > 1 else f"{n} heads"


def kv_heads_table(result: AnalysisLike):
    """One row per (layer, KV head): ``layer, kv_head, query_heads`` (``"3-5"``) and every
    value-only figure (:func:`value_only_names`), each checked identical inside the group
    (:func:`kv_reduce`): the rows to count value-only figures over (SPEC §4)."""
    import pandas as pd

    group = kv_group_size(result)
    n_kv = result.n_heads // group
    columns: dict[str, Any] = {
        "layer": torch.tensor(result.layers).repeat_interleave(n_kv).numpy(),
        "kv_head": torch.arange(n_kv).repeat(result.n_layers).numpy(),
        "query_heads": [f"{k * group}-{(k + 1) * group - 1}" if group > 1 else str(k)
                        for _ in result.layers for k in range(n_kv)],
    }
    quantities = result.quantities()
    for name in value_only_names():
        if name in quantities:
            columns[name] = kv_reduce(quantities[name][0], group, name).flatten().double().numpy()
    return pd.DataFrame(columns)
