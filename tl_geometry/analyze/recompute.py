"""The recompute path of :func:`~tl_geometry.analyze_model`: attention rows from queries and keys.

Each layer's capture (:func:`tl_geometry.inputs.capture.capture_attention`) reaches the engine
as an :class:`~tl_geometry.engine.block.AttentionRows` source that recomputes, in float64 with
the layer's own parameters, only the rows the engine reads (or hands it the queries and keys,
:meth:`RecomputedRows.query_keys`); no tensor of all queries × all keys is formed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from ..engine.block import QueryKeys
from ..functional.attention import attention_row_blocks, attention_rows, visible_keys
from ..inputs.capture import LayerCapture

#: Bytes of float64 rows recomputed at once for the votes and the checks: small enough that a
#: block's logits stay in cache (2.2× faster than 64 MiB, the same results bit for bit).
VOTE_BLOCK_BYTES = 1 << 22
#: Bytes of float64 queries read at once by :meth:`RecomputedRows._columns_from_logsumexp`.
LOGSUMEXP_BLOCK_BYTES = 1 << 26


class RecomputedRows:
    """:class:`~tl_geometry.engine.block.AttentionRows` recomputed from one layer's capture
    (``key_mask [batch, pos]``: False on padding), equal to the model's to about 1e-6."""

    def __init__(self, capture: LayerCapture, key_mask: Tensor | None) -> None:
        self.capture = capture
        self.key_mask = None if key_mask is None else key_mask.to(capture.q.device, torch.bool)
        self.kwargs = capture.params.row_kwargs()
        batch, n_pos, n_heads, _ = capture.q.shape
        self.shape = (batch, n_heads, n_pos)
        self.device = capture.q.device
        self.dtype = torch.float64

    def _mask(self, b0: int, b1: int) -> Tensor | None:
        return None if self.key_mask is None else self.key_mask[b0:b1]

    def rows(self, b0: int, b1: int, queries: Tensor) -> tuple[Tensor, Tensor]:
        c = self.capture
        rows = attention_rows(c.q[b0:b1], c.k[b0:b1], queries.to(self.device), key_mask=self._mask(b0, b1),
                              **self.kwargs)
        return rows, torch.arange(queries.shape[1], device=self.device).expand_as(queries)

    def query_keys(self, b0: int, b1: int) -> QueryKeys | None:
        """The queries and keys of sequences ``b0:b1``, for votes read from the logits
        (:mod:`tl_geometry.engine.key_votes`); ``None`` with a softcap or sink logits."""
        c = self.capture
        if c.params.softcap is not None or c.params.sinks is not None:
            return None
        return QueryKeys(c.q[b0:b1], c.k[b0:b1], c.params.scale, c.params.window, self._mask(b0, b1),
                         self._block(b0, b1))

    def leading_columns(self, start: Tensor, stop: Tensor, n_keys: int) -> Tensor | None:
        """``α[b, h, t, j]`` of key ``start[b] + j`` (``j < n_keys``) for the queries
        ``start[b] ≤ t < stop[b]``, 0 at every other query: ``[batch, head, pos, n_keys]``
        float32. Every such query must see all those keys (``stop − start`` at most the window).

        From the forward's log-sum-exp where the capture holds it
        (:meth:`_columns_from_logsumexp`), else from the layer's SDPA kernel run on one-hot
        values, one causal pass per window (the forward's rounding, as ``hook_pattern``). ``None``
        with a softcap, sink logits, or padding between ``start`` and ``stop``."""
        c = self.capture
        # The log-sum-exp runs over every key up to the query: the columns' rows, where every
        # window starts at position 0 (no padding: the model was given no mask, or an all-ones one).
        if (c.logsumexp is not None and bool((start == 0).all())
                and (self.key_mask is None or bool(self.key_mask.all()))):
            return self._columns_from_logsumexp(stop, n_keys)
        if c.params.softcap is not None or c.params.sinks is not None:
            return None
        batch, n_heads, n_pos = self.shape
        d = c.q.shape[-1]
        if n_keys > d:  # the one-hot values need one component per key
            return None
        dtype = torch.promote_types(c.q.dtype, torch.float32)
        out = torch.zeros(batch, n_heads, n_pos, n_keys, dtype=dtype, device=self.device)
        for b in range(batch):
            lo, hi = int(start[b]), int(stop[b])
            if hi <= lo:
                continue
            if self.key_mask is not None and not bool(self.key_mask[b, lo:hi].all()):
                return None
            width = min(n_keys, hi - lo)
            # One-hot values of the same width as q and k, so that the fused kernels take them.
            onehot = torch.zeros(1, 1, hi - lo, d, dtype=dtype, device=self.device)
            onehot[0, 0, torch.arange(width), torch.arange(width)] = 1.0
            q = c.q[b:b + 1, lo:hi].transpose(1, 2).to(dtype)
            k = c.k[b:b + 1, lo:hi].transpose(1, 2).to(dtype)
            columns = torch.nn.functional.scaled_dot_product_attention(
                q, k, onehot.expand(1, k.shape[1], -1, -1), is_causal=True, scale=c.params.scale,
                enable_gqa=k.shape[1] != n_heads)
            out[b, :, lo:hi, :width] = columns[0, :, :, :width]
        return out

    def _columns_from_logsumexp(self, stop: Tensor, n_keys: int) -> Tensor:
        """:meth:`leading_columns` from the forward's log-sum-exp ``ℓ_t`` of every query, where
        every window starts at 0: ``α_{t,j} = exp(scale·⟨q_t, k_j⟩ − ℓ_t)`` for the keys ``j ≤ t``,
        0 after the query, the logits in float64 (``ℓ_t``'s float32 rounding: a few 1e-6)."""
        c = self.capture
        assert c.logsumexp is not None
        batch, n_heads, n_pos = self.shape
        group = n_heads // c.k.shape[2]
        keys = c.k[:, :n_keys].to(torch.float64).repeat_interleave(group, dim=2)  # query head h reads h // group
        out = torch.zeros(batch, n_heads, n_pos, n_keys, dtype=torch.float32, device=self.device)
        stop = stop.to(self.device)
        step = max(1, LOGSUMEXP_BLOCK_BYTES // (batch * n_heads * c.q.shape[-1] * 8))  # queries at once
        for t0 in range(0, int(stop.max()), step):
            t1 = min(n_pos, t0 + step)
            positions = torch.arange(t0, t1, device=self.device).expand(batch, -1)
            queries = torch.where(positions < stop[:, None], positions, -1)  # −1: past the window
            logits = torch.einsum("bthd,bjhd->bhtj", c.q[:, t0:t1].to(torch.float64), keys).mul_(c.params.scale)
            weights = logits.sub_(c.logsumexp[:, :, t0:t1, None].to(logits.dtype)).exp_()
            seen = visible_keys(queries, keys.shape[1]).unsqueeze(1)
            out[:, :, t0:t1, :keys.shape[1]] = weights.masked_fill_(~seen, 0.0).to(torch.float32)
        return out

    def blocks(self, b0: int, b1: int) -> Iterator[tuple[int, Tensor]]:
        c = self.capture
        yield from attention_row_blocks(c.q[b0:b1], c.k[b0:b1], block=self._block(b0, b1),
                                        key_mask=self._mask(b0, b1), **self.kwargs)

    def _block(self, b0: int, b1: int) -> int:
        """Queries per block of :meth:`blocks`: :data:`VOTE_BLOCK_BYTES` of float64 rows."""
        _, n_heads, n_pos = self.shape
        return max(1, VOTE_BLOCK_BYTES // ((b1 - b0) * n_heads * n_pos * 8))


def pattern_bytes(batch: int, n_heads: int, n_pos: int) -> int:
    """Bytes of one layer's float32 pattern ``[batch, head, pos, pos]`` (what eager attention and
    ``hook_pattern`` hold, twice over in the forward: scores and weights)."""
    return batch * n_heads * n_pos * n_pos * 4
