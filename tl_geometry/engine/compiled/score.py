"""Compiled scoring loop of the engine (numba, CPU): one pass per row, nothing materialised.

:func:`score_rows` scores every chosen query of every head: the top-N set, the top-N with the
sink removed, ``R`` random subsets and ``S`` permutations of one of the nulls of SPEC §3 (values,
norms, directions or unselected), for every N (SPEC §2–3). Its torch twin is :mod:`..twins.score`.

Inner products ``⟨v_k, s_N⟩`` come one of two ways, chosen per layer (:func:`..layer._uses_gram`):

- **from the vectors** (few queries): ``s_N = Σ_{r<N} α_{π(r)} v_{π(r)}`` is grown along each
  order, and at each N ``⟨v_k, s_N⟩ = Σ_c V[k, c] s_N[c]`` is one pass over the keys per four
  components (:func:`_fill_dots`): ``O(|grid|·|keys|·d)`` per order, no ``O(k²)`` matrix;
- **from the Gram matrix** ``G = V Vᵀ`` of the value group (many queries), as nested prefix sums
  ``Σ_{r<N} α_{π(r)} G[π(r), k]`` along each order (:func:`_gram_rows`; :mod:`.geometry` ties
  the rows of identical vectors, so exact ties stay ties, SPEC §3).
Every key's sum runs in one order, so bit-identical value vectors get bit-identical products.

Euclidean comparisons use ``E_k = α_k(α_k G_kk − 2⟨v_k, s⟩) = D_k² − ‖s‖²``, which orders keys
as ``D`` does without the cancellation of ``‖s‖²`` (it enters only the margin). Keys that are not
candidates carry a +∞ penalty, so the passes over the keys have no data-dependent branches.

The truncation figures (SPEC §10; top-N and sink-removed sets only) come from the vectors:
``o = Σ_k α_k v_k`` once per query and ``‖o − s_N/Σ_{S_N} α‖`` directly, so a small tail is not
lost to cancellation; the kept mass is summed over the selected keys, never ``1 − τ_N``.

The per-N helpers are inlined and every array below :func:`score_rows` is a borrowed view
(:mod:`.borrow`). Loops over a key range run on unsigned indices, which numba does not wrap
around, so they vectorise. Compiled on first use and cached on disk.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from ...functional.dtypes import COSINE_EPS, KEPT_MASS_MIN
from ...functional.figures import slot
from ..layout import SINK_MASS, SINK_SHARE
from ..options import NULL_NORMS, NULL_UNSELECTED, NULL_VALUES
from .borrow import borrow
from .order import SHUFFLE_SALT_U64, fisher_yates, mix, rank_keys

#: Where :func:`_score` writes each figure in ``out[group, n]``: its metric slot in
#: :data:`~tl_geometry.functional.figures.FIGURES` (compiled in as constants).
(PRECISION, RECALL, F_SCORE, MARGIN, INVERSIONS, PRECISION_CC, F_SCORE_CC, TAIL_MASS, TRUNCATION_ERROR) = (
    slot("metric", name) for name in ("precision", "recall", "f_score", "margin", "inversions", "precision_cc",
                                      "f_score_cc", "tail_mass", "truncation_error"))
#: Every slot this module's kernels write, as Python computes them today.
SLOTS = (PRECISION, RECALL, F_SCORE, MARGIN, INVERSIONS, PRECISION_CC, F_SCORE_CC, TAIL_MASS, TRUNCATION_ERROR,
         SINK_MASS, SINK_SHARE)


@njit(cache=True)
def compiled_slots():  # pragma: no cover - compiled
    """:data:`SLOTS` as this module's cached machine code holds them: numba freezes the tuple in
    and keys its disk cache on this file alone, so a changed figures table leaves the old slots."""
    return SLOTS


@njit(cache=True, inline="always")
def _row_e(lo, hi, alpha, dots, gdiag, norms, norm_s, cosine, raw):
    """``raw[k]`` = E (Euclidean) or D (cosine) of every key ``lo ≤ k < hi``, candidate or not,
    in one vectorised pass."""
    ulo, uhi = np.uint64(lo), np.uint64(hi)
    if cosine:
        for k in range(ulo, uhi):
            raw[k] = 1.0 - alpha[k] * dots[k] / (alpha[k] * norms[k] * norm_s + COSINE_EPS)
    else:
        for k in range(ulo, uhi):
            raw[k] = alpha[k] * (alpha[k] * gdiag[k] - 2.0 * dots[k])


#: The bits below the sign of a float64, as an int64: flipping them on a negative float makes
#: the int64 order of the bits the float order (:func:`_free_keys`).
_MAGNITUDE = np.int64(0x7FFFFFFFFFFFFFFF)
#: The bits of +inf.
_INF_BITS = np.int64(0x7FF0000000000000)


@njit(cache=True, inline="always")
def _free_keys(lo, hi, raw, penalty, e_max, buf):
    """``buf[k − lo]`` = ``raw[k]`` + the key's penalty, for ``0 ≤ lo ≤ k < hi``; returns the
    smallest and how many are ``≤ e_max``. The smallest is found on the bits (the int64 order of
    :data:`_MAGNITUDE`-flipped bits is the float order, −0 before +0): LLVM vectorises an integer
    minimum, not a float one. No entry is NaN: the rows and values are checked first."""
    ulo, uhi = np.uint64(lo), np.uint64(hi)
    bits = buf.view(np.int64)
    lowest = _INF_BITS
    contaminating = 0
    for k in range(ulo, uhi):
        x = raw[k] + penalty[k]
        buf[k - ulo] = x
        contaminating += x <= e_max
    for k in range(np.uint64(0), uhi - ulo):
        b = bits[k]
        lowest = min(lowest, b ^ ((b >> 63) & _MAGNITUDE))
    lowest = lowest ^ ((lowest >> 63) & _MAGNITUDE)
    return np.int64(lowest).view(np.float64), contaminating


@njit(cache=True, inline="always")
def _add_rows(index, start, stop, weights, values, vecs, row, total):  # pragma: no cover - compiled
    """``vecs[row] += Σ_j w_k v_k`` over ``k = index[j]``, ``start ≤ j < stop``, with
    ``w_k = weights[k]`` and ``v_k = values[k]``; returns ``total + Σ_j w_k``. Four rows per pass
    over the components, each component still summed in ``j``'s order (the plain loop's bits)."""
    j = start
    while j + 4 <= stop:
        k0, k1, k2, k3 = index[j], index[j + 1], index[j + 2], index[j + 3]
        w0, w1, w2, w3 = weights[k0], weights[k1], weights[k2], weights[k3]
        total = (((total + w0) + w1) + w2) + w3
        for c in range(vecs.shape[1]):
            vecs[row, c] = ((((vecs[row, c] + w0 * values[k0, c]) + w1 * values[k1, c])
                             + w2 * values[k2, c]) + w3 * values[k3, c])
        j += 4
    while j < stop:
        k = index[j]
        w = weights[k]
        total += w
        for c in range(vecs.shape[1]):
            vecs[row, c] += w * values[k, c]
        j += 1
    return total


@njit(cache=True)
def _output(keys, weights, values, vecs):  # pragma: no cover - compiled
    """``o = Σ_k w_k v_k`` over the row's keys, written into ``vecs[0]``; returns
    ``(‖o‖², Σ_k w_k)``."""
    for c in range(vecs.shape[1]):
        vecs[0, c] = 0.0
    total = _add_rows(keys, 0, keys.shape[0], weights, values, vecs, 0, 0.0)
    sq_o = 0.0
    for c in range(vecs.shape[1]):
        sq_o += vecs[0, c] * vecs[0, c]
    return sq_o, total


@njit(cache=True, inline="always")
def _truncation(vecs, sq_o, tail, kept, out, grp, ni):  # pragma: no cover - compiled
    """Add ``τ_N`` and ``‖o − o_N‖/‖o‖`` with ``o_N = s_N/Σ_{S_N} α`` (SPEC §10) to
    ``out[grp, ni]``; ``vecs`` holds ``o`` and ``s_N``, ``kept`` is ``Σ_{S_N} α``. ``o = 0`` or
    ``kept`` below :data:`KEPT_MASS_MIN` gives a NaN error; a NaN ``tail`` (a baseline) NaN for
    both."""
    if np.isnan(tail):
        out[grp, ni, TAIL_MASS] += np.nan
        out[grp, ni, TRUNCATION_ERROR] += np.nan
        return
    tail = max(tail, 0.0)  # Σ α − Σ_{S_N} α: a rounding below 0 is an empty tail
    out[grp, ni, TAIL_MASS] += tail
    if not (sq_o > 0.0 and kept >= KEPT_MASS_MIN):
        out[grp, ni, TRUNCATION_ERROR] += np.nan
    else:
        c = 1.0 / kept
        e = 0.0
        for i in range(vecs.shape[1]):
            x = vecs[0, i] - c * vecs[1, i]
            e += x * x
        out[grp, ni, TRUNCATION_ERROR] += np.sqrt(e / sq_o)


@njit(cache=True, inline="always")
def _distance(k, alpha, values, source, vecs):  # pragma: no cover - compiled
    """``D_k = ‖α_k v_{source[k]} − s_N‖`` from the vectors (``s_N = vecs[1]``): exactly 0 where
    the key's contribution is one that ``s_N`` holds alone (N = 1), where ``√(E_k + ‖s_N‖²)``
    would be the square root of a rounding error."""
    src = source[k]
    a = alpha[k]
    x = 0.0
    for c in range(vecs.shape[1]):
        diff = a * values[src, c] - vecs[1, c]
        x += diff * diff
    return np.sqrt(x)


@njit(cache=True, inline="always")
def _score(order, n, keys, excluded, alpha, dots, gdiag, norms, penalty, cosine, buf, sel, raw, out,
           grp, ni, vecs, sq_o, tail, kept, values, source, direct):
    """Add P, R, F, γ, GInv, P*, F* of the first ``n`` keys of ``order``, and the truncation
    figures (:func:`_truncation`), to ``out[grp, ni]``.

    ``penalty`` is +inf at the keys that are not candidates (the first ``n`` of ``order``, and
    ``excluded`` ≥ 0, the sink of the sink-removed group), 0 elsewhere: x + 0 = x keeps the
    candidates' E bit for bit. Key ``k`` holds ``values[source[k]]``. ``direct``: the margin's
    distances come from the vectors (as the inner products did), else from E (the Gram matrix).
    ``raw`` (by key) and ``sel`` (by rank) are scratch.
    """
    sq_s = 0.0
    for r in range(n):
        i = order[r]
        sq_s += alpha[i] * dots[i]
    norm_s = np.sqrt(max(sq_s, 0.0))
    m = keys.shape[0]
    lo = keys[0]
    hi = keys[m - 1] + 1
    in_range = hi - lo == m  # no padding inside the row: one contiguous range, the loops vectorise
    if in_range:
        _row_e(lo, hi, alpha, dots, gdiag, norms, norm_s, cosine, raw)
    else:
        for j in range(m):
            _row_e(keys[j], keys[j] + 1, alpha, dots, gdiag, norms, norm_s, cosine, raw)
    e_max = -np.inf
    for r in range(n):
        sel[r] = raw[order[r]]
        e_max = max(e_max, sel[r])
    if in_range:
        e_min, contaminating = _free_keys(lo, hi, raw, penalty, e_max, buf)
    else:
        e_min = np.inf
        contaminating = 0
        for j in range(m):
            k = keys[j]
            x = raw[k] + penalty[k]
            buf[j] = x
            e_min = min(e_min, x)
            contaminating += x <= e_max
    k_min = i_max = -1  # the lowest keys of smallest E outside S_N and largest inside (D_min, D_max)
    if direct and not cosine:
        for r in range(n):
            i = order[r]
            if sel[r] == e_max and (i_max < 0 or i < i_max):
                i_max = i
        if e_min < np.inf:
            j = 0
            while j < m - 1 and buf[j] != e_min:
                j += 1
            k_min = lo + j if in_range else keys[j]
    recalled = 0
    for r in range(n):
        recalled += sel[r] < e_min
    # GInv = Σ_{i∈S} |{j∉S : E_j ≤ E_i}| (buf holds +inf at the non-candidates, never counted).
    inversions = 0
    if contaminating > 0:
        # buf[:count] holds the keys' E. Every E_i of the selection is ≤ E_max, so only the
        # contaminating keys (E_j ≤ E_max) can count. When N passes over all m keys cost more
        # than one pass that moves those keys to the front (large N, few contaminating keys),
        # count over them alone.
        count = m
        if n * (m - contaminating) > 4 * m:
            count = 0
            for j in range(m):
                f = buf[j]
                buf[count] = f
                count += f <= e_max
        r = 0
        while r + 4 <= n:  # four selected keys per pass over the keys
            x0, x1, x2, x3 = sel[r], sel[r + 1], sel[r + 2], sel[r + 3]
            c = 0
            for j in range(count):
                f = buf[j]
                c += ((f <= x0) + (f <= x1)) + ((f <= x2) + (f <= x3))
            inversions += c
            r += 4
        while r < n:
            x = sel[r]
            c = 0
            for j in range(count):
                c += buf[j] <= x
            inversions += c
            r += 1
    precision = n / (n + contaminating)
    recall = recalled / n
    out[grp, ni, PRECISION] += precision
    out[grp, ni, RECALL] += recall
    out[grp, ni, F_SCORE] += 2 * precision * recall / (precision + recall) if recalled > 0 else 0.0
    # Chance-corrected precision (SPEC §3): the floor N/|keys| is P when every key contaminates.
    floor = n / (m - (excluded >= 0))
    p_cc = (precision - floor) / (1.0 - floor)
    out[grp, ni, PRECISION_CC] += p_cc
    out[grp, ni, F_SCORE_CC] += 2 * p_cc * recall / (p_cc + recall) if p_cc > 0 and recalled > 0 else 0.0
    if cosine:
        out[grp, ni, MARGIN] += e_min - e_max
    elif direct:
        # γ = D_min − D_max with both distances from the vectors (as the reference computes
        # them): with inner products from the vectors, E + ‖s‖² of a key whose contribution is
        # all s_N holds is a rounding error, not 0, and its square root would be the margin's.
        d_min = _distance(k_min, alpha, values, source, vecs) if k_min >= 0 else np.sqrt(max(e_min + sq_s, 0.0))
        out[grp, ni, MARGIN] += d_min - _distance(i_max, alpha, values, source, vecs)
    else:
        # From the Gram matrix, E + ‖s‖² is exact where it is 0 (N = 1: ⟨v_i, s⟩ = α_i G_ii):
        # (E_min − E_max)/(D_min + D_max) = D_min − D_max without subtracting near-equal roots.
        d_min = np.sqrt(max(e_min + sq_s, 0.0))
        d_max = np.sqrt(max(e_max + sq_s, 0.0))
        out[grp, ni, MARGIN] += (e_min - e_max) / (d_min + d_max) if d_min + d_max > 0 else 0.0
    out[grp, ni, INVERSIONS] += inversions
    _truncation(vecs, sq_o, tail, kept, out, grp, ni)


@njit(cache=True)
def _run_order(order, n_max, keys, contiguous, excluded, alpha, columns, gram, gdiag, norms, n_values, cosine,
               dots, penalty, buf, sel, raw, out, grp, values, source, vecs, sq_o,
               total):  # pragma: no cover - compiled
    """Grow ``s_N = vecs[1]`` along ``order`` and add the scores of every N ≤ ``n_max`` to
    ``out[grp]`` (zeros, or a running sum over samples); ``vecs[0]`` is ``o`` (``sq_o = ‖o‖²``,
    ``total = Σ α``). ``⟨v_k, s_N⟩`` comes from ``columns``, or from ``gram`` where not empty."""
    m = keys.shape[0]
    ulo, uhi = np.uint64(keys[0]), np.uint64(keys[m - 1] + 1)
    use_gram = gram.shape[0] > 0
    for k in range(ulo, uhi):
        penalty[k] = 0.0
        dots[k] = 0.0
    if excluded >= 0:
        penalty[excluded] = np.inf
    ni = 0
    n_sizes = n_values.shape[0]
    for c in range(vecs.shape[1]):
        vecs[1, c] = 0.0
    head = 0.0  # Σ_{S_N} α
    r = 0  # keys of order in s_N
    # s_N in the analysis space feeds the inner products read from the vectors and the truncation
    # figures; a baseline (NaN ``total``: no truncation figures) read from the Gram matrix needs
    # neither, so it is not grown.
    grow = not use_gram or not np.isnan(total)
    while ni < n_sizes and n_values[ni] <= n_max:
        stop = n_values[ni]
        if use_gram:
            _gram_rows(order, r, stop, alpha, gram, keys, contiguous, dots, penalty)
        else:
            for j in range(r, stop):
                penalty[order[j]] = np.inf
        if grow:
            head = _add_rows(order, r, stop, alpha, values, vecs, 1, head)  # s_N = Σ_{S_N} α_i v_i
        r = stop
        if not use_gram:
            _fill_dots(columns, vecs, keys, contiguous, dots)
        _score(order, r, keys, excluded, alpha, dots, gdiag, norms, penalty, cosine,
               buf, sel, raw, out, grp, ni, vecs, sq_o, total - head, head, values, source, not use_gram)
        ni += 1


@njit(cache=True, inline="always")
def _gram_rows(order, start, stop, alpha, gram, keys, contiguous, dots, penalty):  # pragma: no cover - compiled
    """``dots[k] += Σ α_i G[i, k]`` over ``i = order[r]``, ``start ≤ r < stop``, at the row's
    keys, and the penalty of those selected keys set to +inf. Four rows of ``G`` per pass over a
    range of keys (the same terms for every key, so equal keys stay equal)."""
    m = keys.shape[0]
    ulo, uhi = np.uint64(keys[0]), np.uint64(keys[m - 1] + 1)
    r = start
    if contiguous:
        while r + 4 <= stop:
            i0, i1, i2, i3 = order[r], order[r + 1], order[r + 2], order[r + 3]
            a0, a1, a2, a3 = alpha[i0], alpha[i1], alpha[i2], alpha[i3]
            penalty[i0] = penalty[i1] = penalty[i2] = penalty[i3] = np.inf
            for k in range(ulo, uhi):
                dots[k] += (a0 * gram[i0, k] + a1 * gram[i1, k]) + (a2 * gram[i2, k] + a3 * gram[i3, k])
            r += 4
    while r < stop:
        i = order[r]
        a = alpha[i]
        penalty[i] = np.inf
        if contiguous:
            for k in range(ulo, uhi):
                dots[k] += a * gram[i, k]
        else:
            for j in range(m):
                k = keys[j]
                dots[k] += a * gram[i, k]
        r += 1


@njit(cache=True, inline="always")
def _fill_dots(columns, vecs, keys, contiguous, dots):  # pragma: no cover - compiled
    """``dots[k] = ⟨v_k, s⟩`` at the row's keys, ``s = vecs[1]``, ``columns[c, k] = v_k[c]``. Four
    components per pass over the keys, in the same grouping on both paths (a range of keys, or
    keys around padding), so bit-identical vectors get bit-identical products."""
    d = columns.shape[0]
    m = keys.shape[0]
    if contiguous:
        ulo, uhi = np.uint64(keys[0]), np.uint64(keys[m - 1] + 1)
        for k in range(ulo, uhi):
            dots[k] = 0.0
        c = 0
        while c + 4 <= d:
            x0, x1, x2, x3 = vecs[1, c], vecs[1, c + 1], vecs[1, c + 2], vecs[1, c + 3]
            for k in range(ulo, uhi):
                dots[k] += ((columns[c, k] * x0 + columns[c + 1, k] * x1)
                            + (columns[c + 2, k] * x2 + columns[c + 3, k] * x3))
            c += 4
        while c < d:
            x0 = vecs[1, c]
            for k in range(ulo, uhi):
                dots[k] += columns[c, k] * x0
            c += 1
        return
    for j in range(m):
        k = keys[j]
        acc = 0.0
        c = 0
        while c + 4 <= d:
            acc += ((columns[c, k] * vecs[1, c] + columns[c + 1, k] * vecs[1, c + 1])
                    + (columns[c + 2, k] * vecs[1, c + 2] + columns[c + 3, k] * vecs[1, c + 3]))
            c += 4
        while c < d:
            acc += columns[c, k] * vecs[1, c]
            c += 1
        dots[k] = acc


@njit(cache=True)
def _columns(values, n_keys, columns, gdiag):  # pragma: no cover - compiled
    """``columns[c, k] = v_k[c]`` (widened to float64) and ``gdiag[k] = ‖v_k‖²`` (summed over the
    components in order, as :func:`.geometry.sink_geometry` sums it) for the first ``n_keys``."""
    for k in range(n_keys):
        for c in range(values.shape[1]):
            columns[c, k] = values[k, c]
    for k in range(n_keys):
        gdiag[k] = 0.0
    for c in range(values.shape[1]):
        for k in range(n_keys):
            gdiag[k] += columns[c, k] * columns[c, k]


@njit(cache=True)
def _ratio(num, den):
    """``num / den``, 0 where ``den`` is 0 (a zero vector has no direction: it stays zero);
    exactly 1 where the two are equal and non-zero."""
    return num / den if den > 0.0 else 0.0


@njit(cache=True)
def _null_weights(shuffle_kind, keys, moved, alpha, norms, weights):  # pragma: no cover - compiled
    """Weights on the unmoved values for the norms and directions nulls (SPEC §3, ours).

    Key ``k`` draws key ``π(k) = moved[k]``. Norms null: ``v'_k = ‖v_π(k)‖ v_k/‖v_k‖`` is the
    unmoved ``v_k`` with weight ``α_k ‖v_π(k)‖/‖v_k‖`` (selection ``S_N``); directions null:
    ``v'_k = ‖v_k‖ v_π(k)/‖v_π(k)‖`` is ``v_π(k)`` with weight ``α_k ‖v_k‖/‖v_π(k)‖`` at
    ``π(k)`` (selection ``π(S_N)``). A key whose own or drawn value is zero gets weight 0.
    """
    for j in range(keys.shape[0]):
        k = keys[j]
        src = moved[k]
        if shuffle_kind == NULL_NORMS:
            weights[k] = alpha[k] * _ratio(norms[src], norms[k])
        else:
            weights[src] = alpha[k] * _ratio(norms[k], norms[src])


@njit(cache=True)
def _run_unselected(top, n_max, keys, others, sink_key, contiguous, alpha, columns, gram, gdiag, norms, n_values,
                    cosine, shuffles, shuffle_key, dots, penalty, buf, sel, raw, moved_dots, moved_gdiag, moved_norms,
                    listed, drawn, moved_source, sigma, out, values, vecs):  # pragma: no cover - compiled
    """The unselected null (SPEC §3, ours): add, for every N ≤ ``n_max``, the sum over
    ``shuffles`` permutations of the scores of ``S_N`` (the first N of ``top``) when the non-sink
    keys outside ``S_N`` (``U_N``) take each other's values.

    ``S_N`` keeps its values, so ``s_N`` and ``⟨v_k, s_N⟩`` are the top-N set's, grown once; a key
    ``j`` that takes ``v_π(j)`` has ``E_j = α_j(α_j ‖v_π(j)‖² − 2⟨v_π(j), s_N⟩)``, read from the
    ``moved_*`` arrays. The ``c``-th key of ``U_N`` in position order (``listed``) takes the value
    of the ``c``-th in the order of ``σ`` (``drawn``), the values null's shuffle of ``others``
    (every visible key but ``sink_key``) of the sample: a uniform permutation of ``U_N``.
    """
    m = keys.shape[0]
    n_others = others.shape[0]
    for sample in range(shuffles):
        sigma[sample, :n_others] = others
        fisher_yates(sigma[sample, :n_others], n_others - 1, shuffle_key, sample)
    use_gram = gram.shape[0] > 0
    for j in range(m):
        penalty[keys[j]] = 0.0
        dots[keys[j]] = 0.0
    for c in range(vecs.shape[1]):
        vecs[1, c] = 0.0
    head = 0.0
    grown = 0  # keys of top in s_N
    ni = 0
    n_sizes = n_values.shape[0]
    for r in range(n_max):
        if use_gram:  # selected: +inf, as _score expects
            _gram_rows(top, r, r + 1, alpha, gram, keys, contiguous, dots, penalty)
        else:
            penalty[top[r]] = np.inf
        while ni < n_sizes and n_values[ni] == r + 1:
            head = _add_rows(top, grown, r + 1, alpha, values, vecs, 1, head)
            grown = r + 1
            if not use_gram:
                _fill_dots(columns, vecs, keys, contiguous, dots)
            u = 0
            for j in range(m):  # the real values, and U_N in position order (appended when kept)
                k = keys[j]
                moved_dots[k], moved_gdiag[k], moved_norms[k] = dots[k], gdiag[k], norms[k]
                moved_source[k] = k
                listed[u] = k
                u += (k != sink_key) & (penalty[k] == 0.0)
            for sample in range(shuffles):
                c = 0
                for k in sigma[sample, :n_others]:  # U_N in σ's order
                    drawn[c] = k
                    c += penalty[k] == 0.0
                for c in range(u):
                    k, src = listed[c], drawn[c]
                    moved_dots[k], moved_gdiag[k], moved_norms[k] = dots[src], gdiag[src], norms[src]
                    moved_source[k] = src
                _score(top, r + 1, keys, -1, alpha, moved_dots, moved_gdiag, moved_norms, penalty,
                       cosine, buf, sel, raw, out, 2, ni, vecs, np.nan, np.nan, np.nan, values, moved_source,
                       not use_gram)
            ni += 1


#: Chosen queries of one (sequence, head) per parallel task: the task's scratch arrays are
#: allocated once for all of them.
QUERY_BLOCK = 16


class _RowArrays(NamedTuple):
    """One row's part of the outputs (:class:`..layout.ScoreOutputs`) and its value group:
    ``values [k, d]``, by component ``columns [d, k]`` (empty on the Gram path), the tied Gram
    matrix ``gram [k, k]`` (empty on the vectors path) and ``sq_norms [k]``; borrowed views."""

    metrics: np.ndarray
    sink_in_top: np.ndarray
    sink_fields: np.ndarray
    random_var: np.ndarray
    values: np.ndarray
    columns: np.ndarray
    gram: np.ndarray
    sq_norms: np.ndarray


class _Scratch(NamedTuple):
    """A parallel task's scratch arrays, shared by the rows of its block, as borrowed views
    (:func:`_score_row` says which row of ``floats`` and ``ints`` holds what)."""

    keys: np.ndarray
    top: np.ndarray
    single: np.ndarray
    packed: np.ndarray
    floats: np.ndarray
    ints: np.ndarray
    vecs: np.ndarray
    one_sample: np.ndarray


@njit(parallel=True, cache=True)
def score_rows(chunk, settings, outputs):  # pragma: no cover - compiled
    """Score the chosen queries of ``chunk`` as ``settings`` say, into ``outputs`` (the records
    of :mod:`..layout`).

    Query ``t``'s candidates are the real keys ``max(start, t − window + 1) … t`` (SPEC §1,
    ours; keys before the sink are ordinary keys), and a query that does not see the sink (its
    window starts after it, or the sink comes after the query) has no sink (no sink-removed
    group, never "sink in S_N", no sink fields, every key shuffled). Of the sink fields, only
    α_sink (``mass``) and the sink's share of Σ α_j‖v_j‖ (``share``) are written here.

    The value-shuffle null (SPEC §3) gives key ``k`` the value of key ``π(k)`` (``π`` permutes
    the non-sink keys): the distances of weights ``α'_{π(k)} = α_k`` on the *unmoved* values with
    the selection ``π(S_N)``, scored by :func:`_run_order` on the same vectors. The norms and
    directions nulls rescale the weights (:func:`_null_weights`); the unselected null is
    :func:`_run_unselected`.
    """
    n_cb, n_cg, n_pos, d = chunk.values.shape
    group_size = chunk.group_size
    n_ch = n_cg * group_size
    n_query = chunk.queries.shape[1]
    n_blocks = (n_query + QUERY_BLOCK - 1) // QUERY_BLOCK
    unselected = settings.shuffle_kind == NULL_UNSELECTED
    for task in prange(n_cb * n_ch * n_blocks):
        cb = task // (n_ch * n_blocks)
        h = chunk.h0 + (task // n_blocks) % n_ch
        q0 = (task % n_blocks) * QUERY_BLOCK
        # Scratch for every row of the block (row t reads entries ≤ t only).
        keys_buf = np.empty(n_pos, dtype=np.int64)
        top_buf = np.empty(n_pos, dtype=np.int64)
        packed = np.empty(n_pos, dtype=np.uint64)
        single = np.empty(n_pos, dtype=np.float32)
        floats = np.zeros((11 if unselected else 9, n_pos))  # 9, 10: the unselected null's
        # Row 4 holds the non-sink keys, row 5 every key's own index (whose vector it holds), row 6
        # the vector each key holds under the unselected null, rows 7 … that null's permutations
        # (one per sample).
        ints = np.empty((7 + (settings.shuffles if unselected else 0), n_pos), dtype=np.int64)
        for k in range(n_pos):
            ints[5, k] = k
        vecs = np.zeros((2, d))  # o and s_N in the analysis space (SPEC §10)
        # One random subset's scores.
        one_sample = np.empty((1, settings.n_values.shape[0], outputs.metrics.shape[-1]))
        group = chunk.values[cb, (h // group_size) - chunk.g0]
        n_keys = 0  # keys up to the block's last query
        for qi in range(q0, min(q0 + QUERY_BLOCK, n_query)):
            n_keys = max(n_keys, chunk.queries[cb, qi] + 1)
        gdiag = np.empty(n_pos)
        if chunk.gram.shape[0] > 0:
            gram_bg = chunk.gram[cb, (h // group_size) - chunk.g0]
            columns = np.empty((d, 0))
            for k in range(n_keys):
                gdiag[k] = gram_bg[k, k]
        else:
            gram_bg = np.empty((0, 0))
            columns = np.empty((d, n_keys))
            _columns(group, n_keys, columns, gdiag)
        for qi in range(q0, min(q0 + QUERY_BLOCK, n_query)):
            # Borrowed views (:mod:`.borrow`): the arrays passed down to every order and N count
            # no references; the arrays they borrow from stay referenced through the loop.
            _score_row(chunk, settings, cb, h, qi,
                       _RowArrays(borrow(outputs.metrics[cb, h, qi]), borrow(outputs.sink_in_top[cb, h, qi]),
                                  borrow(outputs.sink_fields[cb, h, qi]), borrow(outputs.random_var[cb, h, qi]),
                                  borrow(group), borrow(columns), borrow(gram_bg), borrow(gdiag)),
                       _Scratch(borrow(keys_buf), borrow(top_buf), borrow(single), borrow(packed), borrow(floats),
                                borrow(ints), borrow(vecs), borrow(one_sample)))


@njit(cache=True)
def _score_row(chunk, settings, b, h, qi, arrays, scratch):  # pragma: no cover - compiled
    """One row of :func:`score_rows`: query ``chunk.queries[b, qi]`` of head ``h``."""
    # The grid of N is passed down to every order: borrowed, as the arrays of ``arrays`` and
    # ``scratch`` are (``settings`` holds it through this call).
    n_values = borrow(settings.n_values)
    samples, shuffles, shuffle_kind, cosine = (settings.samples, settings.shuffles, settings.shuffle_kind,
                                               settings.cosine)
    queries, is_token, sink = chunk.queries, chunk.is_token, chunk.sink
    # By name, not position: the records' fields are arrays of one dtype, so a swap would compile.
    out, sink_in_top, sink_fields, random_var = (arrays.metrics, arrays.sink_in_top, arrays.sink_fields,
                                                 arrays.random_var)
    values_bg, columns, gram_bg, sq_norms = arrays.values, arrays.columns, arrays.gram, arrays.sq_norms
    keys_buf, top_buf, single, packed = scratch.keys, scratch.top, scratch.single, scratch.packed
    floats, ints, vecs, one_sample = scratch.floats, scratch.ints, scratch.vecs, scratch.one_sample
    n_sizes = n_values.shape[0]
    n_metrics = out.shape[-1]
    t = queries[b, qi]
    random_var[:] = np.nan
    out[:] = np.nan
    if t < 0 or not is_token[b, t]:
        sink_fields[:] = np.nan
        return
    row = chunk.row_of[b, qi]
    lo = max(chunk.start[b], t - chunk.window + 1)  # the first key the query sees
    sees_sink = lo <= sink[b] <= t
    m = 0
    for k in range(lo, t + 1):
        if is_token[b, k]:
            keys_buf[m] = k
            m += 1
    keys = keys_buf[:m]
    contiguous = m == t + 1 - lo
    alpha, gdiag, norms, score = floats[0], floats[1], floats[2], floats[3][:m]
    dots, penalty, buf, sel, raw = floats[4], floats[5], floats[6], floats[7], floats[8]
    total = 0.0
    for j in range(m):
        k = keys[j]
        alpha[k] = chunk.rows[b, h, row, k]
        gdiag[k] = sq_norms[k]
        norms[k] = np.sqrt(max(gdiag[k], 0.0))
        contribution = alpha[k] * norms[k]
        total += contribution
        score[j] = -(contribution if settings.by_contribution else alpha[k])
    s = sink[b]
    if m > 1 and sees_sink:  # SPEC §4 needs a key besides the sink
        sink_fields[SINK_MASS] = alpha[s]
        # No key contributes (zero values or a zero row): the share is 0/0, NaN as in torch
        # (numba's division would raise ZeroDivisionError).
        sink_fields[SINK_SHARE] = alpha[s] * norms[s] / total if total > 0.0 else np.nan
    top = top_buf[:m]
    rank_keys(keys, score, single, packed, top)  # descending weight, ties → lower index (SPEC §2)
    sink_rank = 0 if sees_sink else m  # without the sink in the window, it is in no S_N
    while sink_rank < m and top[sink_rank] != s:
        sink_rank += 1
    for ni in range(n_sizes):
        sink_in_top[ni] = sees_sink and sink_rank < n_values[ni]
    # int64 values, not literals, for every argument of _run_order: numba compiles a call once
    # per literal it is given, and these keep all four calls on one compiled specialisation.
    n_top = np.int64(0)  # largest N of the grid that fits: 1 ≤ N < |keys|
    n_drop = np.int64(0)  # … with the sink removed: N < |keys| − 1
    no_key, top_group, random_group, shuffled_group, dropped_group = (
        np.int64(-1), np.int64(0), np.int64(1), np.int64(2), np.int64(3))
    for ni in range(n_sizes):
        if n_values[ni] < m:
            n_top = n_values[ni]
            out[0, ni, :] = 0.0
            if samples > 0:
                out[1, ni, :] = 0.0
            if shuffles > 0:
                out[2, ni, :] = 0.0
            random_var[ni, :] = 0.0
        if sees_sink and n_values[ni] < m - 1:
            n_drop = n_values[ni]
            out[3, ni, :] = 0.0
    # The output o once per query, for the truncation figures of the top-N and sink-removed sets
    # (SPEC §10); the baselines carry none (a NaN ``total`` makes them NaN).
    sq_o, total = _output(keys, alpha, values_bg, vecs) if n_top > 0 else (0.0, 0.0)
    no_figures = np.nan
    identity = ints[5]  # every key holds its own vector
    _run_order(top, n_top, keys, contiguous, no_key, alpha, columns, gram_bg, gdiag, norms, n_values,
               cosine, dots, penalty, buf, sel, raw, out, top_group, values_bg, identity, vecs, sq_o, total)
    perm = ints[0][:m]
    if n_drop > 0:
        dropped = ints[1][: m - 1]
        c = 0
        for j in range(m):
            if top[j] != s:
                dropped[c] = top[j]
                c += 1
        _run_order(dropped, n_drop, keys, contiguous, s, alpha, columns, gram_bg, gdiag, norms,
                   n_values, cosine, dots, penalty, buf, sel, raw, out, dropped_group, values_bg, identity, vecs, sq_o,
                   total)
    if n_top == 0:
        return
    row_key = mix(mix(np.uint64(chunk.sequence_keys[b]) + np.uint64(chunk.real_index[b, t])) + np.uint64(h))
    # Each subset is scored on its own (``one_sample``) and added to the group's sum, which is
    # what scoring into the sum directly adds (0 + x is x), and to a sum of squares for its
    # Monte Carlo variance.
    for sample in range(samples):
        perm[:] = keys
        fisher_yates(perm, n_top, row_key, sample)
        for ni in range(n_sizes):
            if n_values[ni] < m:
                one_sample[0, ni, :] = 0.0
        _run_order(perm, n_top, keys, contiguous, no_key, alpha, columns, gram_bg, gdiag, norms,
                   n_values, cosine, dots, penalty, buf, sel, raw, one_sample, top_group, values_bg, identity, vecs,
                   no_figures, no_figures)
        for ni in range(n_sizes):
            if n_values[ni] < m:
                for f in range(n_metrics):
                    x = one_sample[0, ni, f]
                    out[random_group, ni, f] += x
                    random_var[ni, f] += x * x
    # The nulls permute the non-sink keys, in position order; the sink keeps its value.
    sink_key = s if sees_sink else np.int64(-1)
    others = ints[4][: m - (1 if sees_sink else 0)]
    c = 0
    for j in range(m):
        if keys[j] != sink_key:
            others[c] = keys[j]
            c += 1
    n_others = others.shape[0]
    shuffle_key = mix(row_key ^ SHUFFLE_SALT_U64)
    if shuffles > 0 and shuffle_kind == NULL_UNSELECTED:
        _run_unselected(top, n_top, keys, others, sink_key, contiguous, alpha, columns, gram_bg, gdiag, norms, n_values,
                        cosine, shuffles, shuffle_key, dots, penalty, buf, sel, raw, floats[3],
                        floats[9], floats[10], ints[2], ints[3], ints[6], ints[7:], out, values_bg, vecs)
    elif shuffles > 0:
        moved = ints[2]  # π(k)
        order = ints[3][:n_top]
        weights = floats[3]  # α'_{π(k)} = α_k at the keys (the scores are no longer needed)
        for sample in range(shuffles):
            perm[:n_others] = others
            fisher_yates(perm[:n_others], n_others - 1, shuffle_key, sample)
            if sees_sink:
                moved[s] = s  # the sink keeps its value
            for j in range(n_others):
                moved[others[j]] = perm[j]
            if shuffle_kind == NULL_VALUES:
                for j in range(m):
                    weights[moved[keys[j]]] = alpha[keys[j]]
            else:
                _null_weights(shuffle_kind, keys, moved, alpha, norms, weights)
            for r in range(n_top):
                order[r] = top[r] if shuffle_kind == NULL_NORMS else moved[top[r]]
            _run_order(order, n_top, keys, contiguous, no_key, weights, columns, gram_bg, gdiag, norms,
                       n_values, cosine, dots, penalty, buf, sel, raw, out, shuffled_group, values_bg, identity, vecs,
                       no_figures, no_figures)
    for ni in range(n_sizes):
        if n_values[ni] < m:
            for f in range(n_metrics):
                if samples > 1:  # s²/R = (Σx² − (Σx)²/R) / ((R − 1) R), never below 0 by round-off
                    spread = random_var[ni, f] - out[1, ni, f] * out[1, ni, f] / samples
                    if spread < 0.0:  # NaN stays NaN
                        spread = 0.0
                    random_var[ni, f] = spread / ((samples - 1) * samples)
                else:
                    random_var[ni, f] = np.nan
                if samples > 0:
                    out[1, ni, f] /= samples
                if shuffles > 0:
                    out[2, ni, f] /= shuffles
