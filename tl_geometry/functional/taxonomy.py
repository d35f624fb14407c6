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

from .dtypes import as_compute
from .heads import value_norms

#: The three votes of a query (SPEC §5), in vote-count order: its winner is the query itself,
#: the sink, or another key.
VOTES = ("current", "sink", "other")
#: The head classes, in the votes' order: a plurality of current votes makes a Retriever, of
#: sink votes a Mixer, of other votes a Reset.
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
    contrib = as_compute(alpha) * value_norms(as_compute(values))
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
    return torch.where(winner == query, CURRENT, torch.where(winner == sink, SINK, OTHER))


def vote_fractions(counts: Float[Tensor, "*batch 3"]) -> Float[Tensor, "*batch 3"]:
    """Vote counts → fractions (NaN where a head has no vote)."""
    counts = as_compute(counts)
    return counts / counts.sum(-1, keepdim=True)


def labels_from_votes(counts: Float[Tensor, "*batch 3"]) -> Int[Tensor, "*batch"]:
    """Plurality class index into :data:`CLASSES`; ties → Retriever > Mixer > Reset (argmax
    returns the first maximum); :data:`UNLABELLED` (−1) where a head has no vote (SPEC §5).

    >>> labels_from_votes(torch.tensor([[2., 2., 1.], [0., 0., 0.], [0., 1., 3.]])).tolist()
    [0, -1, 2]
    """
    counts = as_compute(counts)
    # NaN counts (a file that lacks votes) are no votes either; nan_to_num keeps argmax defined.
    counts = torch.nan_to_num(counts, nan=0.0)
    voted = counts.sum(-1) > 0
    return torch.where(voted, counts.argmax(-1), UNLABELLED)


#: Bootstrap resamples behind a label's stability (SPEC §5).
N_RESAMPLES = 200
#: The stability (share of resamples that keep a head's label) below which the label is
#: "unstable" (SPEC §5).
UNSTABLE_BELOW = 0.8
#: The fewest resampling units (sequences) that give a stability (SPEC §5): below it a bootstrap
#: says nothing (one sequence always "keeps" its label) and the stability is NaN.
MIN_UNITS = 8
#: How a stability withheld for lack of units is shown.
TOO_FEW_UNITS = "too few units"


def vote_margin(counts: Float[Tensor, "*batch 3"]) -> Float[Tensor, " *batch"]:
    """Largest vote fraction minus the second largest (SPEC §5); NaN for a head with no votes.

    >>> vote_margin(torch.tensor([[6., 3., 1.], [0., 0., 0.]])).tolist()
    [0.3, nan]
    """
    top2 = vote_fractions(counts).topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def bootstrap_resample_weights(
    n_sequences: int, n_resamples: int = N_RESAMPLES, seed: int = 0
) -> Float[Tensor, "resample sequence"]:
    """How many times each sequence is drawn in each bootstrap resample (SPEC §5): ``n_sequences``
    draws with replacement from a generator seeded with ``seed`` (the same on every machine).

    >>> w = bootstrap_resample_weights(4, 3, seed=0)
    >>> w.shape, w.sum(-1).tolist()
    (torch.Size([3, 4]), [4.0, 4.0, 4.0])
    """
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(n_sequences, (n_resamples, n_sequences), generator=generator)
    weights = torch.zeros(n_resamples, n_sequences, dtype=torch.float64)
    return weights.scatter_add_(1, draws, torch.ones_like(weights))


def bootstrap_stability(
    sequence_votes: Int[Tensor, "sequence *head 3"],
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
    labels: Int[Tensor, " *head"] | None = None,
) -> Float[Tensor, " *head"]:
    """Share of bootstrap resamples of the sequences (:func:`bootstrap_resample_weights`) whose
    plurality label (:func:`labels_from_votes`: a resample without votes counts as a change)
    equals ``labels`` (default: the label of all sequences), SPEC §5. NaN for a head with no
    votes, and for every head with fewer than :data:`MIN_UNITS` sequences ("too few units").

    >>> votes = torch.tensor([[[5, 0, 0]], [[4, 1, 0]], [[3, 2, 0]]] * 3)   # 9 sequences, 1 head
    >>> bootstrap_stability(votes).tolist()
    [1.0]
    >>> bootstrap_stability(votes[:3]).tolist()                            # 3 < 8: too few units
    [nan]
    """
    n_sequences = sequence_votes.shape[0]
    heads = sequence_votes.shape[1:-1]
    if n_sequences < MIN_UNITS:
        return torch.full(heads, torch.nan, dtype=torch.float64)
    full = labels_from_votes(sequence_votes.sum(0).to(torch.float64)) if labels is None else labels
    weights = bootstrap_resample_weights(n_sequences, n_resamples, seed)
    flat = sequence_votes.reshape(n_sequences, -1).to(torch.float64)
    totals = (weights @ flat).reshape(n_resamples, *heads, 3)  # exact: integer sums below 2^53
    same = (labels_from_votes(totals) == full).to(torch.float64).mean(0)
    return torch.where(full == UNLABELLED, torch.nan, same)
