"""Compiled per-group work (numba, CPU), twins in :mod:`..twins.geometry`: the sink geometry
from the value vectors (:func:`sink_geometry`, ``O(k·d)`` per group, memory ``O(d)``), and exact
duplicates tied in a Gram matrix (:func:`tie_duplicates`). Compiled on first use and cached on
disk.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...functional.dtypes import COSINE_EPS
from ..layout import SINK_COSINE, SINK_MEAN_COSINE, SINK_NORM_RATIO
from .order import mix

#: Every slot this module's kernels write, as Python computes them today.
SLOTS = (SINK_NORM_RATIO, SINK_COSINE, SINK_MEAN_COSINE)


@njit(cache=True)
def compiled_slots():  # pragma: no cover - compiled
    """:data:`SLOTS` as this module's cached machine code holds them (:func:`.score.compiled_slots`)."""
    return SLOTS


@njit(cache=True)
def _first_duplicates(values):  # pragma: no cover - compiled
    """For every key with a duplicate, the lowest key whose value vector equals its own (as
    :func:`~tl_geometry.functional.heads.first_duplicate`); −1 for a key without one.

    Equal rows have equal hashes (the same weighted sum in the same order), so only keys of
    equal hash are compared coordinate by coordinate: each key, in ascending order, looks its
    hash up in an open-addressing table of the classes' first keys (``O(k·d)`` in all, no sort).
    """
    n_key, d = values.shape
    hashes = np.zeros(n_key)
    # Component by component: each key's sum still runs over c = 0, 1, … in order, and the pass
    # over the keys is not one serial chain of additions.
    for c in range(d):
        w = 1.0 + 0.6180339887498949 * c
        for k in range(np.uint64(n_key)):
            hashes[k] += values[k, c] * w
    size = 2
    while size < 2 * n_key:
        size *= 2
    mask = np.uint64(size - 1)
    table = np.full(size, -1, dtype=np.int64)  # a class's first key, at its hash's slot or after
    first = np.full(n_key, -1, dtype=np.int64)
    for k in range(n_key):
        h = hashes[k] + 0.0  # −0.0 + 0.0 = +0.0: the two zeros, equal hashes, take one slot
        slot = np.int64(mix(np.uint64(np.float64(h).view(np.int64))) & mask)
        while table[slot] >= 0:
            e = table[slot]
            if hashes[e] == h and _same_vector(values, e, k):
                first[e] = e
                first[k] = e
                break
            slot = (slot + 1) & (size - 1)
        else:
            table[slot] = k
    return first


@njit(cache=True, inline="always")
def _same_vector(values, i, j):  # pragma: no cover - compiled
    """Whether rows ``i`` and ``j`` of ``values`` are equal, component by component."""
    for c in range(values.shape[1]):  # noqa: SIM110 - a loop: all() of a generator does not compile
        if values[i, c] != values[j, c]:
            return False
    return True


@njit(parallel=True, cache=True)
def tie_duplicates(values, gram, window):  # pragma: no cover - compiled
    """Make the rows and columns of ``gram [b, g, k, k]`` of bit-identical vectors of
    ``values [b, g, k, d]`` identical, in place: ``G'[i, j] = G[first(i), first(j)]`` (BLAS may
    round them apart, which would split exact ties, SPEC §3).

    With a sliding ``window`` only the band ``|i − j| < window`` is held
    (:func:`..twins.geometry.band_gram`) and tied: where ``first(i)`` and ``first(j)`` lie beyond
    each other's window, ``G'[i, j]`` is their :func:`_dot`. Every pair of the same first keys
    gets the same number either way, so duplicates stay ties.
    """
    n_b, n_g, n_k, _ = values.shape
    for unit in prange(n_b * n_g):
        G = gram[unit // n_g, unit % n_g]
        V = values[unit // n_g, unit % n_g]
        first = _first_duplicates(V)
        if not np.any(first >= 0):
            continue
        if window >= n_k:
            for i in range(n_k):  # rows first, then columns
                if first[i] >= 0 and first[i] != i:
                    G[i, :] = G[first[i], :]
            for j in range(n_k):
                if first[j] >= 0 and first[j] != j:
                    for i in range(n_k):
                        G[i, j] = G[i, first[j]]
            continue
        for i in range(n_k):
            fi = first[i] if first[i] >= 0 else i
            for j in range(max(0, i - window + 1), min(n_k, i + window)):
                fj = first[j] if first[j] >= 0 else j
                if fi == i and fj == j:
                    continue  # a pair of first keys: its own entry, never written
                if abs(fi - fj) < window:
                    G[i, j] = G[fi, fj]
                else:
                    G[i, j] = _dot(V, fi, fj)


@njit(cache=True, inline="always")
def _ratio(x, y):  # pragma: no cover - compiled
    """``x / y`` as IEEE and torch give it (``x/0 = ±inf``, ``0/0 = NaN``): numba's division
    raises ``ZeroDivisionError`` instead. Every other value zero (a pruned or dead head) makes
    κ = +inf, the documented answer; all values zero make it NaN."""
    if y != 0.0:
        return x / y
    if x == 0.0 or np.isnan(x):
        return np.nan
    return np.inf if x > 0.0 else -np.inf


@njit(cache=True, inline="always")
def _dot(V, i, j):  # pragma: no cover - compiled
    """``⟨v_i, v_j⟩`` summed over the components in order: bit-identical vectors give
    bit-identical sums (the scoring kernel's squared norms are the same sums)."""
    x = 0.0
    for c in range(V.shape[1]):
        x += np.float64(V[i, c]) * np.float64(V[j, c])
    return x


@njit(parallel=True, cache=True)
def sink_geometry(values, is_token, sink, queries, h0, group_size, sink_fields, window):  # pragma: no cover - compiled
    """Write the sink geometry (SPEC §4) of every chosen query into the κ and cosine slots of
    ``sink_fields[b, h, q]`` for the heads ``h0 + …`` of each value group.

    ``values [b, g, k, d]`` (padding zeroed), ``queries [b, Q]`` (−1: none; ascending queries
    read each key once). Over ``J_t`` = the real keys query ``t`` sees other than the sink:
    ``κ = ‖v_sink‖ / mean ‖v_j‖``, ``mean cos(v_j, v_sink)`` and ``cos(v_sink, mean v_j)``. Where
    ``J_t`` is empty, the query is not real or does not see the sink (SPEC §1) the fields are
    left as they are (NaN). The sums run along the keys; keys that leave the window are taken
    out again (only where the sink lies after the first real position: a query that sees a sink
    there sees every real key up to itself).
    """
    n_b, n_g, _, d = values.shape
    n_q = queries.shape[1]
    for unit in prange(n_b * n_g):
        b = unit // n_g
        g = unit % n_g
        V = values[b, g]
        s = sink[b]
        sink_norm = np.sqrt(max(_dot(V, s, s), 0.0))
        count = 0.0
        norm_sum = 0.0
        cos_sum = 0.0
        dot_sum = 0.0
        total = np.zeros(d)
        k = 0  # keys < k are in the running sums …
        j = 0  # … and keys < j out of them again
        for qi in range(n_q):
            t = queries[b, qi]
            if t < 0 or not is_token[b, t]:
                continue
            if t < k - 1:  # queries out of order: start the sums again
                count = norm_sum = cos_sum = dot_sum = 0.0
                total[:] = 0.0
                k = j = 0
            while k <= t:
                if is_token[b, k] and k != s:
                    norm = np.sqrt(max(_dot(V, k, k), 0.0))
                    to_sink = _dot(V, k, s)
                    count += 1.0
                    norm_sum += norm
                    cos_sum += to_sink / (sink_norm * norm + COSINE_EPS)
                    dot_sum += to_sink
                    for c in range(d):
                        total[c] += V[k, c]
                k += 1
            if t - window >= s or s > t:  # the sink is out of the window, or after the query
                continue
            while j <= t - window:  # keys before the window, all before the sink
                if is_token[b, j] and j != s:
                    norm = np.sqrt(max(_dot(V, j, j), 0.0))
                    to_sink = _dot(V, j, s)
                    count -= 1.0
                    norm_sum -= norm
                    cos_sum -= to_sink / (sink_norm * norm + COSINE_EPS)
                    dot_sum -= to_sink
                    for c in range(d):
                        total[c] -= V[j, c]
                j += 1
            if count == 0.0:  # no other key
                continue
            total_norm = 0.0
            for c in range(d):
                total_norm += total[c] * total[c]
            total_norm = np.sqrt(total_norm)
            kappa = _ratio(sink_norm, norm_sum / count)
            mean_cos = cos_sum / count
            cos_mean = (dot_sum / count) / (sink_norm * (total_norm / count) + COSINE_EPS)
            for r in range(group_size):
                out = sink_fields[b, h0 + g * group_size + r, qi]
                out[SINK_NORM_RATIO] = kappa
                out[SINK_COSINE] = mean_cos
                out[SINK_MEAN_COSINE] = cos_mean
