"""Validation of one layer's pattern and values, fused with the taxonomy votes (SPEC §5).

One read of every real query row gives the statistics of :data:`.layout.N_STATS`; every
statistic is NaN-proof (a NaN anywhere a key does not exist counts as a leak, never as "not
greater than the tolerance"), and each failure raises a :class:`~tl_geometry.cache.CacheError`
that names the problem and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..functional.dtypes import COMPUTE_DTYPE
from ..inputs.cache import PATTERN_HOOK, VALUE_HOOK, CacheError
from ..warn import warn_caller
from .backend import Backend
from .layout import (
    LEAK_TOL,
    N_STATS,
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
from .options import NO_WINDOW
from .sink_choice import CANDIDATES

#: Largest row sum accepted: rows may hold less than 1 (learned sink logits, sliding windows),
#: never more, up to half-precision round-off.
MAX_ROW_SUM = 1.01
NEGATIVE_TOL = 1e-6


#: Value magnitudes whose squared norms float64 holds without overflow or loss to underflow.
MAX_VALUE, MIN_VALUE = 1e150, 1e-100


def check_values(v: Float[Tensor, "batch pos kv d"], is_token: Bool[Tensor, "batch pos"], layer: int) -> None:
    """NaN or inf in a real position's value vector is an error (padding's values are unused), and
    so is a KV head whose squared norms would overflow or underflow float64 (P/R/F are
    scale-invariant: the fix is to rescale ``v``, never a silently wrong F = 0)."""
    name = VALUE_HOOK.format(layer=layer)
    if v.numel() and bool(is_token.all()):  # the common case: one reduction (NaN propagates through it)
        if v.dtype in (torch.float32, torch.float16, torch.bfloat16):
            # Every finite number of these types is 0 or within [MIN_VALUE, MAX_VALUE]: only
            # finiteness is left to check, by the extremes.
            low, high = torch.aminmax(v)
            if bool(torch.isfinite(low) & torch.isfinite(high)):
                return
        else:  # the contiguous axis first: one strided reduction over (0, 1, 3) is 15× slower
            size = v.abs().amax(dim=-1).amax(dim=(0, 1)).double()
            if bool(torch.isfinite(size).all() & (size <= MAX_VALUE).all()
                    & ((size == 0) | (size >= MIN_VALUE)).all()):
                return
    bad = ~torch.isfinite(v) & is_token[:, :, None, None]
    if bad.any():
        raise CacheError(f"{name} has {int(bad.sum())} NaN/inf entries at real positions: the "
                         "forward pass overflowed (run it in float32 or bfloat16, not float16).")
    size = torch.where(is_token[:, :, None, None], v.abs(), 0).amax(dim=(0, 1, 3)).double()  # per KV head
    if (size > MAX_VALUE).any() or ((size > 0) & (size < MIN_VALUE)).any():
        head = int(((size > MAX_VALUE) | ((size > 0) & (size < MIN_VALUE))).nonzero()[0])
        raise CacheError(f"{name} KV head {head} has values of magnitude {float(size[head]):.3g}: "
                         "their squared norms overflow or underflow float64. Rescale v (e.g. v / "
                         "v.abs().amax()); P, R, F and κ do not change, margins scale with it.")


def new_stats(batch: int, n_heads: int, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """Empty validation statistics ``[batch, head, stat]`` and per-query votes ``[batch, head,
    pos]``: no entry seen (first-position fields −1, the minimum 0), no vote (−1)."""
    stats = np.zeros((batch, n_heads, N_STATS))
    stats[..., ST_NONFINITE_Q] = stats[..., ST_DEAD_Q] = -1.0
    return stats, np.full((batch, n_heads, n_pos), -1, dtype=np.int8)


def check_and_vote(
    blocks: Iterable[tuple[int, Float[Tensor, "batch head query key"]]],
    is_token: Bool[Tensor, "batch pos"],
    sink: Int[Tensor, " batch"],
    norms: Float[Tensor, "batch group key"],
    group_size: int,
    backend: Backend,
    *,
    window: int = NO_WINDOW,
    reading: tuple[Tensor, Tensor, Tensor],
) -> tuple[Float[Tensor, "batch head stat"], Int[Tensor, "batch head pos"], Float[Tensor, "batch head key33"]]:
    """Validation statistics of every (sequence, head), the source-winner vote of every query,
    ``vote_of[b, h, t]`` (0 itself, 1 the sink, 2 another key, −1 none: SPEC §5; counted by
    :func:`.votes.tally`), and the sink check's sums over the queries of ``reading``
    (:func:`.sink_choice.check_reading`), from every query's rows in ascending ``blocks``
    ``(first query, rows)``."""
    batch, n_heads = is_token.shape[0], norms.shape[1] * group_size
    found = new_stats(batch, n_heads, is_token.shape[1])
    stats, vote_of = (torch.from_numpy(x).to(norms.device) for x in found)
    start, first, stop = reading
    first_keys = torch.zeros(batch, n_heads, CANDIDATES + 1, dtype=COMPUTE_DTYPE, device=norms.device)
    for q_start, rows in blocks:
        backend.check_and_vote(rows, q_start, is_token, sink, norms, group_size, window, stats, vote_of, first, stop,
                               start, first_keys)
    return stats, vote_of, first_keys


def _leak_text(stat: int, window: int | None) -> str:
    """Where a leak of statistic ``stat`` went, and the fix (built only for an error)."""
    if stat == ST_FUTURE:
        return ("future keys (key > query): its axes must be [batch, head, query_pos, key_pos] of a "
                "causal model.")
    if stat == ST_PADDING:
        return ("padding (keys that attention_mask calls padding): the forward pass did not mask "
                "them. Pass the same attention_mask to the model (run_with_cache(tokens, "
                "attention_mask=mask)), or fix the mask given here.")
    return (f"keys outside the declared sliding window of {window} (keys i ≤ t − {window} of query "
            "t): this layer is not windowed, or its window is wider. Declare the layer's real "
            "window (window={layer: w}, None for a global layer; analyze_model reads it from the "
            "model config with window='auto').")


def raise_for_stats(stats: Tensor, layer: int, b0: int, *, mask_given: bool, window: int | None = None) -> None:
    """Raise the first problem the statistics show (warn for rows without mass, no mask);
    ``window`` is the layer's declared sliding window (``None``: a global layer)."""
    name = PATTERN_HOOK.format(layer=layer)
    s = stats.to("cpu", torch.float64).numpy()
    # Every statistic's extremes in two reductions (NaN propagates, as in one reduction each); the
    # details of a problem are read only where there is one.
    high, low = s.max(axis=(0, 1)), s.min(axis=(0, 1))
    if high[ST_NONFINITE] > 0:
        count = int(s[..., ST_NONFINITE].sum())
        b, h = (int(x) for x in np.argwhere(s[..., ST_NONFINITE] > 0)[0])
        q, k = int(s[b, h, ST_NONFINITE_Q]), int(s[b, h, ST_NONFINITE_K])
        fix = ("Check that attention_mask is the one the model was run with; if it is, the "
               "forward pass overflowed (run it in float32)." if mask_given else
               "With a padded batch pass attention_mask; otherwise the forward pass overflowed "
               "(run it in float32 instead of float16).")
        raise CacheError(f"{name} has {count} NaN/inf entries at real positions (first at batch "
                         f"{b0 + b}, head {h}, query {q}, key {k}). {fix}")
    for stat in (ST_FUTURE, ST_PADDING, ST_WINDOW):
        leak = float(high[stat])
        if leak > LEAK_TOL:
            amount = "mass NaN/inf" if not np.isfinite(leak) else f"mass {leak:.3g}"
            raise CacheError(f"{name} puts attention {amount} on {_leak_text(stat, window)}")
    lowest = float(low[ST_MIN])
    if lowest < -NEGATIVE_TOL:
        raise CacheError(f"{name} has negative entries (down to {lowest:.3g}): it must hold attention "
                         "probabilities (hook_pattern, not hook_attn_scores).")
    row_sum = float(high[ST_ROW_SUM])
    if row_sum > MAX_ROW_SUM:
        raise CacheError(f"{name} has a query row whose attention sums to {row_sum:.3g} > 1: it "
                         "must hold probabilities normalised over keys, [batch, head, query_pos, "
                         "key_pos].")
    if high[ST_DEAD] > 0:
        dead = int(s[..., ST_DEAD].sum())
        b, h = (int(x) for x in np.argwhere(s[..., ST_DEAD] > 0)[0])
        q = int(s[b, h, ST_DEAD_Q])
        if mask_given:
            raise CacheError(f"{name} has {dead} query rows that attention_mask calls real but "
                             f"that hold no attention (first at batch {b0 + b}, head {h}, query "
                             f"{q}): the mask does not match the forward pass (shifted, or one "
                             "position too long?). Pass the mask the model was run with.")
        warn_caller(f"{name} has {dead} query rows with no attention mass (first at batch "
                    f"{b0 + b}, query {q}). If the batch is padded, pass attention_mask (and the "
                    "same mask to the forward pass) so those positions are left out.")
