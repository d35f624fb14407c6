"""Independent head scores from attention patterns alone (SPEC §9; ours).

These are the scores other tools use to name heads (TransformerLens ``head_detector``'s
previous-token, duplicate-token and induction patterns, the attention-sink rate of Gu et al.,
ICLR 2025, and a retrieval score after Wu et al., 2024), each read from ``hook_pattern``
``[batch, head, query, key]`` as a plain mean weight (or argmax share) on an expected key. They
let the taxonomy (SPEC §5) be checked against labels others use.

Sequence layouts: a *repeated* sequence is ``R`` tokens and the same ``R`` tokens again, after
BOS where the model was trained with one (SPEC §1): the first copy starts at ``start`` (1 after
BOS, else 0), so the copies sit at ``start … start+R−1`` and ``start+R … start+2R−1``; a
*retrieval* sequence is a text window with a needle inserted and the needle's first tokens
repeated at its end (:func:`retrieval_layout`).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

#: The columns of a head-score table, in order (SPEC §9).
SCORE_NAMES = ("previous_token", "duplicate_token", "induction", "sink_rate", "retrieval")
#: The sink-rate threshold ε of Sink^ε (Gu et al., ICLR 2025; SPEC §9).
SINK_EPSILON = 0.3
#: Repeated-sequence half length, needle length and the number of needle tokens repeated (SPEC §9).
REPEAT_LENGTH, NEEDLE_LENGTH, NEEDLE_REPEATED = 32, 32, 16


def mean_weight(
    pattern: Float[Tensor, "batch head query key"],
    queries: Int[Tensor, " q"],
    keys: Int[Tensor, " q"],
) -> Float[Tensor, " head"]:
    """Mean over sequences and the given queries of ``α[query, key]``, per head (float64).

    >>> p = torch.eye(3)[None, None]            # every query attends to itself
    >>> mean_weight(p, torch.tensor([1, 2]), torch.tensor([1, 1])).tolist()
    [0.5]
    """
    weights = pattern[:, :, queries, keys]  # [batch, head, q]: advanced indexing pairs them
    return weights.double().mean(dim=(0, 2))


def previous_token_score(pattern: Float[Tensor, "batch head pos pos"], start: int = 1) -> Float[Tensor, " head"]:
    """Mean of ``α[t, t−1]`` over the queries after the repeated sequence's first token,
    ``t = start+1 … T−1`` (SPEC §9): ``2 … 2R`` after BOS (``start = 1``), ``1 … 2R−1``
    without it (``start = 0``)."""
    t = torch.arange(_start(start) + 1, pattern.shape[-2], device=pattern.device)
    return mean_weight(pattern, t, t - 1)


def duplicate_token_score(
    pattern: Float[Tensor, "batch head pos pos"], repeat: int, start: int = 1
) -> Float[Tensor, " head"]:
    """Mean of ``α[t, t−R]`` over the second copy ``t = start+R … start+2R−1`` of a repeated
    sequence (SPEC §9): attention to the earlier occurrence of the current token."""
    t = _second_copy(pattern, repeat, start)
    return mean_weight(pattern, t, t - repeat)


def induction_score(
    pattern: Float[Tensor, "batch head pos pos"], repeat: int, start: int = 1
) -> Float[Tensor, " head"]:
    """Mean of ``α[t, t−R+1]`` over the second copy ``t = start+R … start+2R−1`` (SPEC §9):
    attention to the token right after the earlier occurrence of the current token."""
    t = _second_copy(pattern, repeat, start)
    return mean_weight(pattern, t, t - repeat + 1)


def sink_rate(pattern: Float[Tensor, "batch head pos pos"]) -> Float[Tensor, " head"]:
    """Mean over queries ``t ≥ 1`` of the first token's weight ``α[t, 0]`` (SPEC §9)."""
    t = torch.arange(1, pattern.shape[-2], device=pattern.device)
    return mean_weight(pattern, t, torch.zeros_like(t))


def sink_epsilon(rates: Float[Tensor, ...], epsilon: float = SINK_EPSILON) -> float:
    """Sink^ε of a model: the share of its heads with ``sink_rate > ε`` (Gu et al.; SPEC §9).

    >>> sink_epsilon(torch.tensor([0.1, 0.5, 0.9, 0.3]))
    0.5
    """
    return float((rates > epsilon).double().mean())


def retrieval_layout(
    window_length: int, needle: int = NEEDLE_LENGTH, repeated: int = NEEDLE_REPEATED
) -> tuple[int, Int[Tensor, " q"], Int[Tensor, " q"]]:
    """Positions of a retrieval sequence (SPEC §9) built from a ``window_length``-token window
    (BOS included, where the window has one): the needle starts at
    ``start = 1 + (window_length − 1) // 2`` (the middle of the text), the repeated needle
    tokens sit at the last ``repeated`` positions. Returns ``(start, queries, keys)``: query
    ``window_length + needle + k`` (after the window, the needle and ``k`` repeats) holds
    needle token ``k``; its expected key ``start + k + 1`` is the position right after that
    token's earlier occurrence (the source of the token being predicted).

    >>> start, q, k = retrieval_layout(64)
    >>> start, q[:2].tolist(), k[:2].tolist()
    (32, [96, 97], [33, 34])
    """
    start = 1 + (window_length - 1) // 2
    k = torch.arange(repeated)
    queries = window_length + needle + k
    return start, queries, start + k + 1


def argmax_share(
    pattern: Float[Tensor, "batch head query key"],
    queries: Int[Tensor, " q"],
    keys: Int[Tensor, " q"],
) -> Float[Tensor, " head"]:
    """Share of (sequence, query) whose argmax key (ties → lower index) is the expected key."""
    winners = pattern[:, :, queries].argmax(-1)  # [batch, head, q]
    return (winners == keys.to(winners.device)).double().mean(dim=(0, 2))


def _start(start: int) -> int:
    if start not in (0, 1) or isinstance(start, bool):
        raise ValueError(f"start is where the repeated tokens begin: 1 after BOS, 0 without it; "
                         f"got {start!r}.")
    return start


def _second_copy(pattern: Tensor, repeat: int, start: int = 1) -> Tensor:
    start = _start(start)
    if pattern.shape[-2] != start + 2 * repeat:
        layout = "BOS + 2R" if start else "2R, no BOS"
        raise ValueError(f"a repeated sequence of R = {repeat} has {start + 2 * repeat} positions "
                         f"({layout}); this pattern has {pattern.shape[-2]}.")
    return torch.arange(start + repeat, start + 2 * repeat, device=pattern.device)
