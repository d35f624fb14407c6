"""Compiled reduction of one layer's per-query rows (numba, CPU): one read of every row, each
head one task, its sums taken in query order; the twin of :func:`..twins.reduce.reduce_rows`.
Compiled on first use and cached on disk.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..paired import BINS_PER_OCTAVE, N_BINS, OCTAVES

_HALF_RANGE = BINS_PER_OCTAVE * OCTAVES


@njit(cache=True)
def _nanmean_over_queries(rows, out):  # pragma: no cover - compiled
    """``out[...] = mean over q of rows[q, ...]`` of the non-NaN entries; NaN where none."""
    flat = rows.reshape(rows.shape[0], -1)
    total = np.zeros(flat.shape[1])
    count = np.zeros(flat.shape[1])
    for q in range(flat.shape[0]):
        for i in range(flat.shape[1]):
            x = flat[q, i]
            if not np.isnan(x):
                total[i] += x
                count[i] += 1.0
    res = out.reshape(-1)
    for i in range(flat.shape[1]):
        res[i] = total[i] / count[i] if count[i] > 0 else np.nan


@njit(parallel=True, cache=True, error_model="numpy")
def reduce_rows(metrics, sink_in_top, sink_fields, sees_sink, top, removed, f_score, seq_mean, inst_sum,
                inst_count, paired_hist, paired_halved, sink_mean):  # pragma: no cover - compiled
    """Reduce ``metrics [b, h, q, group, n, metric]``, ``sink_in_top [b, h, q, n]`` and
    ``sink_fields [b, h, q, field]`` of one layer into the zero-filled fields of
    :class:`..layout.Reduced`: per-sequence means over the queries (NaN where none is defined),
    the sink-in / sink-out instance sums and counts of group ``top`` (a query whose window does
    not hold the sink, ``sees_sink [b, q]`` False, is in neither), and the histogram of the
    paired ratio of metric ``f_score`` between groups ``top`` and ``removed`` (:mod:`..paired`).
    """
    n_b, n_h, n_q, _, n_sizes, n_m = metrics.shape
    for h in prange(n_h):
        for b in range(n_b):
            _nanmean_over_queries(metrics[b, h], seq_mean[b, h])
            _nanmean_over_queries(sink_fields[b, h], sink_mean[b, h])
            for q in range(n_q):
                row = metrics[b, h, q]
                for ni in range(n_sizes):
                    io = 0 if sink_in_top[b, h, q, ni] else 1
                    if sees_sink[b, q] and np.isfinite(row[top, ni, 0]):  # a defined instance with a sink
                        inst_count[h, io, ni] += 1.0
                        for mi in range(n_m):
                            inst_sum[h, io, ni, mi] += row[top, ni, mi]
                    with_sink = row[top, ni, f_score]
                    without = row[removed, ni, f_score]
                    if io == 1 or not np.isfinite(with_sink) or not np.isfinite(without):
                        continue
                    ratio = with_sink / without  # +inf where only the sink-removed F is 0
                    if np.isnan(ratio):  # both are 0: no ratio
                        continue
                    if ratio == 0.0:
                        index = 0
                    elif np.isinf(ratio):
                        index = N_BINS - 1
                    else:
                        octave = np.round(np.log2(ratio) * BINS_PER_OCTAVE)
                        index = 1 + _HALF_RANGE + int(min(max(octave, -_HALF_RANGE), _HALF_RANGE))
                    paired_hist[h, ni, index] += 1.0
                    paired_halved[h, ni] += ratio <= 0.5


@njit(cache=True)
def tally(vote_of, is_token, start, sink, window, label_block, deciding, beyond, blocks):  # pragma: no cover
    """The counts of :func:`..votes.tally` (its rules, in one pass over the votes), added to
    ``deciding [b, h, 3]``, ``beyond [b, h, 3]`` and ``blocks [b, block, h, 3]`` (zeros on entry)."""
    n_b, n_h, n_pos = vote_of.shape
    n_block = blocks.shape[1]
    slot = np.empty(n_pos, dtype=np.int64)  # a query's block where it decides, −1 beyond, −2 uncounted
    size = np.zeros(n_block, dtype=np.int64)
    for b in range(n_b):
        size[:] = 0
        for t in range(n_pos):
            slot[t] = -2
            if is_token[b, t] and t > start[b]:
                slot[t] = -1
                if t - window < sink[b]:
                    slot[t] = min((t - start[b] - 1) // label_block, n_block - 1)
                    size[slot[t]] += 1
        for h in range(n_h):
            for t in range(n_pos):
                v = vote_of[b, h, t]
                if v < 0 or slot[t] == -2:
                    continue
                if slot[t] == -1:
                    beyond[b, h, v] += 1
                else:
                    deciding[b, h, v] += 1
                    if size[slot[t]] == label_block:  # a partial block is dropped
                        blocks[b, slot[t], h, v] += 1
