"""Selections of keys: top-N by attention (ties → lower index) and nested random subsets.

SPEC §2–3. A selection is encoded by *ranks*: ``rank[i] < N`` means key ``i`` is in the size-N
set, so one rank tensor encodes the nested sets for every ``N``. Invalid keys rank last.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


def inverse_permutation(order: Int[Tensor, "*batch key"]) -> Int[Tensor, "*batch key"]:
    """The rank of every key in ``order`` (a permutation along the last axis):
    ``ranks[..., order[..., r]] = r``. ``inverse_permutation(torch.tensor([2, 0, 1]))`` is
    ``tensor([1, 2, 0])``."""
    ranks = torch.empty_like(order)
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return ranks.scatter_(-1, order, positions)


def top_n_ranks(
    scores: Float[Tensor, "*sbatch key"], key_mask: Bool[Tensor, "*mbatch key"] | None = None
) -> Int[Tensor, "*batch key"]:
    """Rank of every key by decreasing score (``α``, or ``α_i‖v_i‖`` for the variant ranking of
    SPEC §2); ties go to the lower index; invalid keys last. ``top_n_ranks(α) < N`` is ``S_N``.

    >>> top_n_ranks(torch.tensor([0.2, 0.4, 0.2, 0.2])).tolist()
    [1, 0, 2, 3]
    """
    if key_mask is not None:
        scores = torch.where(key_mask, scores, -torch.inf)
    # A stable descending sort keeps equal scores in index order: the lower index wins a tie.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return inverse_permutation(order)


def top_n_mask(
    scores: Float[Tensor, "*sbatch key"],
    n: int,
    key_mask: Bool[Tensor, "*mbatch key"] | None = None,
) -> Bool[Tensor, "*batch key"]:
    """The top-``n`` keys of every row (SPEC §2): largest scores, ties → lower index, valid only.

    A row with fewer than ``n`` valid keys selects all of them; metrics treat such an ``n`` as
    out of range (NaN), never as a smaller ``n``.

    >>> top_n_mask(torch.tensor([0.1, 0.3, 0.3, 0.3]), 2).tolist()
    [False, True, True, False]
    """
    selected = top_n_ranks(scores, key_mask) < n
    return selected if key_mask is None else selected & key_mask


def random_ranks(
    key_mask: Bool[Tensor, "*batch key"], samples: int, generator: torch.Generator
) -> Int[Tensor, "*batch sample key"]:
    """Ranks under ``samples`` independent uniformly random permutations of each row's valid keys
    (SPEC §3's random baseline): ``random_ranks(...) < N`` is a uniformly random N-subset, nested
    in ``N`` within one permutation; the same generator state gives the same ranks."""
    if samples < 1:
        raise ValueError(f"random_samples must be at least 1, got {samples}.")
    shape = (*key_mask.shape[:-1], samples, key_mask.shape[-1])
    # float64 draws: float32 ties are common on long rows, and argsort is not stable.
    keys = torch.rand(shape, generator=generator, device=key_mask.device, dtype=torch.float64)
    # Invalid keys get a key above every uniform draw, so they sort after all valid ones.
    keys = torch.where(key_mask.unsqueeze(-2), keys, 2.0)
    return inverse_permutation(keys.argsort(dim=-1))
