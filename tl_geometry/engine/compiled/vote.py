"""Compiled source-winner votes from queries and keys (numba, CPU): no attention row is formed.

The vote of query ``t`` (SPEC §5) goes to the key that maximises ``α_k‖v_k‖`` among the keys it
sees; the softmax's denominator is common to the row, so in exact arithmetic that key maximises
``σ_k = x_k + log‖v_k‖`` (``x_k = scale·⟨q_t, k_k⟩``, the logit). :func:`vote_from_keys` takes
the maxima of ``σ`` over three categories (the query itself, the sink, every other key) and
counts the vote where the best leads the next by more than a proven bound on the error of this
computation and of the float64 rows of :func:`~tl_geometry.functional.attention_rows` the votes
are defined on (*the margin test*):

- the logits are summed in the stored precision (float32 for float32, bf16 or fp16 captures,
  float64 for float64): ``|x̂ − x| ≤ γ_{d+4} · scale · ‖q_t‖ · max_k‖k_k‖`` with
  ``γ_n = n·u/(1 − n·u)``, ``u = 2⁻²⁴`` or ``2⁻⁵³`` (``unit``; Cauchy–Schwarz);
- the rows round the exponential, the division and the product with ``‖v‖`` to a relative
  ``1e-15`` or so: a slack of ``1e-9 · (1 + 2·scale·‖q‖·max‖k‖ + |σ|)`` covers it six orders over;
- a key whose ``α`` underflows float64 (``x_k − max x < −708``) has no such relative error: the
  winner must lead the row's largest logit by more than ``log max‖v‖ − 700``.

A row that fails the test (an exact tie, a tie within the slack, a row whose keys all have zero
values) is marked ``uncertain``: the caller votes on its float64 row as the pattern path does
(:func:`.check.check_and_vote_rows`), so the votes are the float64 rows' bit for bit.
:func:`vote_from_logits` applies the same test to logits computed elsewhere (:mod:`..key_votes`).
Compiled on first use and cached on disk.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..layout import VOTE_QUERY_BLOCK
from .borrow import borrow


@njit(cache=True)
def _logits(qa, qb, qc, qe, kt, lo, hi, xa, xb, xc, xe):  # pragma: no cover - compiled
    """``x[k] = ⟨q, kt[:, k]⟩`` summed in the inputs' precision for ``lo ≤ k < hi``, for four
    query rows at once (``xa`` from ``qa`` …): four components of each key per pass."""
    d = qa.shape[0]
    ulo, uhi = np.uint64(lo), np.uint64(hi)  # unsigned: no wraparound, the loops vectorise
    for k in range(ulo, uhi):
        xa[k] = xb[k] = xc[k] = xe[k] = 0.0
    i = 0
    while i + 4 <= d:
        a0, a1, a2, a3 = qa[i], qa[i + 1], qa[i + 2], qa[i + 3]
        b0, b1, b2, b3 = qb[i], qb[i + 1], qb[i + 2], qb[i + 3]
        c0, c1, c2, c3 = qc[i], qc[i + 1], qc[i + 2], qc[i + 3]
        e0, e1, e2, e3 = qe[i], qe[i + 1], qe[i + 2], qe[i + 3]
        for k in range(ulo, uhi):
            k0, k1, k2, k3 = kt[i, k], kt[i + 1, k], kt[i + 2, k], kt[i + 3, k]
            xa[k] += (a0 * k0 + a1 * k1) + (a2 * k2 + a3 * k3)
            xb[k] += (b0 * k0 + b1 * k1) + (b2 * k2 + b3 * k3)
            xc[k] += (c0 * k0 + c1 * k1) + (c2 * k2 + c3 * k3)
            xe[k] += (e0 * k0 + e1 * k1) + (e2 * k2 + e3 * k3)
        i += 4
    while i < d:
        a, b, c, e = qa[i], qb[i], qc[i], qe[i]
        for k in range(ulo, uhi):
            ki = kt[i, k]
            xa[k] += a * ki
            xb[k] += b * ki
            xc[k] += c * ki
            xe[k] += e * ki
        i += 1


@njit(cache=True, inline="always")
def _range_max(x, log_norms, scale, lo, hi, best, peak):  # pragma: no cover - compiled
    """``(max(best, max σ_k), max(peak, max x_k))`` over ``lo ≤ k < hi``, ``x_k = scale·x[k]``,
    ``σ_k = x_k + log‖v_k‖``; four independent chains (LLVM keeps a float max reduction serial)."""
    s0 = s1 = s2 = s3 = best
    p0 = p1 = p2 = p3 = peak
    k = lo
    while k + 4 <= hi:
        a0, a1, a2, a3 = scale * x[k], scale * x[k + 1], scale * x[k + 2], scale * x[k + 3]
        p0, p1, p2, p3 = max(p0, a0), max(p1, a1), max(p2, a2), max(p3, a3)
        s0, s1 = max(s0, a0 + log_norms[k]), max(s1, a1 + log_norms[k + 1])
        s2, s3 = max(s2, a2 + log_norms[k + 2]), max(s3, a3 + log_norms[k + 3])
        k += 4
    while k < hi:
        a = scale * x[k]
        p0 = max(p0, a)
        s0 = max(s0, a + log_norms[k])
        k += 1
    return max(max(s0, s1), max(s2, s3)), max(max(p0, p1), max(p2, p3))


@njit(parallel=True, cache=True)
def vote_from_keys(q, kt, scale, is_token, sink, log_norms, log_norm_max, key_norm_max, window, kv_size,
                   group_size, unit, vote_of, uncertain):  # pragma: no cover - compiled
    """Source-winner votes of every real query, from queries and keys.

    ``q [b, pos, head, d]`` and ``kt [b, kv, d, pos]`` (keys transposed, zero at padding) are both
    float32 or both float64, the precision of the logits (unit roundoff ``unit``); query head
    ``h`` reads key head ``h // kv_size`` and value group ``h // group_size``. ``log_norms [b, g,
    pos]`` is ``log‖v_k‖`` (−inf at padding and at zero values), ``log_norm_max [b, g]`` its
    maximum, ``key_norm_max [b, kv]`` the largest ``‖k‖`` of the real keys. Writes each settled
    vote's kind (0 self, 1 the sink, 2 another key) to ``vote_of[b, h, t]`` and sets
    ``uncertain[b, h, t]`` for the rows that fail the margin test.
    """
    n_b, n_pos, n_h, d = q.shape
    n_blocks = (n_pos + VOTE_QUERY_BLOCK - 1) // VOTE_QUERY_BLOCK
    gamma = (d + 4) * unit / (1.0 - (d + 4) * unit)
    for task in prange(n_b * n_h * n_blocks):
        b = task // (n_h * n_blocks)
        h = (task // n_blocks) % n_h
        t0 = (task % n_blocks) * VOTE_QUERY_BLOCK
        kh, g = h // kv_size, h // group_size
        s = sink[b]
        xs = np.empty((4, n_pos), dtype=q.dtype)
        t1 = min(t0 + VOTE_QUERY_BLOCK, n_pos)
        for ta in range(t0, t1, 4):
            # Borrowed views (:mod:`.borrow`): no reference counting per row. ``xs`` is used here,
            # so it stays referenced through the loop. The helpers are calls, not inlined: the
            # parallel loop's dead-code pass would drop writes into a view it cannot trace.
            qv, xv = borrow(q), borrow(xs)
            # Four rows per pass (the last ones repeated past the block's end, never read).
            tb, tc, te = min(ta + 1, t1 - 1), min(ta + 2, t1 - 1), min(ta + 3, t1 - 1)
            _logits(qv[b, ta, h], qv[b, tb, h], qv[b, tc, h], qv[b, te, h], borrow(kt)[b, kh],
                    max(0, ta - window + 1), te + 1, xv[0], xv[1], xv[2], xv[3])
            for t in range(ta, min(ta + 4, t1)):
                if not is_token[b, t] or t == 0 or not is_token[b, t - 1]:
                    continue  # no vote: padding, the first real position (a hole in a mask is refused)
                vote = _vote(qv[b, t, h], xv[t - ta], t, max(0, t - window + 1), s, borrow(log_norms)[b, g],
                             scale, key_norm_max[b, kh], log_norm_max[b, g], gamma)
                if vote >= 0:
                    vote_of[b, h, t] = vote
                else:
                    uncertain[b, h, t] = True


@njit(cache=True)
def _vote(q_row, x, t, lo, s, ln, scale, key_norm_max, log_norm_max, gamma):  # pragma: no cover - compiled
    """Query ``t``'s vote from its logits ``x``: 0 (itself), 1 (the sink) or 2 (another key), or
    −1 where the margin test fails (module docstring)."""
    q_norm = 0.0
    for i in range(q_row.shape[0]):
        q_norm += np.float64(q_row[i]) * np.float64(q_row[i])
    size = scale * np.sqrt(q_norm) * key_norm_max * (1.0 + 1e-6)  # ≥ |x_k| for every key
    # σ of the three categories: the query itself, the sink (when the window holds it and it is
    # not the query itself), the others.
    own = scale * x[t]
    by_self = own + ln[t]
    by_sink = -np.inf
    if lo <= s < t:
        at_sink = scale * x[s]
        by_sink = at_sink + ln[s]
        by_other, peak = _range_max(x, ln, scale, lo, s, -np.inf, max(own, at_sink))
        by_other, peak = _range_max(x, ln, scale, s + 1, t, by_other, peak)
    else:
        by_other, peak = _range_max(x, ln, scale, lo, t, -np.inf, own)
    if by_self >= by_sink and by_self >= by_other:
        best, second, vote = by_self, max(by_sink, by_other), 0
    elif by_sink >= by_other:
        best, second, vote = by_sink, max(by_self, by_other), 1
    else:
        best, second, vote = by_other, max(by_self, by_sink), 2
    bound = 2.0 * gamma * size + 1e-9 * (1.0 + 2.0 * size + abs(best) + abs(second))
    # NaN or −inf anywhere fails both tests: the row is read in float64.
    if best - second > bound and best - peak > log_norm_max - 700.0:
        return vote
    return -1


@njit(parallel=True, cache=True)
def vote_from_logits(x, t0, k0, q, scale, is_token, sink, log_norms, log_norm_max, key_norm_max, window, kv_size,
                     group_size, gamma, vote_of, uncertain):  # pragma: no cover - compiled
    """:func:`vote_from_keys` for one block of queries of one sequence, its arguments the
    sequence's: ``x [head, row, key]`` holds ``⟨q_t, k_k⟩`` (unscaled, in ``q``'s precision, any
    order of summation: the bound holds for all) for the queries ``t = t0 + row`` and the keys
    ``k = k0 + key``, which must hold every key ``max(0, t − window + 1) … t`` of each row;
    ``gamma`` is ``γ_{d+4}`` of the logits' unit roundoff."""
    n_h, n_rows, _ = x.shape
    for task in prange(n_h * n_rows):
        h, row = task // n_rows, task % n_rows
        t = t0 + row
        if not is_token[t] or t == 0 or not is_token[t - 1]:
            continue  # no vote: padding, the first real position (a hole in a mask is refused)
        kh, g = h // kv_size, h // group_size
        lo = max(0, t - window + 1)
        # The row's keys shifted by k0: x holds key k at k − k0, and so does the slice of log‖v‖.
        vote = _vote(q[t, h], x[h, row], t - k0, lo - k0, sink - k0, log_norms[g, k0:], scale, key_norm_max[kh],
                     log_norm_max[g], gamma)
        if vote >= 0:
            vote_of[h, t] = vote
        else:
            uncertain[h, t] = True
