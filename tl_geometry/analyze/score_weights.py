"""The attention weights ``head_scores`` reads (SPEC §9: one key per query, a few whole rows, a
chosen sink's columns), from a layer's ``hook_pattern`` (:class:`PatternWeights`) or computed,
only they, from its captured queries and keys (:class:`CaptureWeights`): in float64, in ``O(T·d)``
per query where the forward handed over each query's log-sum-exp and over the keys a query sees
otherwise, never a ``[query, key]`` tensor of the whole sequence; equal to float32 round-off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..engine.block import AttentionRows, PatternRows
from ..functional import head_scores as _scores
from ..functional.attention import attention_row_block
from ..inputs.capture import LayerCapture
from .recompute import RecomputedRows

#: Bytes of float64 values (gathered queries and keys, or recomputed rows) formed at once.
BLOCK_BYTES = 1 << 25


class PatternWeights:
    """The weights of a layer's pattern ``[batch, head, query, key]`` (read in place)."""

    def __init__(self, pattern: Float[Tensor, "batch head query key"]) -> None:
        self.pattern = pattern
        self.batch, self.n_pos = pattern.shape[0], pattern.shape[-1]
        self.device = pattern.device

    def mean_weight(self, queries: Tensor, keys: Tensor, window: int | None) -> Float[Tensor, " head"]:
        """:func:`tl_geometry.functional.head_scores.mean_weight` of the pattern."""
        return _scores.mean_weight(self.pattern, queries, keys, window)

    def argmax_share(self, queries: Tensor, keys: Tensor, window: int | None) -> Float[Tensor, " head"]:
        """:func:`tl_geometry.functional.head_scores.argmax_share` of the pattern."""
        return _scores.argmax_share(self.pattern, queries, keys, window)

    def key_columns(self, keys: Sequence[int]) -> Float[Tensor, "batch head query n_keys"]:
        """``α[b, h, t, keys[j]]`` for every query ``t`` (0 where ``t`` does not see the key)."""
        return self.pattern[..., list(keys)]

    def rows(self) -> AttentionRows:
        """The layer as the engine's row source (the sink choice reads it)."""
        return PatternRows(self.pattern)


class CaptureWeights:
    """The weights of a layer's capture, recomputed where read (see the module)."""

    def __init__(self, capture: LayerCapture) -> None:
        self.capture = capture
        self.batch, self.n_pos, self.n_heads, self.d = capture.q.shape
        self.device = capture.q.device
        self.kwargs = capture.params.row_kwargs()

    def mean_weight(self, queries: Tensor, keys: Tensor, window: int | None) -> Float[Tensor, " head"]:
        """As :func:`tl_geometry.functional.head_scores.mean_weight`, from recomputed weights."""
        keep = _scores.visible(queries, keys, window)
        return self.at(queries[keep], keys[keep]).mean(dim=(0, 2))

    def argmax_share(self, queries: Tensor, keys: Tensor, window: int | None) -> Float[Tensor, " head"]:
        """As :func:`tl_geometry.functional.head_scores.argmax_share`, from recomputed rows."""
        keep = _scores.visible(queries, keys, window)
        queries, keys = queries[keep], keys[keep]
        if not len(queries):
            return torch.full((self.n_heads,), torch.nan, dtype=torch.float64, device=self.device)
        t0, t1 = int(queries.min()), int(queries.max()) + 1
        rows = torch.cat([self._row_block(lo, hi)[:, :, queries[(queries >= lo) & (queries < hi)] - lo]
                          for lo, hi in self._query_blocks(t0, t1)], dim=2)
        return _scores.share_of_argmax(rows, keys)

    def at(self, queries: Int[Tensor, " q"], keys: Int[Tensor, " q"]) -> Float[Tensor, "batch head q"]:
        """``α[b, h, queries[i], keys[i]]`` in float64, for pairs the query sees."""
        c = self.capture
        out = torch.zeros(self.batch, self.n_heads, len(queries), dtype=torch.float64, device=self.device)
        if not len(queries):
            return out
        if c.logsumexp is not None:
            # exp(scale·⟨q_t, k_j⟩ − ℓ_t): O(d) per pair, in blocks of pairs.
            step = max(1, BLOCK_BYTES // (2 * self.batch * self.n_heads * self.d * 8))
            group = self.n_heads // c.k.shape[2]
            for i in range(0, len(queries), step):
                t, j = queries[i:i + step], keys[i:i + step]
                k = c.k[:, j].to(torch.float64).repeat_interleave(group, dim=2)  # query head h reads h // group
                logits = torch.einsum("bqhd,bqhd->bhq", c.q[:, t].to(torch.float64), k) * c.params.scale
                out[:, :, i:i + step] = (logits - c.logsumexp[:, :, t].to(torch.float64)).exp()
            return out
        for lo, hi in self._query_blocks(int(queries.min()), int(queries.max()) + 1):
            inside = ((queries >= lo) & (queries < hi)).nonzero().flatten()
            if len(inside):
                out[:, :, inside] = self._row_block(lo, hi)[:, :, queries[inside] - lo, keys[inside]]
        return out

    def key_columns(self, keys: Sequence[int]) -> Float[Tensor, "batch head query n_keys"]:
        """As :meth:`PatternWeights.key_columns`."""
        columns = torch.zeros(self.batch, self.n_heads, self.n_pos, len(keys), dtype=torch.float64,
                              device=self.device)
        if not len(keys):
            return columns
        window = self.capture.params.window
        # Only the queries from the first key on (and, on a sliding-window layer, within a
        # window of the last one) see any of them.
        t0 = min(keys)
        t1 = self.n_pos if window is None else min(self.n_pos, max(keys) + window)
        c = self.capture
        key_index = torch.tensor(list(keys), device=self.device)
        group = self.n_heads // c.k.shape[2]
        k = c.k[:, key_index].to(torch.float64).repeat_interleave(group, dim=2)  # [batch, n_keys, head, d]
        for lo, hi in self._query_blocks(t0, t1):
            t = torch.arange(lo, hi, device=self.device)
            gap = t[:, None] - key_index[None, :]  # [query, n_keys]: the query sees the key (SPEC §1)
            seen = (gap >= 0) if window is None else (gap >= 0) & (gap < window)
            if c.logsumexp is not None:  # one product of the block's queries with the keys
                logits = torch.einsum("bthd,bjhd->bhtj", c.q[:, lo:hi].to(torch.float64), k) * c.params.scale
                weights = (logits - c.logsumexp[:, :, lo:hi, None].to(torch.float64)).exp()
                columns[:, :, lo:hi] = weights.masked_fill_(~seen, 0.0)
            else:
                columns[:, :, lo:hi] = self._row_block(lo, hi)[..., key_index].masked_fill_(~seen, 0.0)
        return columns

    def rows(self) -> AttentionRows:
        return RecomputedRows(self.capture, None)

    def _query_blocks(self, t0: int, t1: int) -> list[tuple[int, int]]:
        """``[t0, t1)`` cut into blocks of queries whose float64 rows fit :data:`BLOCK_BYTES`."""
        step = max(1, BLOCK_BYTES // (self.batch * self.n_heads * self.n_pos * 8))
        return [(lo, min(t1, lo + step)) for lo in range(t0, t1, step)]

    def _row_block(self, lo: int, hi: int) -> Float[Tensor, "batch head n pos"]:
        c = self.capture
        return attention_row_block(c.q, c.k, lo, hi, **self.kwargs)
