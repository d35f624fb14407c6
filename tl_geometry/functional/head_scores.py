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

Sliding-window layers (SPEC §1, ours): query ``t`` of a layer with window ``w`` sees the keys
``t − w < i ≤ t``. Every score takes the layer's ``window`` (``None``: global) and reads only the
(query, expected key) pairs where the query sees the key; a score with no such pair is NaN.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

#: The columns of a head-score table, in order (SPEC §9).
SCORE_NAMES = ("previous_token", "duplicate_token", "induction", "sink_rate", "retrieval")
#: The sink-rate threshold ε of Sink^ε (Gu et al., ICLR 2025; SPEC §9).
SINK_EPSILON = 0.3
#: Repeated-sequence half length R (the default), needle length and the number of needle tokens
#: repeated (SPEC §9).
REPEAT_LENGTH, NEEDLE_LENGTH, NEEDLE_REPEATED = 32, 32, 16
#: The length of the text windows Sink^ε is read on (Gu et al., ICLR 2025; SPEC §9).
SINK_EPSILON_LENGTH = 64


def visible(queries: Int[Tensor, " q"], keys: Int[Tensor, " q"], window: int | None = None) -> Tensor:
    """Which (query, key) pairs are seen: ``key ≤ query`` and, on a layer with a sliding
    ``window`` ``w``, ``query − key < w`` (SPEC §1).

    >>> visible(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]), window=3).tolist()
    [True, True, False]
    """
    seen = keys <= queries
    return seen if window is None else seen & (queries - keys < _window(window))


Pairs = tuple[Int[Tensor, " q"], Int[Tensor, " q"]]


def previous_token_pairs(n_pos: int, start: int = 1, device: torch.device | str | None = None) -> Pairs:
    """The (query, key) pairs of :func:`previous_token_score`: ``(t, t−1)`` for ``t = start+1 … T−1``.

    >>> [x.tolist() for x in previous_token_pairs(4)]
    [[2, 3], [1, 2]]
    """
    t = torch.arange(_start(start) + 1, n_pos, device=device)
    return t, t - 1


def second_copy_pairs(n_pos: int, repeat: int, offset: int, start: int = 1,
                      device: torch.device | str | None = None) -> Pairs:
    """The pairs ``(t, t−R+offset)`` over a repeated sequence's second copy ``t = start+R …
    start+2R−1`` (``n_pos = start + 2R``): duplicate-token (``offset = 0``) and induction (1).

    >>> [x.tolist() for x in second_copy_pairs(5, 2, 1)]
    [[3, 4], [2, 3]]
    """
    start = _start(start)
    if n_pos != start + 2 * repeat:
        layout = "BOS + 2R" if start else "2R, no BOS"
        raise ValueError(f"a repeated sequence of R = {repeat} has {start + 2 * repeat} positions "
                         f"({layout}); this pattern has {n_pos}.")
    t = torch.arange(start + repeat, start + 2 * repeat, device=device)
    return t, t - repeat + offset


def sink_pairs(n_pos: int, device: torch.device | str | None = None) -> Pairs:
    """The pairs of :func:`sink_rate`: ``(t, 0)`` for every query ``t ≥ 1`` (the window decides
    which of them count)."""
    t = torch.arange(1, n_pos, device=device)
    return t, torch.zeros_like(t)


def mean_weight(
    pattern: Float[Tensor, "batch head query key"],
    queries: Int[Tensor, " q"],
    keys: Int[Tensor, " q"],
    window: int | None = None,
) -> Float[Tensor, " head"]:
    """Mean over sequences and the (query, key) pairs the query sees of ``α[query, key]``, per
    head (float64).

    >>> p = torch.eye(3)[None, None]            # every query attends to itself
    >>> mean_weight(p, torch.tensor([1, 2]), torch.tensor([1, 1])).tolist()
    [0.5]
    """
    keep = visible(queries, keys, window)
    queries, keys = queries[keep], keys[keep]
    weights = pattern[:, :, queries, keys]  # [batch, head, q]: advanced indexing pairs them
    return weights.double().mean(dim=(0, 2))  # no pair left: NaN


def previous_token_score(
    pattern: Float[Tensor, "batch head pos pos"], start: int = 1, window: int | None = None
) -> Float[Tensor, " head"]:
    """Mean of ``α[t, t−1]`` over the queries after the repeated sequence's first token,
    ``t = start+1 … T−1`` (SPEC §9)."""
    return mean_weight(pattern, *previous_token_pairs(pattern.shape[-2], start, pattern.device), window)


def duplicate_token_score(
    pattern: Float[Tensor, "batch head pos pos"], repeat: int, start: int = 1, window: int | None = None
) -> Float[Tensor, " head"]:
    """Mean of ``α[t, t−R]`` over the second copy ``t = start+R … start+2R−1`` of a repeated
    sequence (SPEC §9): attention to the earlier occurrence of the current token. On a layer
    with window ``w ≤ R`` that key is hidden from every query: NaN (``R ≤ w − 1`` reads it)."""
    return mean_weight(pattern, *second_copy_pairs(pattern.shape[-2], repeat, 0, start, pattern.device), window)


def induction_score(
    pattern: Float[Tensor, "batch head pos pos"], repeat: int, start: int = 1, window: int | None = None
) -> Float[Tensor, " head"]:
    """Mean of ``α[t, t−R+1]`` over the second copy ``t = start+R … start+2R−1`` (SPEC §9):
    attention to the token right after the earlier occurrence of the current token."""
    return mean_weight(pattern, *second_copy_pairs(pattern.shape[-2], repeat, 1, start, pattern.device), window)


def sink_queries(n_pos: int, window: int | None = None) -> int:
    """How many queries of a ``n_pos``-token sequence read the sink rate: ``t ≥ 1`` that see
    key 0, ``t = 1 … min(n_pos, w) − 1`` on a layer with window ``w`` (SPEC §9).

    >>> sink_queries(1024), sink_queries(1024, window=512), sink_queries(64, window=512)
    (1023, 511, 63)
    """
    return max(0, (n_pos if window is None else min(n_pos, _window(window))) - 1)


def sink_rate(pattern: Float[Tensor, "batch head pos pos"], window: int | None = None) -> Float[Tensor, " head"]:
    """Mean of key 0's weight ``α[t, 0]`` over the :func:`sink_queries` ``t ≥ 1`` that see key 0
    (SPEC §9, Gu et al.'s first-token definition)."""
    return mean_weight(pattern, *sink_pairs(pattern.shape[-2], pattern.device), window)


def sink_epsilon(rates: Float[Tensor, ...], epsilon: float = SINK_EPSILON) -> float:
    """Sink^ε of a model: the share of its heads with ``sink_rate > ε`` (Gu et al.; SPEC §9),
    over the heads whose rate is defined (not NaN); NaN where none is.

    >>> sink_epsilon(torch.tensor([0.1, 0.5, 0.9, 0.3, float("nan")]))
    0.5
    """
    defined = rates[~rates.isnan()]
    return float((defined > epsilon).double().mean()) if defined.numel() else float("nan")


def retrieval_layout(
    window_length: int, needle: int = NEEDLE_LENGTH, repeated: int = NEEDLE_REPEATED
) -> tuple[int, Int[Tensor, " q"], Int[Tensor, " q"]]:
    """``(start, queries, keys)`` of a retrieval sequence (SPEC §9) from a ``window_length``-token
    window: the needle starts mid-text at ``start = 1 + (window_length − 1) // 2``; query
    ``window_length + needle + k`` holds the repeated needle token ``k``, its expected key
    ``start + k + 1`` is the position right after that token's earlier occurrence.

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
    window: int | None = None,
) -> Float[Tensor, " head"]:
    """:func:`share_of_argmax` over the queries that see their expected key (:func:`visible`)."""
    keep = visible(queries, keys, window)
    queries, keys = queries[keep], keys[keep]
    return share_of_argmax(pattern[:, :, queries], keys)


def share_of_argmax(rows: Float[Tensor, "batch head q key"], keys: Int[Tensor, " q"]) -> Float[Tensor, " head"]:
    """Per head, the share of rows whose argmax key (ties → lower index) is ``keys[q]``; NaN
    without a row."""
    winners = rows.argmax(-1)  # [batch, head, q]
    return (winners == keys.to(winners.device)).double().mean(dim=(0, 2))


def _window(window: int) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window is a layer's sliding window, a whole number ≥ 1 (None: a global "
                         f"layer); got {window!r}.")
    return window


def _start(start: int) -> int:
    if start not in (0, 1) or isinstance(start, bool):
        raise ValueError(f"start is where the repeated tokens begin: 1 after BOS, 0 without it; "
                         f"got {start!r}.")
    return start


