"""The paired sink effect (SPEC §3, comparison 3; ours): per head and N, over the instances whose
top-N set holds the sink, the ratio ``F_N(with sink) / F_N(sink removed)`` of each instance.

Per head: the median ratio, the fraction of ratios ≤ 1/2 (the paper's "halves F_N", an exact
count) and the number of instances (both F = 0: no ratio, left out). A median does not add
across batches, so the engine keeps a histogram of ``log₂ ratio`` (ours): bins of 1/32 octave
centred on ``k/32`` (ratios 2⁻¹⁶ … 2¹⁶, beyond in the end bins), one bin for ratio 0 and one for
+∞; the median reported is the centre of the bin holding the lower median, within 1/64 octave
(±1.1 %) of it and exactly 1 when that ratio is 1.
"""

from __future__ import annotations

import torch
from einops import reduce
from jaxtyping import Bool, Float
from torch import Tensor

from ..functional.dtypes import COMPUTE_DTYPE

#: Bins per octave of the ratio histogram, and the octaves covered each side of ratio 1.
BINS_PER_OCTAVE = 32
OCTAVES = 16
_FINITE = 2 * BINS_PER_OCTAVE * OCTAVES + 1
#: Histogram length: ratio 0, the finite bins, ratio +∞.
N_BINS = _FINITE + 2


def paired_counts(
    with_sink: Float[Tensor, "batch head query n"],
    removed: Float[Tensor, "batch head query n"],
    sink_in_top: Bool[Tensor, "batch head query n"],
) -> tuple[Float[Tensor, "head n bin"], Float[Tensor, "head n"]]:
    """Ratio histogram ``[head, n, N_BINS]`` and count of ratios ≤ 1/2 ``[head, n]`` of one batch."""
    ratio = with_sink / removed  # +inf where only the sink-removed F is 0; NaN where both are
    paired = sink_in_top & torch.isfinite(with_sink) & torch.isfinite(removed) & ~torch.isnan(ratio)
    finite = torch.clamp(torch.round(torch.log2(ratio) * BINS_PER_OCTAVE),
                         -BINS_PER_OCTAVE * OCTAVES, BINS_PER_OCTAVE * OCTAVES)
    index = torch.where(ratio == 0, 0, torch.where(torch.isinf(ratio), N_BINS - 1,
                                                   1 + BINS_PER_OCTAVE * OCTAVES + torch.nan_to_num(finite)))
    n_heads, n_sizes = sink_in_top.shape[1], sink_in_top.shape[-1]
    cell = (torch.arange(n_heads, device=sink_in_top.device)[:, None, None] * n_sizes
            + torch.arange(n_sizes, device=sink_in_top.device)) * N_BINS  # [head, 1, n]
    flat = (cell + index.long())[paired]
    hist = torch.bincount(flat, minlength=n_heads * n_sizes * N_BINS).to(COMPUTE_DTYPE)
    halved = reduce((paired & (ratio <= 0.5)).to(COMPUTE_DTYPE), "b h q n -> h n", "sum")
    return hist.reshape(n_heads, n_sizes, N_BINS), halved


def paired_figures(
    hist: Float[Tensor, "*head n bin"], halved: Float[Tensor, "*head n"]
) -> Float[Tensor, "field *head n"]:
    """``(ratio, halved, count)`` (:data:`~tl_geometry.result.schema.PAIRED_FIELDS`) from the
    summed histograms; the ratio and fraction are NaN where the count is 0.

    >>> h = torch.zeros(1, N_BINS); h[0, 1 + 16 * 32] = 3  # three ratios of exactly 1
    >>> paired_figures(h, torch.zeros(1)).squeeze(-1).tolist()
    [1.0, 0.0, 3.0]
    """
    count = hist.sum(-1)
    rank = torch.ceil(count / 2).clamp_min(1)  # the lower median
    # The first bin whose running count reaches the rank (counts are ≥ 0: the sums ascend).
    index = torch.searchsorted(hist.cumsum(-1), rank[..., None]).squeeze(-1).clamp_max(N_BINS - 1)
    centre = torch.exp2((index - 1 - BINS_PER_OCTAVE * OCTAVES).to(COMPUTE_DTYPE) / BINS_PER_OCTAVE)
    median = torch.where(index == 0, 0.0, torch.where(index == N_BINS - 1, torch.inf, centre))
    defined = count > 0
    return torch.stack([torch.where(defined, median, torch.nan),
                        torch.where(defined, halved / count, torch.nan), count])
