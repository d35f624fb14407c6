"""The per-layer data that the layer pass (:mod:`.layer`) and the bounds (:mod:`.bounds`) share.

Attention rows come from an :class:`AttentionRows` source, so that the engine never holds more
of them than it reads: :class:`PatternRows` serves a cached ``hook_pattern`` in place; a source
that recomputes rows serves only the rows asked for, and a :class:`KeyedRows` one also its
queries and keys, for the votes (:mod:`.key_votes`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from einops import einsum, rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..functional.dtypes import COMPUTE_DTYPE
from .options import NO_WINDOW


@runtime_checkable
class AttentionRows(Protocol):
    """Where one layer's attention probabilities come from (``α[b, h, t, k]``, SPEC §1):
    ``rows(b0, b1, queries)`` gives rows ``[b, head, row, key]`` and ``row_of [b, q]``, the row
    of query ``queries[:, i]`` (−1 queries are never read); ``blocks(b0, b1)`` every query's rows
    in ascending blocks ``(first query, [b, head, block, key])``."""

    @property
    def shape(self) -> tuple[int, int, int]: ...  # (batch, head, pos)

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def rows(self, b0: int, b1: int, queries: Tensor) -> tuple[Tensor, Tensor]: ...

    def blocks(self, b0: int, b1: int) -> Iterator[tuple[int, Tensor]]: ...


class QueryKeys(NamedTuple):
    """What one layer's rows are computed from (post-rotary ``q`` and ``k``); ``block`` is the
    queries per block of the source's ``blocks`` (float64 sums repeat only within one shape)."""

    q: Float[Tensor, "batch pos head d"]
    k: Float[Tensor, "batch pos kv d"]
    scale: float
    window: int | None
    key_mask: Bool[Tensor, "batch pos"] | None
    block: int


@runtime_checkable
class KeyedRows(Protocol):
    """An :class:`AttentionRows` source whose rows may be plain softmax rows of ``scale·⟨q, k⟩``:
    ``query_keys`` gives their :class:`QueryKeys`, or ``None`` (a softcap, sink logits)."""

    def query_keys(self, b0: int, b1: int) -> QueryKeys | None: ...


class PatternRows:
    """:class:`AttentionRows` read from a cached pattern ``[batch, head, query, key]``. With
    ``upcast``, a half-precision pattern is served as float32 one chunk of sequences at a time,
    the last one kept, so the votes and the scores of a chunk share one copy."""

    def __init__(self, pattern: Float[Tensor, "batch head query key"], *, upcast: bool = False) -> None:
        self.pattern = pattern
        self.upcast = upcast and pattern.dtype not in (torch.float32, torch.float64)
        self._last: tuple[int, int, Tensor] | None = None
        batch, n_heads, n_pos, _ = pattern.shape
        self.shape: tuple[int, int, int] = (batch, n_heads, n_pos)
        self.device: torch.device = pattern.device
        self.dtype: torch.dtype = pattern.dtype

    def _chunk(self, b0: int, b1: int) -> Tensor:
        if not self.upcast:
            return self.pattern[b0:b1]
        if self._last is None or self._last[:2] != (b0, b1):
            self._last = (b0, b1, self.pattern[b0:b1].float())
        return self._last[2]

    def rows(self, b0: int, b1: int, queries: Tensor) -> tuple[Tensor, Tensor]:
        return self._chunk(b0, b1), queries

    def blocks(self, b0: int, b1: int) -> Iterator[tuple[int, Tensor]]:
        yield 0, self._chunk(b0, b1)


class LayerBlock(NamedTuple):
    """What every chunk of one layer shares (read, never written).

    ``is_token[b, k]`` is False at padding; ``start[b]`` is the sequence's first real position
    and ``sink[b]`` its sink (SPEC §1: ``start`` by default, any real position with ``sink=``; keys
    before it are ordinary keys); ``queries[b, i]`` are the chosen query positions (−1: none); a
    value group is a KV head in value space and a query head in output space, and query
    head ``h`` reads group ``h // group_size``. ``window`` is the layer's sliding window (query
    ``t`` sees keys ``t − window < i ≤ t``; SPEC §1, ours), ``None`` for a global layer.
    """

    source: AttentionRows
    v: Float[Tensor, "batch pos kv d"]
    is_token: Bool[Tensor, "batch pos"]
    sink: Int[Tensor, " batch"]
    queries: Int[Tensor, "batch q"]
    W_O: Tensor | None
    group_size: int
    n_groups: int
    window: int | None
    start: Int[Tensor, " batch"]

    @property
    def kernel_window(self) -> int:
        """The window as the kernels read it: :data:`.options.NO_WINDOW` for a global layer."""
        return NO_WINDOW if self.window is None else self.window

    def sees_sink(self, queries: Int[Tensor, "b q"], sink: Int[Tensor, " b"]) -> Bool[Tensor, "b q"]:
        """Whether each query ``t`` sees its sink: ``t − window < sink ≤ t`` (SPEC §1, ours)."""
        return (queries - self.kernel_window < sink[:, None]) & (sink[:, None] <= queries)


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
