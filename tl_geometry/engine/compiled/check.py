"""Compiled validation and votes (numba, CPU): one read of every real query row of a layer.

:func:`check_and_vote` gathers the statistics (``ST_*`` of :mod:`..layout`) that :mod:`..checks`
turns into errors and the source-winner votes of SPEC §5. Its torch twin is
:func:`..twins.check.check_and_vote`. Compiled on first use and cached on disk.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

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


@njit(cache=True)
def _check_row(row, is_token, t, lo, norms, s):  # pragma: no cover - compiled
    """Validation statistics of one query row, key by key, the keys ``lo ≤ k ≤ t`` its window;
    returns the row's sum and the source winner (−1: none)."""
    row_sum = 0.0
    best = -1.0
    winner = -1
    for k in range(row.shape[0]):
        x = np.float64(row[k])
        if lo <= k <= t and is_token[k]:
            if not np.isfinite(x):
                if s[ST_NONFINITE] == 0:
                    s[ST_NONFINITE_Q] = t
                    s[ST_NONFINITE_K] = k
                s[ST_NONFINITE] += 1
                continue
            row_sum += x
            s[ST_MIN] = min(s[ST_MIN], x)
            c = x * norms[k]
            if c > best:
                best = c
                winner = k
        else:
            a = abs(x)
            if not a <= LEAK_TOL:  # NaN and inf count as leaks too
                if not np.isfinite(a):
                    a = np.inf
                if k > t:
                    s[ST_FUTURE] = max(s[ST_FUTURE], a)
                elif not is_token[k]:
                    s[ST_PADDING] = max(s[ST_PADDING], a)
                else:  # a real key before the sliding window
                    s[ST_WINDOW] = max(s[ST_WINDOW], a)
    return row_sum, winner


@njit(cache=True, inline="always")
def _tally(s, vote_of_bh, t, sink, row_sum, winner):  # pragma: no cover - compiled
    """Add query ``t``'s row sum to the statistics ``s`` and write its winner's kind (0 self,
    1 the sink, 2 another key; −1 none: a sequence's first real position has no other key) to
    ``vote_of_bh[t]``. Which votes count is :func:`..votes.tally`'s to decide."""
    s[ST_ROW_SUM] = max(s[ST_ROW_SUM], row_sum)
    if abs(row_sum) < 1e-6:
        if s[ST_DEAD] == 0:
            s[ST_DEAD_Q] = t
        s[ST_DEAD] += 1
    if winner >= 0:
        vote_of_bh[t] = 0 if winner == t else (1 if winner == sink else 2)


@njit(parallel=True, cache=True)
def check_and_vote(pattern, q_start, is_token, sink, norms, group_size, window, stats, vote_of, first, stop,
                   start, first_keys):  # pragma: no cover - compiled
    """Validation statistics ``stats[b, h, :]`` and each query's vote ``vote_of[b, h, t]`` of a layer,
    and the sink check's sums of the first keys' weights, ``first_keys[b, h, :]``.

    ``pattern [b, h, q, k]`` (float32/64) holds the rows of queries ``q_start …`` (all of them,
    or one block), ``is_token [b, pos]``, ``sink [b]``, ``norms [b, g, k]`` (‖v‖ of value group
    ``g = h // group_size``), ``window`` the layer's sliding window (query ``t`` sees keys
    ``t − window < k ≤ t``; :data:`..options.NO_WINDOW` for none): weight before it is a leak, and
    the winner is one of the keys the query sees, so a query that cannot see the sink never
    votes "sink" (SPEC §1). Only rows of real queries are read. ``stats`` add up over calls
    (:func:`..checks.new_stats` starts them, and ``vote_of`` at −1), so blocks of queries taken
    in ascending order give the statistics of one call over every query.

    Rows of unpadded sequences take a fast pass (sums, minimum and winner in locals, a count of
    future entries above the tolerance); a row whose sum is not finite or that leaks is read
    again key by key (:func:`_check_row`), so the statistics are those of that slow pass.

    The rows of queries ``first[b] ≤ t < stop[b]`` also add their weights on keys
    ``start[b] + c`` (columns ``c`` of ``first_keys`` but its last) and on the sink (its last
    column), in query order (:func:`..sink_choice.check_reading`).
    """
    n_b, n_h, n_q, n_k = pattern.shape
    for bh in prange(n_b * n_h):
        b = bh // n_h
        h = bh % n_h
        g = h // group_size
        s = stats[b, h]
        vote = vote_of[b, h]
        dense = True
        for k in range(n_k):
            dense &= is_token[b, k]
        nrm = norms[b, g]
        # The sink check's sums, in a local array (no aliasing with the rows: the loop vectorises).
        n_lead = first_keys.shape[2] - 1
        read = np.zeros(n_lead + 1)
        for tq in range(n_q):
            t = q_start + tq
            if not is_token[b, t]:
                continue
            row = pattern[b, h, tq]
            lo = max(0, t - window + 1)
            fast = dense
            if dense:
                row_sum = 0.0
                row_min = 0.0
                best = -1.0
                winner = -1
                # Unsigned indices: numba adds no wraparound for negative ones, so the loops
                # vectorise (the sum stays one serial chain, in key order).
                for k in range(np.uint64(lo), np.uint64(t + 1)):
                    x = np.float64(row[k])
                    row_sum += x
                    row_min = min(row_min, x)
                    c = x * nrm[k]
                    if c > best:
                        best = c
                        winner = np.int64(k)
                leaks = 0
                for k in range(np.uint64(lo)):  # before the window (none without one)
                    leaks += not abs(np.float64(row[k])) <= LEAK_TOL
                for k in range(np.uint64(t + 1), np.uint64(n_k)):
                    leaks += not abs(np.float64(row[k])) <= LEAK_TOL
                fast = np.isfinite(row_sum) and leaks == 0
                if fast:
                    s[ST_MIN] = min(s[ST_MIN], row_min)
            if not fast:
                row_sum, winner = _check_row(row, is_token[b], t, lo, nrm, s)
            _tally(s, vote, t, sink[b], row_sum, winner if t > 0 and is_token[b, t - 1] else -1)
            if first[b] <= t < stop[b]:  # first ≥ start + n_lead: the lead keys lie before t, in the row
                lead = row[start[b]:start[b] + n_lead]
                for j in range(n_lead):
                    read[j] += np.float64(lead[j])
                read[n_lead] += np.float64(row[sink[b]])
        first_keys[b, h] += read


@njit(cache=True)
def check_and_vote_rows(rows, positions, take, is_token, sink, norms, group_size, window, stats,
                        vote_of):  # pragma: no cover - compiled
    """:func:`check_and_vote` for chosen rows only (those the margin test of :mod:`.vote` could
    not settle): ``rows [b, h, j, k]`` holds query ``positions[b, j]``'s row, read where
    ``take[b, h, j]``, key by key (:func:`_check_row`) as the pattern path reads a leaking row."""
    n_b, n_h, n_j, _ = rows.shape
    for b in range(n_b):
        for h in range(n_h):
            for j in range(n_j):
                t = positions[b, j]
                if t < 0 or not take[b, h, j] or not is_token[b, t]:
                    continue
                lo = max(0, t - window + 1)
                row_sum, winner = _check_row(rows[b, h, j], is_token[b], t, lo, norms[b, h // group_size],
                                             stats[b, h])
                _tally(stats[b, h], vote_of[b, h], t, sink[b], row_sum, winner if t > 0 and is_token[b, t - 1] else -1)
