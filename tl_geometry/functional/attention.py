"""Attention rows recomputed from post-rotary queries and keys, for chosen queries only.

For query position ``t`` of query head ``h`` (reading KV head ``n = h // (n_heads // n_kv)``,
SPEC §1) and key position ``i``::

    x_ti  = scale · ⟨q_t^h, k_i^n⟩
    x_ti ← softcap · tanh(x_ti / softcap)                       (when softcap is set)
    V_t   = {i : i ≤ t,  t − window < i (when window is set),  key_mask[i]}
    α_ti  = exp(x_ti) / (Σ_{j∈V_t} exp(x_tj) + exp(s_h))   for i ∈ V_t,  0 otherwise

where ``exp(s_h)`` (the attention-sink logit of head ``h``, GPT-OSS style: a column in the
softmax denominator that carries no value) is left out when ``sinks`` is ``None``. Everything is
computed in float64, so the rows agree with a model's own float32 pattern to about 1e-6. Memory
is that of the output, ``[batch, head, Q, key]``, plus the keys in float64.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from .dtypes import COMPUTE_DTYPE

#: Value of every probability in the row of a query given as ``-1`` ("no query here").
NO_QUERY = float("nan")

_QK_LAYOUT = {"q": "[batch, pos, head, d_head]", "k": "[batch, pos, kv_head, d_head]"}


def _check_tensor(x: object, name: str, layout: str, ndim: int) -> Tensor:
    """``x`` itself, once it is a tensor of ``ndim`` axes that holds data."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}; got {type(x).__name__}.")
    if x.is_meta:
        raise ValueError(f"{name} is on the meta device: meta tensors hold no data; pass real tensors.")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}; got shape {tuple(x.shape)}. Reshape it "
                         f"to {layout}: a single sequence still needs its batch axis of 1.")
    return x


def _positive_real(value: object, name: str, fix: str) -> float:
    """``value`` as a float, once it is a finite positive real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}) must be a real number: {fix}.")
    as_float = float(value)
    if not (math.isfinite(as_float) and as_float > 0):
        raise ValueError(f"{name}={value!r} must be finite and positive: {fix}.")
    return as_float


def _positive_int(value: object, name: str, what: str) -> int:
    """``value`` as an int, once it is a positive integer (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}) must be a positive int "
                        f"number of {what}.")
    if value < 1:
        raise ValueError(f"{name}={value} must be a positive number of {what}.")
    return int(value)


def _key_mask(key_mask: object, q: Tensor) -> Tensor | None:
    """``key_mask`` as a bool tensor (a new one where it was 0/1 of another dtype), once it is
    one entry per sequence and position of ``q`` on its device."""
    if key_mask is None:
        return None
    layout = "[batch, pos] (True or 1 on real tokens, False or 0 on padding)"
    mask = _check_tensor(key_mask, "key_mask", "[batch, pos]", 2)
    if mask.shape != q.shape[:2]:
        raise ValueError(f"key_mask has shape {tuple(mask.shape)} but q {tuple(q.shape)} has batch "
                         f"{q.shape[0]} and {q.shape[1]} positions: pass the mask of these "
                         f"sequences, {layout}.")
    if mask.device != q.device:
        raise ValueError(f"key_mask is on {mask.device} but q is on {q.device}: move it, e.g. "
                         "key_mask.to(q.device).")
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_complex:
        raise TypeError(f"key_mask has dtype {mask.dtype}: pass a boolean (or 0/1) mask, {layout}.")
    if not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)][0].item()
        raise ValueError(f"key_mask holds {bad}, not only 0 and 1: pass a boolean (or 0/1) mask, "
                         f"{layout}.")
    return mask != 0  # a new tensor: the caller's mask is left as it is


class _Softmax(NamedTuple):
    """The checked options of the rows' softmax (``window`` at most the positions)."""

    scale: float
    window: int | None
    softcap: float | None
    sinks: Tensor | None
    key_mask: Tensor | None


def _validate(
    q: Tensor, k: Tensor, *, scale: object, window: object, softcap: object, sinks: object,
    key_mask: object,
) -> _Softmax:
    """The options to compute with (``key_mask`` bool); ``TypeError`` / ``ValueError`` naming the
    problem and the fix on anything the rows cannot be computed from."""
    for name, x in (("q", q), ("k", k)):
        _check_tensor(x, name, _QK_LAYOUT[name], 4)
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} has dtype {x.dtype}: q and k must be floating point; cast "
                            "with .float().")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}: move them to one device, "
                         "e.g. k.to(q.device).")
    shapes = f"q {tuple(q.shape)} {_QK_LAYOUT['q']}, k {tuple(k.shape)} {_QK_LAYOUT['k']}"
    for axis, what, fix in ((0, "batch", "pass the keys of the same sequences as the queries"),
                            (1, "positions", "pass the whole q and k of one forward pass, one key "
                                             "per position"),
                            (3, "d_head", "pass the q and k of the same layer")):
        if q.shape[axis] != k.shape[axis]:
            raise ValueError(f"q and k differ in {what} ({shapes}): {fix}.")
    n_heads, n_kv = q.shape[2], k.shape[2]
    if n_kv <= 0 or n_heads % n_kv:
        raise ValueError(f"q has {n_heads} heads, k has {n_kv} KV heads: the query heads must be a "
                         "positive multiple of the KV heads (grouped-query attention).")
    scale = _positive_real(scale, "scale", "the logit scale, e.g. d_head ** -0.5")
    if window is not None:
        window = min(_positive_int(window, "window", "keys (or None for a global layer)"),
                     max(1, q.shape[1]))
    if softcap is not None:
        softcap = _positive_real(softcap, "softcap", "the logit cap (or None for no cap)")
    if sinks is not None:
        if not isinstance(sinks, Tensor):
            raise TypeError(f"sinks must be a tensor of one logit per query head, shape "
                            f"({n_heads},), or None; got {type(sinks).__name__}.")
        if sinks.shape != (n_heads,):
            raise ValueError(f"sinks must hold one logit per query head, shape ({n_heads},); "
                             f"got {tuple(sinks.shape)}.")
        if sinks.is_meta:
            raise ValueError("sinks is on the meta device: meta tensors hold no data; pass real "
                             "tensors.")
    return _Softmax(scale, window, softcap, sinks, _key_mask(key_mask, q))


def _check_queries(queries: object, q: Tensor) -> None:
    """Raise on ``queries`` that are not ``[batch, n_query]`` positions of ``q`` (or ``-1``)."""
    queries = _check_tensor(queries, "queries", "[batch, n_query]", 2)
    if queries.dtype.is_floating_point or queries.dtype.is_complex or queries.dtype == torch.bool:
        raise TypeError(f"queries has dtype {queries.dtype}: query positions must be integers; "
                        "cast with .long().")
    if queries.shape[0] != q.shape[0]:
        raise ValueError(f"queries has batch {queries.shape[0]} but q {tuple(q.shape)} has batch "
                         f"{q.shape[0]}: pass one row of query positions per sequence.")
    if queries.device != q.device:
        raise ValueError(f"queries is on {queries.device} but q is on {q.device}: move them, e.g. "
                         "queries.to(q.device).")
    if queries.numel() and (int(queries.min()) < -1 or int(queries.max()) >= q.shape[1]):
        raise ValueError(f"queries must lie in [0, {q.shape[1]}) (or be -1 for no query); got "
                         f"values from {int(queries.min())} to {int(queries.max())}.")


def visible_keys(
    queries: Int[Tensor, "batch n_query"],
    n_keys: int,
    *,
    window: int | None = None,
    key_mask: Bool[Tensor, "batch key"] | None = None,
) -> Bool[Tensor, "batch n_query key"]:
    """Keys each query sees: ``i ≤ t``, ``t − window < i`` when windowed, and ``key_mask[i]``;
    a query given as ``-1`` sees none.

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


def attention_rows(
    q: Float[Tensor, "batch pos head d"],
    k: Float[Tensor, "batch pos kv_head d"],
    queries: Int[Tensor, "batch n_query"],
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Float[Tensor, " head"] | None = None,
    key_mask: Shaped[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, "batch head n_query pos"]:
    """Attention probabilities of the chosen queries, recomputed in float64 (formula above).

    ``q`` and ``k`` are post-rotary (what the model's attention multiplies), ``queries[b, j]``
    the position of the ``j``-th query row of sequence ``b``, or ``-1`` for none: that row is
    all NaN (:data:`NO_QUERY`), so that it can never pass for a distribution. A query with no
    visible key (all of them masked out) also gets NaN, unless ``sinks`` takes its whole mass:
    then the row is zero. ``scale`` is the model's (``1/√d`` for most, Gemma-3's
    ``query_pre_attn_scalar ** -0.5``), ``window`` the layer's sliding window, ``key_mask``
    False (or 0) on padding keys. Inputs are never modified; those the rows cannot be computed
    from raise ``TypeError`` / ``ValueError`` naming the fix.

    >>> q = k = torch.tensor([[[[1.0]], [[1.0]], [[1.0]]]])   # batch 1, 3 positions, 1 head, d 1
    >>> attention_rows(q, k, torch.tensor([[2, 0]]), scale=1.0).tolist()
    [[[[0.3333333333333333, 0.3333333333333333, 0.3333333333333333], [1.0, 0.0, 0.0]]]]
    >>> attention_rows(q, k, torch.tensor([[2]]), scale=1.0, window=2)[0, 0, 0].tolist()
    [0.0, 0.5, 0.5]
    """
    softmax = _validate(q, k, scale=scale, window=window, softcap=softcap, sinks=sinks,
                        key_mask=key_mask)
    _check_queries(queries, q)
    return _rows(q, k, queries, softmax)


def _rows(q: Tensor, k: Tensor, queries: Tensor, softmax: _Softmax) -> Tensor:
    """:func:`attention_rows` of validated inputs: ``scale · ⟨q_t^h, k_i^{h // g}⟩``, then the
    softmax (module docstring)."""
    scale, window, softcap, sinks, key_mask = softmax
    batch, _, n_heads, d = q.shape
    n_kv = k.shape[2]
    rows = torch.arange(batch, device=q.device).unsqueeze(-1)
    # Gather the chosen rows first, so only [batch, Q, head, d] is ever cast to float64.
    q_rows = q[rows, queries.clamp(min=0)].to(COMPUTE_DTYPE)
    q_rows = q_rows.reshape(batch, -1, n_kv, n_heads // n_kv, d)
    # Heads h = n·group + j, so that query head h reads KV head h // group without repeating k.
    logits = torch.einsum("bqnjd,bind->bnjqi", q_rows, k.to(COMPUTE_DTYPE))
    logits = logits.reshape(batch, n_heads, queries.shape[1], k.shape[1]).mul_(scale)
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
    key_mask: Shaped[Tensor, "batch pos"] | None = None,
) -> Iterator[tuple[int, Float[Tensor, "batch head n_query pos"]]]:
    """``(start, rows)`` for the queries ``start … start + block − 1``, over every position.

    ``rows`` is :func:`attention_rows` for those queries (fewer in the last block), a new tensor
    per block: peak memory is one block's rows. The inputs are checked when this is called,
    before the first block.

    >>> q = k = torch.zeros(1, 5, 2, 4)
    >>> [(start, tuple(rows.shape)) for start, rows in attention_row_blocks(q, k, block=2, scale=0.5)]
    [(0, (1, 2, 2, 5)), (2, (1, 2, 2, 5)), (4, (1, 2, 1, 5))]
    """
    softmax = _validate(q, k, scale=scale, window=window, softcap=softcap, sinks=sinks,
                        key_mask=key_mask)
    block = _positive_int(block, "block", "queries")
    n_pos = q.shape[1]
    k = k.to(COMPUTE_DTYPE)  # cast once, not per block
    return ((start, _block(q, k, start, min(start + block, n_pos), softmax))
            for start in range(0, n_pos, block))


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
    key_mask: Shaped[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, "batch head n_query pos"]:
    """The rows of queries ``start … stop − 1`` (``0 ≤ start < stop ≤ pos``) over every
    position, as one block of :func:`attention_row_blocks` (the same numbers bit for bit).

    >>> q = k = torch.zeros(1, 5, 2, 4)
    >>> tuple(attention_row_block(q, k, 2, 4, scale=0.5).shape)
    (1, 2, 2, 5)
    """
    softmax = _validate(q, k, scale=scale, window=window, softcap=softcap, sinks=sinks,
                        key_mask=key_mask)
    n_pos = q.shape[1]
    for name, value in (("start", start), ("stop", stop)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}={value!r} ({type(value).__name__}) must be an int query "
                            "position.")
    if not 0 <= start < stop <= n_pos:
        raise ValueError(f"queries {start} … {stop - 1} must lie in [0, {n_pos}): pass "
                         f"0 ≤ start < stop ≤ {n_pos}.")
    return _block(q, k, int(start), int(stop), softmax)


def _block(q: Tensor, k: Tensor, start: int, stop: int, softmax: _Softmax) -> Tensor:
    """:func:`attention_row_block` of validated inputs."""
    batch, n_pos = q.shape[:2]
    # Only keys lo … stop − 1 can be visible to these queries (causal, and the window): the
    # logits of the others are never computed (half the work over a sequence), their
    # probabilities are exact zeros.
    lo = 0 if softmax.window is None else max(0, start - softmax.window + 1)
    queries = torch.arange(start - lo, stop - lo, device=q.device).expand(batch, -1)
    key_mask = None if softmax.key_mask is None else softmax.key_mask[:, lo:stop]
    visible = _rows(q[:, lo:stop], k[:, lo:stop], queries, softmax._replace(key_mask=key_mask))
    rows = visible.new_zeros(*visible.shape[:-1], n_pos)
    rows[..., lo:stop] = visible
    return rows
