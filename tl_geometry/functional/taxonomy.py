"""Parameter-free head taxonomy by source winner (SPEC §5).

For each query ``t`` after the sink, the winner is ``j* = argmax_{j∈T_t} α_j‖v_j‖`` (ties →
lower index). The vote is *current* if ``j* = t``, *sink* if ``j*`` is the sink, *other*
otherwise. A head's label is the plurality of its votes — Retriever (current), Mixer (sink),
Reset (other) — with ties resolved Retriever > Mixer > Reset. No threshold is fitted. A head
with no votes at all (no query ``t ≥ 1`` evaluated) has no label: index :data:`UNLABELLED` here,
``None`` (shown "unlabelled") in a :class:`~tl_geometry.HeadAnalysis`, never a Retriever.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ._types import _as_compute
from .heads import value_norms

VOTES = ("current", "sink", "other")
CLASSES = ("Retriever", "Mixer", "Reset")
CURRENT, SINK, OTHER = 0, 1, 2
#: Class index of a head with no votes (SPEC §5): no label, left out of class counts and shares.
UNLABELLED = -1
#: How an unlabelled head is shown in text, tables' hover and legends.
UNLABELLED_NAME = "unlabelled"


def source_winners(
    alpha: Float[Tensor, "*abatch key"],
    values: Float[Tensor, "*vbatch key d"],
    key_mask: Bool[Tensor, "*mbatch key"],
) -> Int[Tensor, "*batch"]:
    """Index of the key with the largest contribution norm ``α_j‖v_j‖`` per row (ties → lower)."""
    contrib = _as_compute(alpha) * value_norms(_as_compute(values))
    # Norms are ≥ 0, so -1 never wins; argmax returns the first maximum (the lower index).
    return torch.where(key_mask, contrib, -1.0).argmax(-1)


def source_votes(
    alpha: Float[Tensor, "*abatch key"],
    values: Float[Tensor, "*vbatch key d"],
    key_mask: Bool[Tensor, "*mbatch key"],
    query: Int[Tensor, "*qbatch"],
    sink: Int[Tensor, "*ibatch"],
) -> Int[Tensor, "*batch"]:
    """Vote of each row: 0 = current (winner is the query itself), 1 = sink, 2 = other (SPEC §5).

    >>> a = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.2, 0.7]])
    >>> source_votes(a, torch.ones(3, 2), torch.ones(2, 3, dtype=torch.bool).tril(1),
    ...              torch.tensor([1, 2]), torch.tensor(0)).tolist()
    [1, 0]
    """
    winner = source_winners(alpha, values, key_mask)
    return torch.where(
        winner == query, CURRENT, torch.where(winner == sink, SINK, OTHER)
    )


def vote_fractions(counts: Float[Tensor, "*batch 3"]) -> Float[Tensor, "*batch 3"]:
    """Vote counts → fractions (NaN where a head has no vote)."""
    counts = _as_compute(counts)
    return counts / counts.sum(-1, keepdim=True)


def labels_from_votes(counts: Float[Tensor, "*batch 3"]) -> Int[Tensor, "*batch"]:
    """Plurality class index into :data:`CLASSES`; ties → Retriever > Mixer > Reset (argmax
    returns the first maximum). :data:`UNLABELLED` (−1) where a head has no vote at all (SPEC §5):
    all-zero counts would otherwise "tie" and read as a Retriever.

    >>> labels_from_votes(torch.tensor([[2., 2., 1.], [0., 0., 0.], [0., 1., 3.]])).tolist()
    [0, -1, 2]
    """
    counts = _as_compute(counts)
    # NaN counts (a file that lacks votes) are no votes either; nan_to_num keeps argmax defined.
    counts = torch.nan_to_num(counts, nan=0.0)
    voted = counts.sum(-1) > 0
    return torch.where(voted, counts.argmax(-1), UNLABELLED)
