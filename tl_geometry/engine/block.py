"""The per-layer data that the layer pass (:mod:`.layer`) and the bounds (:mod:`.bounds`) share:
one layer's attention rows and values with the positions, sink and chosen queries of its
sequences, and the value vectors of each value group read from them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from einops import einsum, rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..functional._types import COMPUTE_DTYPE


class LayerBlock(NamedTuple):
    """What every chunk of one layer shares (read, never written).

    ``is_token[b, k]`` is False at padding; ``queries[b, i]`` are the chosen query positions (−1:
    none); a value group is a KV head in value space and a query head in output space, and query
    head ``h`` reads group ``h // group_size``.
    """

    pattern: Float[Tensor, "batch head query key"]
    v: Float[Tensor, "batch pos kv d"]
    is_token: Bool[Tensor, "batch pos"]
    sink: Int[Tensor, " batch"]
    queries: Int[Tensor, "batch q"]
    W_O: Tensor | None
    group_size: int
    n_groups: int


def group_values(layer: LayerBlock, b0: int, b1: int, n_keys: int) -> Float[Tensor, "b g k d"]:
    """Value vectors of every value group for sequences ``b0:b1`` and keys ``:n_keys`` (float64)."""
    v = layer.v[b0:b1, :n_keys]
    is_token = layer.is_token[b0:b1, :n_keys]
    if not bool(is_token.all()):
        v = torch.where(is_token[:, :, None, None], v, 0.0)  # padding's values are unused
    if layer.W_O is None:  # one pass: upcast and lay out [b, g, k, d] contiguously
        out = torch.empty(v.shape[0], v.shape[2], v.shape[1], v.shape[3], dtype=COMPUTE_DTYPE,
                          device=v.device)
        return out.copy_(rearrange(v, "b k g d -> b g k d"))
    v = v.to(COMPUTE_DTYPE)
    n_kv = v.shape[2]
    W = rearrange(layer.W_O.to(COMPUTE_DTYPE), "(g r) d m -> g r d m", g=n_kv)
    out = einsum(v, W, "b k g d, g r d m -> b g r k m")
    return rearrange(out, "b g r k m -> b (g r) k m")
