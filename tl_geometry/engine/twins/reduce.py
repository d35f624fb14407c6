"""The reduction of one layer's per-query rows in torch: the twin of :mod:`..compiled.reduce`."""

from __future__ import annotations

import torch
from einops import reduce
from torch import Tensor

from ...functional.dtypes import COMPUTE_DTYPE
from ..layout import F_SCORE, SINK_REMOVED, TOP_GROUP, TRUNCATION, Reduced
from ..paired import paired_counts


def reduce_rows(metrics: Tensor, sink_in_top: Tensor, sink_fields: Tensor, sees_sink: Tensor) -> Reduced:
    """:class:`..layout.Reduced` with torch operations (any device). Instances whose query does
    not see the sink (``sees_sink [b, q]`` False) are in neither sink group."""
    top = metrics[:, :, :, TOP_GROUP]  # [b, h, q, n, metric]
    defined = torch.isfinite(top[..., 0]) & sees_sink[:, None, :, None]
    groups = torch.stack([sink_in_top & defined, ~sink_in_top & defined], dim=2)  # [b, h, 2, q, n]
    inst_count = reduce(groups.to(COMPUTE_DTYPE), "b h io q n -> h io n", "sum")
    # SPEC §3's metrics and the truncation figures are summed apart, each part laid out as a
    # tensor of its own: torch's reductions may order their sums by the layout, and the first
    # part's sums stay what they were before the truncation figures joined it.
    parts = [metrics[..., : TRUNCATION.start].contiguous(), metrics[..., TRUNCATION].contiguous()]
    inst_sum = torch.cat([reduce(torch.where(groups[..., None], part[:, :, None, :, TOP_GROUP], 0.0),
                                 "b h io q n m -> h io n m", "sum") for part in parts], dim=-1)
    removed = metrics[:, :, :, SINK_REMOVED, :, F_SCORE]
    paired_hist, paired_halved = paired_counts(top[..., F_SCORE], removed, sink_in_top)
    # nanmean: ±inf kept (κ = ∞ is a value), NaN where no query is defined.
    seq_mean = torch.cat([torch.nanmean(part, dim=2) for part in parts], dim=-1)
    return Reduced(seq_mean, inst_sum, inst_count, paired_hist, paired_halved, torch.nanmean(sink_fields, dim=2))
