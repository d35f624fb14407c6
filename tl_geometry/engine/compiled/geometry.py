"""Compiled sink geometry (numba, CPU), from the value vectors alone: no Gram matrix.

:func:`sink_geometry` does, per (sequence, value group), what :func:`..twins.geometry.sink_geometry`
does in torch for other devices: κ, the mean cosine to the sink and the cosine to the mean
(SPEC §4) at each chosen query, from running sums along the keys; each key's norm and inner
product with the sink are one pass over its ``d`` components (``O(k·d)`` per group, memory
``O(d)``).

Compiled on first use and cached on disk.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...functional.dtypes import COSINE_EPS


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
    """Write the sink geometry of every chosen query into ``sink_fields[b, h, q, 1:4]`` for the
    heads ``h0 + …`` of each value group.

    ``values [b, g, k, d]`` (padding zeroed), ``is_token [b, k]`` (False at padding),
    ``sink [b]``, ``queries [b, Q]`` (−1: none; ascending
    queries read each key once). Over ``J_t`` = the real keys query ``t`` sees (``t − window <
    j ≤ t``) other than the sink: ``κ = ‖v_sink‖ / mean ‖v_j‖``, ``mean cos(v_j, v_sink)`` and
    ``cos(v_sink, mean v_j)``. Where ``J_t`` is empty, the query is not real or does not see the
    sink (its sliding ``window`` (:data:`..options.NO_WINDOW`: none) starts after it, or the sink
    comes after the query: it has no sink, SPEC §1) the fields are left as they are (NaN, as the
    caller allocates them). The sums run along the keys; keys that leave the window are taken
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
                out[1] = kappa
                out[2] = mean_cos
                out[3] = cos_mean
