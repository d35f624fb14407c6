"""Validation and votes in torch: the twin of :mod:`..compiled.check`, for every device.

The rows are read one sequence and a few queries at a time (:data:`TORCH_CHECK_BYTES`), so that
the float64 copies the twin makes stay small; the statistics add up over blocks.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ...functional.dtypes import COMPUTE_DTYPE
from ..layout import (
    LEAK_TOL,
    ST_DEAD,
    ST_DEAD_Q,
    ST_FUTURE,
    ST_MIN,
    ST_NONFINITE,
    ST_NONFINITE_K,
    ST_NONFINITE_Q,
    ST_PADDING,
    ST_ROW_SUM,
    ST_WINDOW,
)

#: Bytes of one float64 copy of the rows that the twin checks at once, per sequence.
TORCH_CHECK_BYTES = 1 << 25


def check_and_vote(
    rows: Float[Tensor, "batch head query key"], q_start: int, is_token: Bool[Tensor, "batch pos"],
    sink: Int[Tensor, " batch"], norms: Float[Tensor, "batch group key"], group_size: int, window: int,
    stats: Float[Tensor, "batch head stat"], vote_of: Int[Tensor, "batch head pos"], first: Int[Tensor, " batch"],
    stop: Int[Tensor, " batch"], start: Int[Tensor, " batch"], first_keys: Float[Tensor, "batch head key33"],
) -> None:
    """:func:`..compiled.check.check_and_vote` in torch, same arguments, written in place."""
    step = max(1, TORCH_CHECK_BYTES // (rows.shape[1] * rows.shape[-1] * 8))
    for q0 in range(0, rows.shape[2], step):
        _check_block(rows[:, :, q0 : q0 + step], q_start + q0, is_token, sink, norms, group_size, window,
                     stats, vote_of, (first, stop, start, first_keys))


def _check_block(
    rows: Tensor, q_start: int, is_token: Tensor, sink: Tensor, norms: Tensor, group_size: int, window: int,
    stats: Tensor, vote_of: Tensor, reading: tuple[Tensor, Tensor, Tensor, Tensor],
) -> None:
    """One block of :func:`check_and_vote`, one sequence at a time."""
    batch, _, n_q, n_pos = rows.shape
    device = rows.device
    keys = torch.arange(n_pos, device=device)
    positions = q_start + torch.arange(n_q, device=device)
    causal = keys[None, :] <= positions[:, None]  # [q, k]
    in_window = keys[None, :] > positions[:, None] - window  # [q, k]; all True without a window
    for b in range(batch):
        x = rows[b].to(COMPUTE_DTYPE)  # [h, q, k]
        query_real = is_token[b, q_start : q_start + n_q]
        row_real = query_real[None, :, None]
        real_key = is_token[b][None, :]
        valid = causal & in_window & real_key & row_real
        finite = torch.isfinite(x)
        bad = valid & ~finite
        s = stats[b]
        flat = bad.flatten(1)
        at = flat.to(torch.int8).argmax(-1)  # each head's first in row-major order
        first_q, first_k = (at // n_pos + q_start).to(COMPUTE_DTYPE), (at % n_pos).to(COMPUTE_DTYPE)
        new = (s[:, ST_NONFINITE] == 0) & flat.any(-1)
        s[:, ST_NONFINITE_Q] = torch.where(new, first_q, s[:, ST_NONFINITE_Q])
        s[:, ST_NONFINITE_K] = torch.where(new, first_k, s[:, ST_NONFINITE_K])
        s[:, ST_NONFINITE] += bad.sum((-1, -2)).to(COMPUTE_DTYPE)
        leak = (~valid & row_real) & ~(x.abs() <= LEAK_TOL)
        amount = torch.where(finite, x.abs(), torch.inf)
        # Future keys, padding, real keys before the window.
        for slot, keys_of in zip((ST_FUTURE, ST_PADDING, ST_WINDOW),
                                 (~causal, causal & ~real_key, causal & ~in_window & real_key)):
            leaked = torch.where(leak & keys_of, amount, 0).amax((-1, -2))
            s[:, slot] = torch.maximum(s[:, slot], leaked)
        good = valid & finite
        s[:, ST_MIN] = torch.minimum(s[:, ST_MIN], torch.where(good, x, 0).amin((-1, -2)).clamp_max(0))
        row_sum = torch.where(good, x, 0).sum(-1)  # [h, q]
        s[:, ST_ROW_SUM] = torch.maximum(s[:, ST_ROW_SUM], torch.where(query_real, row_sum, 0).amax(-1))
        dead = query_real & (row_sum.abs() < 1e-6)
        new = (s[:, ST_DEAD] == 0) & dead.any(-1)
        first_dead = dead.to(torch.int8).argmax(-1).to(COMPUTE_DTYPE) + q_start
        s[:, ST_DEAD_Q] = torch.where(new, first_dead, s[:, ST_DEAD_Q])
        s[:, ST_DEAD] += dead.sum(-1).to(COMPUTE_DTYPE)
        head_norms = norms[b].repeat_interleave(group_size, dim=0)[:, None, :]  # [h, 1, k]
        weighted = torch.where(good, x * head_norms, -1.0)
        winner = weighted.argmax(-1)  # first maximum: lower index
        kind = torch.where(winner == positions, 0, torch.where(winner == sink[b], 1, 2)).to(vote_of.dtype)
        # As the kernel: a winner among the keys it sees, none at the first real position.
        after_first = (positions > 0) & is_token[b, (positions - 1).clamp_min(0)]
        has = query_real & after_first & (weighted > -1.0).any(-1)
        block = vote_of[b, :, q_start : q_start + n_q]
        block.copy_(torch.where(has, kind, block))
        first, stop, start, first_keys = reading
        read = (positions >= first[b]) & (positions < stop[b])  # the sink check's queries
        if bool(read.any()):
            n_keys = first_keys.shape[-1] - 1
            columns = torch.cat([start[b] + torch.arange(n_keys, device=device), sink[b : b + 1]])
            first_keys[b] += x[:, read][:, :, columns].sum(1)
