"""Attention rows recomputed from post-rotary queries and keys, for chosen queries only.

For query position ``t`` of query head ``h`` (reading KV head ``n = h // (n_heads // n_kv)``,
SPEC §1) and key position ``i``::

    x_ti  = scale · ⟨q_t^h, k_i^n⟩
    x_ti ← softcap · tanh(x_ti / softcap)                       (when softcap is set)
    V_t   = {i : i ≤ t,  t − window < i (when window is set),  key_mask[i]}
    α_ti  = exp(x_ti) / (Σ_{j∈V_t} exp(x_tj) + exp(s_h))   for i ∈ V_t,  0 otherwise

where ``exp(s_h)`` (the attention-sink logit of head ``h``, GPT-OSS style: a column in the
softmax denominator that carries no value) is left out when ``sinks`` is ``None``. Everything is
computed in float64, whatever the input dtype, so the rows agree with a model's own float32
pattern to rounding (about 1e-6).

Memory is that of the output, ``[batch, head, Q, key]`` in float64, plus the keys in float64:
no ``[pos, pos]`` tensor exists unless ``Q`` is the whole sequence. To cover every query without
holding all queries × all keys, iterate :func:`attention_row_blocks`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ._types import COMPUTE_DTYPE

#: Value of every probability in the row of a query given as ``-1`` ("no query here").
NO_QUERY = float("nan")


def _check(
    q: Tensor, k: Tensor, queries: Tensor, window: int | None, softcap: float | None,
    sinks: Tensor | None,
) -> None:
    """Raise ``ValueError`` on inputs the jaxtyping shapes cannot express."""
    n_heads, n_kv = q.shape[2], k.shape[2]
    if n_kv <= 0 or n_heads % n_kv:
        raise ValueError(f"q has {n_heads} heads, k has {n_kv} KV heads: the query heads must be a "
                         "positive multiple of the KV heads (grouped-query attention).")
    if queries.numel() and (int(queries.min()) < -1 or int(queries.max()) >= q.shape[1]):
        raise ValueError(f"queries must lie in [0, {q.shape[1]}) (or be -1 for no query); got "
                         f"values from {int(queries.min())} to {int(queries.max())}.")
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be a positive number of keys (or None).")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap} must be positive (or None).")
    if sinks is not None and sinks.shape != (n_heads,):
        raise ValueError(f"sinks must hold one logit per query head, shape ({n_heads},); "
                         f"got {tuple(sinks.shape)}.")


def visible_keys(
    queries: Int[Tensor, "batch n_query"],
    n_keys: int,
    *,
    window: int | None = None,
    key_mask: Bool[Tensor, "batch key"] | None = None,
) -> Bool[Tensor, "batch n_query key"]:
    """Keys each query sees: ``i ≤ t``, ``t − window < i`` when windowed, and ``key_mask[i]``.

    A query given as ``-1`` sees no key.

    >>> visible_keys(torch.tensor([[2, 3, -1]]), 4, window=2).int().tolist()
    [[[0, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0]]]
    """
    keys = torch.arange(n_keys, device=queries.device)
    t = queries.unsqueeze(-1)
    visible = (keys <= t) & (t >= 0)
    if window is not None:
        visible &= keys > t - window
    if key_mask is not None:
        visible &= key_mask.unsqueeze(1)
    return visible


def _logits(
    q: Float[Tensor, "batch pos head d"],
    k: Float[Tensor, "batch key kv_head d"],
    queries: Int[Tensor, "batch n_query"],
    scale: float,
) -> Float[Tensor, "batch head n_query key"]:
    """``scale · ⟨q_t^h, k_i^{h // g}⟩`` in float64, reading only the chosen query rows."""
    batch, _, n_heads, d = q.shape
    n_kv = k.shape[2]
    group = n_heads // n_kv
    rows = torch.arange(batch, device=q.device).unsqueeze(-1)
    # Gather the chosen rows first, so only [batch, Q, head, d] is ever cast to float64.
    q_rows = q[rows, queries.clamp(min=0)].to(COMPUTE_DTYPE)
    q_rows = q_rows.reshape(batch, -1, n_kv, group, d)
    # Heads h = n·group + j, so that query head h reads KV head h // group without repeating k.
    logits = torch.einsum("bqnjd,bind->bnjqi", q_rows, k.to(COMPUTE_DTYPE))
    return logits.reshape(batch, n_heads, queries.shape[1], k.shape[1]).mul_(scale)


def attention_rows(
    q: Float[Tensor, "batch pos head d"],
    k: Float[Tensor, "batch pos kv_head d"],
    queries: Int[Tensor, "batch n_query"],
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Float[Tensor, " head"] | None = None,
    key_mask: Bool[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, "batch head n_query pos"]:
    """Attention probabilities of the chosen queries, recomputed in float64 (formula above).

    ``q`` and ``k`` are post-rotary (what the model's attention multiplies), ``queries[b, j]``
    the position of the ``j``-th query row of sequence ``b``, or ``-1`` for none: that row is
    all NaN (:data:`NO_QUERY`), so that it can never pass for a distribution. A query with no
    visible key (all of them masked out) also gets NaN, unless ``sinks`` takes its whole mass:
    then the row is zero. ``scale`` is the model's (``1/√d`` for most, Gemma-3's
    ``query_pre_attn_scalar ** -0.5``); ``window`` the sliding window of the layer (key ``i``
    visible to query ``t`` iff ``t − window < i ≤ t``); ``softcap`` caps the scaled logits as
    ``softcap · tanh(x / softcap)``; ``sinks`` holds one extra logit per query head that takes
    part in the softmax's denominator only; ``key_mask`` is False on padding keys. Inputs are
    never modified.

    >>> q = k = torch.tensor([[[[1.0]], [[1.0]], [[1.0]]]])   # batch 1, 3 positions, 1 head, d 1
    >>> attention_rows(q, k, torch.tensor([[2, 0]]), scale=1.0).tolist()
    [[[[0.3333333333333333, 0.3333333333333333, 0.3333333333333333], [1.0, 0.0, 0.0]]]]
    >>> attention_rows(q, k, torch.tensor([[2]]), scale=1.0, window=2)[0, 0, 0].tolist()
    [0.0, 0.5, 0.5]
    """
    _check(q, k, queries, window, softcap, sinks)
    logits = _logits(q, k, queries, scale)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    visible = visible_keys(queries, k.shape[1], window=window, key_mask=key_mask).unsqueeze(1)
    logits.masked_fill_(~visible, -torch.inf)
    peak = logits.amax(-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to(device=logits.device, dtype=COMPUTE_DTYPE).reshape(1, -1, 1, 1)
        peak = torch.maximum(peak, sink)
    # A row with no visible key and no sink has peak −inf: subtract 0 there, so that it ends
    # as 0 / 0 = NaN rather than producing NaN from −inf − (−inf) unpredictably.
    peak = torch.where(torch.isfinite(peak), peak, 0)
    probs = logits.sub_(peak).exp_()
    denominator = probs.sum(-1, keepdim=True)
    if sinks is not None:
        denominator += (sink - peak).exp()
    probs.div_(denominator)
    return probs.masked_fill_((queries < 0)[:, None, :, None], NO_QUERY)


def attention_row_blocks(
    q: Float[Tensor, "batch pos head d"],
    k: Float[Tensor, "batch pos kv_head d"],
    *,
    block: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Float[Tensor, " head"] | None = None,
    key_mask: Bool[Tensor, "batch pos"] | None = None,
) -> Iterator[tuple[int, Float[Tensor, "batch head n_query pos"]]]:
    """``(start, rows)`` for the queries ``start … start + block − 1``, over every position.

    ``rows`` is :func:`attention_rows` for those queries, ``[batch, head, n, pos]`` with
    ``n = block`` except in the last block (``n = pos − start``). Each block is a new tensor,
    so that peak memory is one block's rows, ``batch × head × block × pos`` float64 values.

    >>> q = k = torch.zeros(1, 5, 2, 4)
    >>> [(start, tuple(rows.shape)) for start, rows in attention_row_blocks(q, k, block=2, scale=0.5)]
    [(0, (1, 2, 2, 5)), (2, (1, 2, 2, 5)), (4, (1, 2, 1, 5))]
    """
    if block < 1:
        raise ValueError(f"block={block} must be a positive number of queries.")
    k = k.to(COMPUTE_DTYPE)  # once, not per block (a no-op on float64 keys)
    for start in range(0, q.shape[1], block):
        yield start, attention_row_block(q, k, start, min(start + block, q.shape[1]), scale=scale, window=window,
                                         softcap=softcap, sinks=sinks, key_mask=key_mask)


def attention_row_block(
    q: Float[Tensor, "batch pos head d"],
    k: Float[Tensor, "batch pos kv_head d"],
    start: int,
    stop: int,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Float[Tensor, " head"] | None = None,
    key_mask: Bool[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, "batch head n_query pos"]:
    """The rows of queries ``start … stop − 1`` over every position, as one block of
    :func:`attention_row_blocks` (the same computation, so the same numbers bit for bit).

    >>> q = k = torch.zeros(1, 5, 2, 4)
    >>> tuple(attention_row_block(q, k, 2, 4, scale=0.5).shape)
    (1, 2, 2, 5)
    """
    batch, n_pos = q.shape[:2]
    if not 0 <= start < stop <= n_pos:
        raise ValueError(f"queries {start} … {stop - 1} must lie in [0, {n_pos}).")
    # Only keys lo … stop − 1 can be visible to these queries (causal, and the window): the
    # logits of the others are never computed (half the work over a sequence), their
    # probabilities are exact zeros.
    lo = 0 if window is None else max(0, start - window + 1)
    queries = torch.arange(start - lo, stop - lo, device=q.device).expand(batch, -1)
    visible = attention_rows(q[:, lo:stop], k[:, lo:stop], queries, scale=scale, window=window,
                             softcap=softcap, sinks=sinks,
                             key_mask=None if key_mask is None else key_mask[:, lo:stop])
    rows = visible.new_zeros(*visible.shape[:-1], n_pos)
    rows[..., lo:stop] = visible
    return rows
