"""Per-head tensors: KV-head mapping, contraction with value vectors, contribution norms, masks.

SPEC §1. Nothing here builds a ``[batch, head, query, key, d_head]`` tensor (see
:func:`value_dots`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


def kv_head_index(n_heads: int, n_kv_heads: int) -> Int[Tensor, " head"]:
    """KV head read by each query head: ``h // (n_heads // n_kv_heads)`` (SPEC §1).

    >>> kv_head_index(9, 3).tolist()
    [0, 0, 0, 1, 1, 1, 2, 2, 2]
    """
    if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise ValueError(
            f"n_heads={n_heads} must be a positive multiple of n_kv_heads={n_kv_heads} "
            "(grouped-query attention shares each KV head among n_heads // n_kv_heads query heads)."
        )
    return torch.arange(n_heads) // (n_heads // n_kv_heads)


def broadcast_shapes(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The shape ``a`` and ``b`` broadcast to (as ``torch.broadcast_shapes``); ``ValueError`` where they do not."""
    # torch.broadcast_shapes imports sympy on first use (half a second); this is all we need.
    a, b = (1,) * (len(b) - len(a)) + a, (1,) * (len(a) - len(b)) + b
    if any(x != y and 1 not in (x, y) for x, y in zip(a, b)):
        raise ValueError(f"Shapes {a} and {b} do not broadcast.")
    return tuple(max(x, y) if 1 in (x, y) else x for x, y in zip(a, b))


class ValueDots(NamedTuple):
    """``‖s‖²`` and ``⟨v_i, s⟩`` for every key ``i`` of ``s = Σ_k w_k v_k`` (:func:`value_dots`)."""

    aggregate_sq_norm: Float[Tensor, "*batch"]
    dots: Float[Tensor, "*batch key"]


def value_dots(
    weights: Float[Tensor, "*wbatch key"], values: Float[Tensor, "*vbatch key d"]
) -> ValueDots:
    """``‖s‖²`` and ``⟨v_i, s⟩`` for ``s = Σ_k w_k v_k``, without expanding ``values``.

    Leading dimensions broadcast; those where ``values`` has size 1 (queries, selections, query
    heads of one KV group) are folded into the rows of two matrix products, so the cost and
    memory are those of ``weights`` plus ``values``, never their product.

    >>> v = torch.eye(3, dtype=torch.float64)             # three orthonormal keys
    >>> w = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    >>> value_dots(w, v).dots.tolist(), value_dots(w, v).aggregate_sq_norm.tolist()
    ([[1.0, 1.0, 0.0]], [2.0])
    """
    n_key, d = values.shape[-2:]
    if weights.shape[-1] != n_key:
        raise ValueError(f"weights have {weights.shape[-1]} keys but values have {n_key}.")
    wb, vb = tuple(weights.shape[:-1]), tuple(values.shape[:-2])
    shape = broadcast_shapes(wb, vb)
    nd = len(shape)
    vb = (1,) * (nd - len(vb)) + vb
    values = values.reshape(*vb, n_key, d)
    # Dimensions the values are shared over become rows of the product.
    free = [i for i in range(nd) if vb[i] == 1 and shape[i] != 1]
    kept = [i for i in range(nd) if i not in free]
    kept_shape = [shape[i] for i in kept]
    free_shape = [shape[i] for i in free]
    rows = weights.expand(*shape, n_key).permute(*kept, *free, nd)
    rows = rows.reshape(*kept_shape, -1, n_key)
    vk = values.permute(*kept, *free, nd, nd + 1).reshape(*[vb[i] for i in kept], n_key, d)
    vk = vk.expand(*kept_shape, n_key, d)
    agg = rows @ vk  # [*kept, F, d]
    sq = (agg * agg).sum(-1)  # [*kept, F]
    dots = agg @ vk.transpose(-1, -2)  # [*kept, F, key]
    # Undo the fold: [*kept, *free] back to the broadcast order.
    inverse = [0] * nd
    for pos, dim in enumerate(kept + free):
        inverse[dim] = pos
    sq = sq.reshape((*kept_shape, *free_shape)).permute(tuple(inverse))  # tuples: shapes may be ()
    dots = dots.reshape((*kept_shape, *free_shape, n_key)).permute((*inverse, nd))
    return ValueDots(sq, dots)


def first_duplicate(values: Float[Tensor, "*vbatch key d"]) -> Int[Tensor, "*vbatch key"]:
    """For every key, the lowest index whose value vector is bit-identical to its own.

    Matrix products may round identical rows differently (BLAS edge kernels), which would split
    exact ties (SPEC §3); reading each key's inner products from its first duplicate keeps them
    exact. Costs ``d`` stable sorts of ``[*vbatch, key]`` (a lexicographic order).

    >>> first_duplicate(torch.tensor([[1.0, 2.0], [0.0, 1.0], [1.0, 2.0]])).tolist()
    [0, 1, 0]
    """
    n_key, d = values.shape[-2:]
    order = torch.arange(n_key, device=values.device).expand(values.shape[:-1]).contiguous()
    # Cheap screen: identical rows have identical coordinate sums; most caches have no duplicate.
    sums = values.sum(-1).sort(-1).values
    if not (sums[..., 1:] == sums[..., :-1]).any():
        return order
    for c in reversed(range(d)):  # stable sorts from the last coordinate: a lexicographic order
        keys = values[..., c].gather(-1, order)
        order = order.gather(-1, keys.sort(dim=-1, stable=True).indices)
    rows = values.gather(-2, order.unsqueeze(-1).expand(values.shape))
    new_group = torch.ones(order.shape, dtype=torch.long, device=values.device)
    new_group[..., 1:] = (rows[..., 1:, :] != rows[..., :-1, :]).any(-1).long()
    group = new_group.cumsum(-1) - 1
    first = torch.full_like(order, n_key).scatter_reduce(-1, group, order, "amin")
    return torch.empty_like(order).scatter_(-1, order, first.gather(-1, group))


def value_norms(values: Float[Tensor, "*vbatch key d"]) -> Float[Tensor, "*vbatch key"]:
    """``‖v_i‖`` for every key."""
    return torch.linalg.vector_norm(values, dim=-1)


def contribution_norms(
    alpha: Float[Tensor, "*abatch key"], values: Float[Tensor, "*vbatch key d"]
) -> Float[Tensor, "*batch key"]:
    """Contribution norms ``‖y_i‖ = α_i ‖v_i‖`` (SPEC §1), broadcasting ``values`` over queries.

    >>> contribution_norms(torch.tensor([0.5, 0.5]), torch.tensor([[3.0, 4.0], [0.0, 1.0]])).tolist()
    [2.5, 0.5]
    """
    return alpha * value_norms(values)


def causal_key_mask(
    n_pos: int, attention_mask: Bool[Tensor, "batch pos"] | None = None
) -> Bool[Tensor, "*batch query key"]:
    """Valid keys of every query, ``[query, key]`` (``[batch, query, key]`` with a mask): ``i ≤ t``
    and, with a mask, not padding (SPEC §1)."""
    device = None if attention_mask is None else attention_mask.device
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool, device=device).tril()
    if attention_mask is None:
        return causal
    return causal & attention_mask[:, None, :]


def sink_positions(attention_mask: Bool[Tensor, "batch pos"]) -> Int[Tensor, " batch"]:
    """The sink of each sequence: its first valid position (position 0 unless left-padded)."""
    return attention_mask.to(torch.int8).argmax(-1)


def last_positions(attention_mask: Bool[Tensor, "batch pos"]) -> Int[Tensor, " batch"]:
    """The last valid position of each sequence (the paper's query)."""
    n_pos = attention_mask.shape[-1]
    return n_pos - 1 - attention_mask.flip(-1).to(torch.int8).argmax(-1)
