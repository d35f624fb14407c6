"""Which source-winner votes count, and in which unit (SPEC §5).

:func:`tally` counts each query's vote (``vote_of``: 0 the query itself, 1 the sink, 2 another
key, −1 none) from every real query after the sequence's first position. On a sliding-window
layer the label is decided by the queries that can see the sink (``t ≤ p + w − 1``), so that it
does not change with the window length, and the votes beyond are counted apart; on a global
layer every counted vote decides. The deciding votes are also counted in blocks of
:data:`LABEL_BLOCK` consecutive deciding queries, the block bootstrap's unit (a partial block: 0).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from einops import rearrange
from jaxtyping import Bool, Int
from torch import Tensor

#: Consecutive voting queries per resampling unit of the block bootstrap (SPEC §5).
LABEL_BLOCK = 128


class Tally(NamedTuple):
    """The votes of one layer of one batch: those that decide the label, those beyond the sink's
    window (counted apart) and the deciding ones per block (module docstring)."""

    deciding: Int[Tensor, "batch head 3"]
    beyond: Int[Tensor, "batch head 3"]
    blocks: Int[Tensor, "batch block head 3"]


def n_blocks(n_pos: int) -> int:
    """Blocks of :data:`LABEL_BLOCK` queries that a sequence of ``n_pos`` positions can hold."""
    return max(1, -(-n_pos // LABEL_BLOCK))


def tally(
    vote_of: Int[Tensor, "batch head pos"],
    is_token: Bool[Tensor, "batch pos"],
    start: Int[Tensor, " batch"],
    sink: Int[Tensor, " batch"],
    window: int,
) -> Tally:
    """Count each query's vote (module docstring); ``window`` as the kernels read it.

        >>> vote_of = torch.tensor([[[-1, 0, 1, 1, 2, 1]]], dtype=torch.int8)
        >>> t = tally(vote_of, torch.ones(1, 6, dtype=torch.bool), torch.tensor([0]), torch.tensor([0]), 2**62)
        >>> t.deciding.tolist()
        [[[1, 3, 1]]]
    """
    batch, n_heads, n_pos = vote_of.shape
    device = vote_of.device
    n_block = n_blocks(n_pos)
    positions = torch.arange(n_pos, device=device)
    counted = is_token & (positions > start[:, None])  # [b, t]
    decides = counted & (positions - window < sink[:, None])
    # Deciding queries are consecutive (a hole in a mask is refused), from start + 1 on.
    block = ((positions - start[:, None] - 1).clamp_min(0) // LABEL_BLOCK).clamp_max(n_block - 1)
    # Each query's slot: its block where it decides, ``n_block`` where it is counted apart,
    # ``n_block + 1`` where it is not counted; one count of (sequence, head, slot, vote).
    slot = torch.where(decides, block, torch.where(counted, n_block, n_block + 1))
    cell = (torch.arange(batch * n_heads, device=device).view(batch, n_heads, 1) * (n_block + 2)
            + slot[:, None, :]) * 3 + vote_of.long().clamp_min(0)
    counts = torch.bincount(cell[vote_of >= 0], minlength=batch * n_heads * (n_block + 2) * 3)
    counts = counts.view(batch, n_heads, n_block + 2, 3)
    size = torch.zeros(batch, n_block, dtype=torch.long, device=device).scatter_add_(1, block, decides.long())
    per_block = counts[:, :, :n_block] * (size == LABEL_BLOCK)[:, None, :, None]
    return Tally(counts[:, :, :n_block].sum(2), counts[:, :, n_block],
                 rearrange(per_block, "b h k v -> b k h v"))
