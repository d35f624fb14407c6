"""Validation and votes of a layer whose rows are recomputed: from its queries and keys (SPEC §5).

Rows recomputed from finite queries and keys are exact softmax rows: the checks have nothing to
find. The votes compare logits plus ``log‖v‖`` (:func:`.compiled.vote.vote_from_keys`, or
:func:`_vote_by_blocks` on long layers) and settle each row by a margin test; the rows it cannot
settle are recomputed in float64, as the rows path computes them: the votes of the float64 rows.

:func:`check_and_vote` declines (``None``: the caller reads the rows) on the torch twins, without
:class:`.block.QueryKeys` (a softcap, sink logits), for a non-finite query or key at a real
position, or a window or key mask that differs from the layer's (the rows' checks name those).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..functional.attention import attention_row_block
from ..functional.dtypes import COMPUTE_DTYPE
from .backend import Backend
from .block import QueryKeys
from .checks import new_stats
from .options import NO_WINDOW


def check_and_vote(
    qk: QueryKeys | None,
    is_token: Bool[Tensor, "batch pos"],
    sink: Int[Tensor, " batch"],
    norms: Float[Tensor, "batch group key"],
    group_size: int,
    window: int | None,
    backend: Backend,
) -> tuple[Float[Tensor, "batch head stat"], Int[Tensor, "batch head pos"], int] | None:
    """:func:`.checks.check_and_vote`'s statistics and votes from ``qk`` (CPU), with the number of
    rows read in float64; ``None`` where the rows must be read instead (module docstring).
    ``norms`` are the value groups' ``‖v‖``; ``window`` is the layer's declared window."""
    kernels = backend.from_keys
    if kernels is None or qk is None or qk.window != window:
        return None
    mask = qk.key_mask  # the rows' key mask must be the layer's (no mask: no padding)
    if mask is None and not bool(is_token.all()):
        return None
    if mask is not None and not torch.equal(mask.to(torch.bool), is_token):
        return None
    q, k = qk.q.detach(), qk.k.detach()
    padding = ~is_token[:, :, None]
    # A sum is NaN or inf where an entry is (or where the sum overflows: then the rows are read).
    if not all(bool((torch.isfinite(x.sum(-1)) | padding).all()) for x in (q, k)):
        return None
    batch, n_pos, n_heads, _ = q.shape
    # float32 holds every float32, bf16 or fp16 entry exactly, and the logits are summed in
    # float32 (twice the lanes; the margin test takes its larger error); anything else in float64.
    narrow = {q.dtype, k.dtype} <= {torch.float32, torch.bfloat16, torch.float16}
    dtype, unit = (torch.float32, 2.0**-24) if narrow else (COMPUTE_DTYPE, 2.0**-53)
    keys = k.to(dtype).masked_fill(padding[..., None], 0.0)  # padding: never a key's logit
    key_norm_max = torch.linalg.vector_norm(k, dim=-1, dtype=COMPUTE_DTYPE).masked_fill(padding, 0.0).amax(1)
    log_norms = norms.to(COMPUTE_DTYPE).log().masked_fill(~is_token[:, None, :], -torch.inf)
    kernel_window = NO_WINDOW if window is None else window
    stats, vote_of = new_stats(batch, n_heads, n_pos)
    uncertain = np.zeros((batch, n_heads, n_pos), dtype=np.bool_)
    fixed = (is_token.contiguous().numpy(), sink.contiguous().numpy(), log_norms.contiguous().numpy(),
             log_norms.amax(-1).contiguous().numpy(), key_norm_max.contiguous().numpy())
    if n_pos >= BLAS_MIN_KEYS and _ieee_matmul():
        _vote_by_blocks(q.to(dtype), keys, float(qk.scale), fixed, kernel_window, group_size, unit, vote_of,
                        uncertain, kernels.vote_from_logits)
    else:
        kernels.vote_from_keys(
            q.to(dtype).contiguous().numpy(),
            keys.permute(0, 2, 3, 1).contiguous().numpy(),  # [b, kv, d, pos]: one key per lane
            float(qk.scale), *fixed, kernel_window, n_heads // k.shape[2], group_size, unit, vote_of, uncertain,
        )
    if uncertain.any():
        _recheck(qk, torch.from_numpy(uncertain), is_token, sink, norms, group_size, kernel_window, stats, vote_of,
                 kernels.check_rows)
    return torch.from_numpy(stats), torch.from_numpy(vote_of), int(uncertain.sum())


#: From this many positions on, the logits come from matrix products of blocks of queries with
#: their keys (BLAS, several times the compiled loop's speed on long rows); below, from the
#: compiled loop (:func:`.compiled.vote.vote_from_keys`).
BLAS_MIN_KEYS = 2048
#: Bytes of logits per block of queries (every head at once), and the most queries per block.
LOGIT_BLOCK_BYTES = 1 << 25
LOGIT_BLOCK_ROWS = 256


def _ieee_matmul() -> bool:
    """Whether float32 matrix products are IEEE float32, as the margin test's bound assumes (not
    ``set_float32_matmul_precision("high")``, oneDNN's bf16 or tf32)."""
    if torch.get_float32_matmul_precision() != "highest":
        return False
    for backend in (torch.backends, getattr(torch.backends.mkldnn, "matmul", None)):
        if getattr(backend, "fp32_precision", "none") not in ("none", "ieee"):
            return False
    return True


def _vote_by_blocks(q: Tensor, keys: Tensor, scale: float, fixed: tuple[np.ndarray, ...], window: int,
                    group_size: int, unit: float, vote_of: np.ndarray, uncertain: np.ndarray,
                    vote_from_logits: Callable[..., None]) -> None:
    """The votes of :func:`.compiled.vote.vote_from_keys`, with each block of queries' logits
    from one batched matrix product per sequence (every head at once; a query head reads its KV
    head's keys through the grouping, never an expanded copy): the keys ``max(0, t0 − window + 1)
    … t1 − 1`` that the block's queries ``t0 … t1 − 1`` can see. Whatever order the product sums
    in, its error is within the margin test's ``γ_{d+4}`` bound."""
    is_token, sink, log_norms, log_norm_max, key_norm_max = fixed
    batch, n_pos, n_heads, d = q.shape
    n_kv = keys.shape[2]
    kv_size = n_heads // n_kv
    gamma = (d + 4) * unit / (1.0 - (d + 4) * unit)
    width = min(n_pos, window + LOGIT_BLOCK_ROWS)  # the most keys a block sees
    rows = min(LOGIT_BLOCK_ROWS, max(1, LOGIT_BLOCK_BYTES // (n_heads * width * q.element_size())))
    q_np = q.contiguous().numpy()
    for b in range(batch):
        by_column = keys[b].permute(1, 2, 0).contiguous()  # [kv, d, pos]: a block's keys are a column range
        for t0 in range(0, n_pos, rows):
            t1 = min(n_pos, t0 + rows)
            k0 = max(0, t0 - window + 1)
            block = q[b, t0:t1].permute(1, 0, 2).reshape(n_kv, kv_size * (t1 - t0), d)  # [kv, group·rows, d]
            x = block @ by_column[:, :, k0:t1]  # [kv, group·rows, keys]
            vote_from_logits(x.reshape(n_heads, t1 - t0, t1 - k0).numpy(), t0, k0, q_np[b], scale, is_token[b],
                             int(sink[b]), log_norms[b], log_norm_max[b], key_norm_max[b], window, kv_size,
                             group_size, gamma, vote_of[b], uncertain[b])


def _recheck(qk: QueryKeys, uncertain: Tensor, is_token: Tensor, sink: Tensor, norms: Tensor,
             group_size: int, window: int, stats: np.ndarray, vote_of: np.ndarray,
             check_rows: Callable[..., None]) -> None:
    """Add the statistics and write the votes of the ``uncertain [b, h, pos]`` rows, each
    recomputed in its block of ``qk.block`` queries as the source's ``blocks`` computes it: the
    same rows bit for bit, so the same winner even where round-off decides a tie."""
    batch, _, n_pos = uncertain.shape
    fixed = [x.contiguous().numpy() for x in (is_token, sink, norms.to(COMPUTE_DTYPE))]
    q, k = qk.q.detach(), qk.k.detach()
    for start in range(0, n_pos, qk.block):
        stop = min(start + qk.block, n_pos)
        take = uncertain[:, :, start:stop]
        if not bool(take.any()):
            continue
        rows = attention_row_block(q, k, start, stop, scale=qk.scale, window=qk.window, key_mask=qk.key_mask)
        positions = torch.arange(start, stop).expand(batch, -1)
        check_rows(rows.contiguous().numpy(), positions.contiguous().numpy(), take.contiguous().numpy(), *fixed,
                   group_size, window, stats, vote_of)
