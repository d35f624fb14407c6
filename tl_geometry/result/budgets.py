"""Certified top-N budgets of every head from an analysis (SPEC §10, ours): on at least 90 % of
the analysed queries, keeping a head's top ``k_ε`` keys and renormalising moves its attention by at
most ``ε`` in total variation (and so does any larger ``N``).
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Int
from torch import Tensor

from .protocol import AnalysisLike

#: The default ε of :func:`truncation_budgets` (SPEC §10).
DEFAULT_EPS = 0.05
#: The budget of a head that no analysed ``N`` certifies: keep every key (a per-head policy
#: leaves such a head dense).
NO_BUDGET = 0


def truncation_budgets(result: AnalysisLike, eps: float = DEFAULT_EPS) -> Int[Tensor, "layer head"]:
    """Per head, the certified budget ``k_ε``: the smallest analysed ``N`` whose 90th-percentile
    tail mass ``τ_N`` (:meth:`~tl_geometry.HeadAnalysis.truncation_percentile`) is ``≤ eps``
    (SPEC §10), int64 ``[layer, head]``; :data:`NO_BUDGET` (0) where none is. Raises
    ``ValueError`` for an ``eps`` outside ``[0, 1]`` and for a result without percentiles (a file
    of format 4 or earlier).

    >>> budgets = tl_geometry.truncation_budgets(result, eps=0.05)      # doctest: +SKIP
    >>> policy = tl_geometry.capacity.TopNPolicy(budgets)   # every layer analysed  # doctest: +SKIP
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and 0 <= eps <= 1):
        raise ValueError(f"eps must be a tail mass in [0, 1], e.g. 0.05, got {eps!r}.")
    if result.truncation_p90 is None:
        raise ValueError("this result has no truncation percentiles (a file of format 4 or earlier); "
                         "run analyze_heads / analyze_model again to compute them.")
    tail = result.truncation_percentile("tail_mass")  # [layer, head, n]
    order = torch.argsort(result.n_values)
    ns, tail = result.n_values[order], tail[..., order]
    certified = tail <= eps  # NaN compares False: an undefined N certifies nothing
    first = certified.to(torch.int8).argmax(-1)  # first True along the ascending N
    return torch.where(certified.any(-1), ns[first], NO_BUDGET).to(torch.int64)
