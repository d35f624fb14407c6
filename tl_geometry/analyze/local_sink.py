"""The local sink of every head of a sliding-window layer, read where each front door holds the
layer's attention (ours; the definition is :mod:`tl_geometry.functional.local_sink`).

Only the column sums ``Σ_{t∈B} α[t, j]`` over the queries ``B`` beyond the sink's window read
attention, summed in float64 a block of queries at a time over the band of keys they see
(``O(T·w)`` per head): from the pattern's block, or from the block's rows recomputed from a
capture with the layer's own parameters. :class:`LocalSinks` keeps the figures per (sequence,
layer, head) and adds them to the :class:`~tl_geometry.result.HeadAnalysis`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..engine.block import PatternRows
from ..functional.attention import attention_rows
from ..functional.dtypes import COMPUTE_DTYPE
from ..functional.local_sink import (
    LOCAL_SINK_FIELDS,
    LocalSink,
    beyond_columns,
    beyond_window,
    local_sink_from_columns,
)
from ..result import HeadAnalysis
from .recompute import RecomputedRows

#: Bytes of float64 rows summed at once (one block of beyond queries over the keys they see):
#: small enough to stay in cache, as the recompute path's vote blocks
#: (:data:`~tl_geometry.analyze.recompute.VOTE_BLOCK_BYTES`).
BLOCK_BYTES = 1 << 22


def _beyond_columns(row_block: Any, beyond: Bool[Tensor, "batch pos"], n_heads: int, window: int,
                    device: Any) -> Float[Tensor, "batch head key"]:
    """``Σ_{t∈B} α[t, j]`` from ``row_block(t0, t1, lo)`` (the rows of queries ``t0 … t1 − 1``
    over the keys ``lo … t1 − 1``), a block of beyond queries at a time."""
    batch, n_pos = beyond.shape
    columns = torch.zeros(batch, n_heads, n_pos, dtype=COMPUTE_DTYPE, device=device)
    any_query = beyond.any(0).nonzero().flatten()
    if not len(any_query):
        return columns
    first, stop = int(any_query[0]), int(any_query[-1]) + 1
    # Queries per block: the largest q whose batch·head·q·(q + window − 1) float64 rows fit
    # BLOCK_BYTES, i.e. q² + (window − 1)·q ≤ budget.
    budget = BLOCK_BYTES // (8 * batch * n_heads)
    step = max(1, (math.isqrt((window - 1) ** 2 + 4 * budget) - (window - 1)) // 2)
    for t0 in range(first, stop, step):
        t1 = min(stop, t0 + step)
        lo = max(0, t0 - window + 1)  # the keys these queries can see
        columns[:, :, lo:t1] += beyond_columns(row_block(t0, t1, lo), beyond[:, t0:t1])
    return columns


def layer_local_sink(
    rows: Any,
    v: Float[Tensor, "batch pos kv d"],
    is_token: Bool[Tensor, "batch pos"],
    sink: Int[Tensor, " batch"],
    window: int,
    tokens: Int[Tensor, "batch pos"] | None,
) -> LocalSink:
    """The local sinks of one layer from a pattern (a tensor or
    :class:`~tl_geometry.engine.block.PatternRows`; zero outside each query's window, as the engine
    has checked) or from :class:`.recompute.RecomputedRows` (``v``: the capture's)."""
    beyond = beyond_window(is_token, sink.to(is_token.device), window)
    if isinstance(rows, RecomputedRows):
        q, k, key_mask = rows.capture.q, rows.capture.k, rows.key_mask

        def row_block(t0: int, t1: int, lo: int) -> Tensor:
            queries = torch.arange(t0 - lo, t1 - lo, device=q.device).expand(q.shape[0], -1)
            return attention_rows(q[:, lo:t1], k[:, lo:t1], queries, **rows.kwargs,
                                  key_mask=None if key_mask is None else key_mask[:, lo:t1])

        columns = _beyond_columns(row_block, beyond, q.shape[2], window, q.device)
    else:
        pattern = rows.pattern if isinstance(rows, PatternRows) else rows
        columns = _beyond_columns(lambda t0, t1, lo: pattern[:, :, t0:t1, lo:t1], beyond,
                                  pattern.shape[1], window, pattern.device)
    return local_sink_from_columns(columns, beyond, v, window=window, key_mask=is_token,
                                   tokens=tokens)


class LocalSinks:
    """The local sinks of an analysis, ``[sequence, local_field, layer, head]`` float64, NaN on
    global layers and where no query is beyond the window; nothing when no analysed layer has a
    window (``HeadAnalysis.local_sink`` is then ``None``)."""

    def __init__(self, windows: Sequence[int | None], n_sequences: int) -> None:
        self.windows = tuple(windows)
        self.n_sequences = n_sequences
        self.values: Tensor | None = None  # sized by the first layer's heads

    def _filled(self, n_heads: int, value: float) -> Tensor:
        """``[sequence, local_field, layer, head]`` float64 figures, all ``value``."""
        shape = (self.n_sequences, len(LOCAL_SINK_FIELDS), len(self.windows), n_heads)
        return torch.full(shape, value, dtype=COMPUTE_DTYPE)

    @property
    def active(self) -> bool:
        """Whether any analysed layer has a window."""
        return any(w is not None for w in self.windows)

    def add(self, li: int, offset: int, figures: LocalSink) -> None:
        """The figures ``[batch, head]`` of layer position ``li`` for sequences ``offset …``."""
        stacked = figures.stack().cpu()
        if self.values is None:
            self.values = self._filled(stacked.shape[2], torch.nan)
        self.values[offset:offset + stacked.shape[0], :, li] = stacked

    def all_reduce(self, lo: int, hi: int, n_heads: int, device: Any) -> None:
        """Every rank's sequences ``lo … hi − 1`` into every rank's figures (``torch.distributed``):
        each rank writes its own rows into zeros and the rows add up (a NaN stays NaN)."""
        import torch.distributed as dist

        if not self.active:
            return
        full = self._filled(n_heads, 0.0).to(device)
        if self.values is not None:
            full[lo:hi] = self.values[lo:hi].to(device)
        dist.all_reduce(full)
        self.values = full.cpu()

    def attach(self, result: HeadAnalysis) -> HeadAnalysis:
        """``result`` with its ``local_sink`` field (a new, checked analysis)."""
        if not self.active:
            return result
        # No sequence reached a local layer (an empty shard): NaN throughout.
        values = self._filled(result.n_heads, torch.nan) if self.values is None else self.values.clone()
        return dataclasses.replace(result, local_sink=values)
