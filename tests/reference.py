"""Slow, literal NumPy reference for the tl_geometry metrics (tests only).

This module re-implements ``/work/shared/SPEC.md`` sections 1-5, 6a, 6d and 10 with plain Python loops in
float64, so that the vectorised torch implementation in ``tl_geometry`` can be checked against
something that is obviously correct. It deliberately imports neither torch nor tl_geometry: only
numpy and the standard library. Clarity beats speed everywhere; nothing here is vectorised
beyond single-vector norms and dot products.

Conventions (shared with the tests):

* ``alpha``: 1-D ``[key]``, one attention row. ``values``: 2-D ``[key, d]``, the value vectors
  ``v_i`` of the KV head that the query head reads (or ``v_i W_O[h]`` in output space).
  ``y_i = alpha_i * v_i`` (SPEC section 1).
* ``valid``: bool ``[key]``; True means key ``i`` exists for this query (causal ``i <= t`` and
  not padding). Only valid keys take part in anything: selection, distances and counts.
* ``N`` is defined only for ``1 <= N < (number of valid keys)`` (SPEC section 2); otherwise every
  metric is NaN.
* Every input is cast to float64 first (``np.asarray(x, dtype=np.float64)``, which copies when the
  dtype differs); inputs are never modified. Pass NumPy arrays (convert bf16 torch tensors with
  ``.float().numpy()`` in the test before calling).
"""

from __future__ import annotations

import math

import numpy as np

EPS = 1e-12  # the eta of the cosine distance / cosine similarity (SPEC section 3)

METRICS = ("precision", "recall", "f_score", "margin", "inversions", "precision_cc", "f_score_cc")
TRUNCATION = ("tail_mass", "truncation_error")  # SPEC section 10
GROUPS = ("top", "random", "shuffled", "sink_removed", "sink_in", "sink_out")
SINK_KEYS = ("mass", "norm_ratio", "cosine", "mean_cosine", "share")
# The bounds of SPEC section 6 covered here (the inversion certificate, 6a, and the shell
# certificate with K = 0 and K = N, 6d; the regime bounds of 6b have no reference) and their
# figures: the lower bounds on P, R, F and whether they certify P = R = 1 ("separated", ours).
BOUND_KINDS = ("inversion", "shell", "shell_n")
BOUND_METRICS = ("precision", "recall", "f_score", "separated")
VOTES = ("current", "sink", "other")
LABELS = ("Retriever", "Mixer", "Reset")  # same order as VOTES; also the tie-break order


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------


def _f64(x) -> np.ndarray:
    """Return ``x`` as a float64 array (a copy when the dtype differs; never modified)."""
    return np.asarray(x, dtype=np.float64)


def _bool(x) -> np.ndarray:
    """Return ``x`` as a 1-D bool array."""
    return np.asarray(x, dtype=bool)


def _norm(x: np.ndarray) -> float:
    """Euclidean norm of one vector, written out: sqrt(sum_k x_k^2)."""
    total = 0.0
    for component in x:
        total += float(component) * float(component)
    return math.sqrt(total)


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """Inner product of two vectors, written out: sum_k a_k b_k."""
    total = 0.0
    for a_k, b_k in zip(a, b):
        total += float(a_k) * float(b_k)
    return total


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    """cos(a, b) = <a, b> / (||a|| ||b|| + 1e-12) (SPEC sections 3 and 4)."""
    return _dot(a, b) / (_norm(a) * _norm(b) + EPS)


def _valid_indices(valid: np.ndarray) -> list[int]:
    """The indices i with valid[i] True, in increasing order."""
    return [i for i in range(len(valid)) if bool(valid[i])]


def _nanmean(xs) -> float:
    """Mean of the non-NaN entries of ``xs``; NaN when there are none (no warnings)."""
    kept = [float(x) for x in xs if not math.isnan(float(x))]
    if not kept:
        return math.nan
    return sum(kept) / len(kept)


def _variance_of_mean(xs) -> float:
    """The Monte Carlo variance of the mean of the draws ``xs``: their sample variance (n − 1)
    over n; NaN below two draws or where a draw is NaN."""
    xs = [float(x) for x in xs]
    if len(xs) < 2 or any(math.isnan(x) for x in xs):
        return math.nan
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) / len(xs)


def _baseline_errors(rows) -> tuple[float, float]:
    """The random baseline's standard errors (SPEC section 3) from ``rows``, one list per
    sequence of ``(row mean, variance of the row mean)`` over its chosen queries: over sequences
    (the sample standard deviation of the per-sequence nan-means over sqrt(S)) and Monte Carlo
    (sqrt(sum over sequences of sum of the defined rows' variances / Q_s^2) / S)."""
    means, variances = [], []
    for seq in rows:
        defined = [(x, var) for x, var in seq if not math.isnan(x)]
        if not defined:
            continue
        means.append(sum(x for x, _ in defined) / len(defined))
        variances.append(sum(var for _, var in defined) / len(defined) ** 2)
    if not means:
        return math.nan, math.nan
    over = math.nan
    if len(means) >= 2:
        mean = sum(means) / len(means)
        over = math.sqrt(sum((x - mean) ** 2 for x in means) / (len(means) - 1) / len(means))
    return over, math.sqrt(sum(variances)) / len(means)


def _plain_mean(xs) -> float:
    """Plain mean of ``xs`` (NaN propagates); NaN when ``xs`` is empty."""
    xs = [float(x) for x in xs]
    if not xs:
        return math.nan
    return sum(xs) / len(xs)


def _nan_metrics() -> dict:
    return dict.fromkeys(METRICS + TRUNCATION, math.nan)


# ---------------------------------------------------------------------------------------------
# SPEC section 2: top-N selection
# ---------------------------------------------------------------------------------------------


def ref_top_n(alpha, valid, n, scores=None) -> np.ndarray:
    """Top-N selection among the valid keys (SPEC section 2).

    The ``n`` valid keys with the largest ``alpha`` (or ``scores`` when given: the "rank by
    contribution" variant, ``scores_i = alpha_i ||v_i||``), ties broken toward the LOWER index,
    implemented literally by sorting the valid indices by the key ``(-score_i, i)``.

    Returns a bool mask ``[key]``; all False when ``n`` is outside ``1 <= n < #valid``.
    """
    alpha = _f64(alpha)
    valid = _bool(valid)
    ranking = alpha if scores is None else _f64(scores)
    selected = np.zeros(len(alpha), dtype=bool)

    candidates = _valid_indices(valid)
    n = int(n)
    if not (1 <= n < len(candidates)):
        return selected

    order = sorted(candidates, key=lambda i: (-float(ranking[i]), i))
    for i in order[:n]:
        selected[i] = True
    return selected


# ---------------------------------------------------------------------------------------------
# SPEC section 3: geometric precision / recall / F / margin / inversions
# ---------------------------------------------------------------------------------------------


def _distance(y_i: np.ndarray, s: np.ndarray, distance: str) -> float:
    """d(y_i, s): Euclidean ``||y_i - s||`` or cosine ``1 - <y_i,s>/(||y_i|| ||s|| + 1e-12)``.

    Computed directly from the difference vector / the definition (SPEC section 3), never via
    expanded inner-product identities.
    """
    if distance == "euclidean":
        return _norm(y_i - s)
    if distance == "cosine":
        return 1.0 - _dot(y_i, s) / (_norm(y_i) * _norm(s) + EPS)
    raise ValueError(f"unknown distance {distance!r}")


def ref_distances(alpha, values, selected, valid, distance="euclidean") -> dict[int, float]:
    """D_i = d(y_i, s_N) for every valid key i, with s_N = sum_{i in S} alpha_i v_i.

    Returns ``{i: D_i}`` over the valid keys (SPEC section 3). The aggregate is NOT renormalised.
    """
    alpha = _f64(alpha)
    values = _f64(values)
    selected = _bool(selected)
    valid = _bool(valid)

    y = {}
    for i in _valid_indices(valid):
        y[i] = alpha[i] * values[i]

    s = np.zeros(values.shape[1], dtype=np.float64)
    for i in _valid_indices(valid):
        if selected[i]:
            s = s + y[i]

    return {i: _distance(y[i], s, distance) for i in _valid_indices(valid)}


def ref_separability(alpha, values, selected, valid, distance="euclidean") -> dict:
    """Extremal geometric precision, recall, F-score, margin, inversions (SPEC section 3).

    ``selected`` is the selection S (bool ``[key]``, a subset of ``valid``), N = |S|::

        rho_max = max_{i in S} D_i                 rho_min = min_{j valid, not in S} D_j
        P = N / (N + #{j not in S : D_j <= rho_max})     (a tie counts as contamination)
        R = #{i in S : D_i < rho_min} / N                 (a tie is not recalled)
        F = 2PR / (P + R), and F = 0 when R = 0
        margin = rho_min - rho_max
        inversions = sum_{i in S} sum_{j not in S} 1{D_j <= D_i}
        P* = (P - N/#valid) / (1 - N/#valid)      (chance-corrected precision, ours)
        F* = 2 P* R / (P* + R), and F* = 0 when P* = 0 or R = 0

    Every value is NaN when N is outside ``1 <= N < #valid``.
    """
    selected = _bool(selected)
    valid = _bool(valid)
    for i in range(len(selected)):
        if selected[i] and not valid[i]:
            raise ValueError(f"key {i} is selected but not valid")

    n_valid = len(_valid_indices(valid))
    n = sum(1 for i in range(len(selected)) if selected[i])
    if not (1 <= n < n_valid):
        return _nan_metrics()

    dist = ref_distances(alpha, values, selected, valid, distance)
    inside = [i for i in _valid_indices(valid) if selected[i]]
    outside = [j for j in _valid_indices(valid) if not selected[j]]

    rho_max = max(dist[i] for i in inside)
    rho_min = min(dist[j] for j in outside)

    contaminants = 0
    for j in outside:
        if dist[j] <= rho_max:
            contaminants += 1
    precision = n / (n + contaminants)

    recalled = 0
    for i in inside:
        if dist[i] < rho_min:
            recalled += 1
    recall = recalled / n

    f_score = 0.0 if recall == 0 else 2.0 * precision * recall / (precision + recall)

    inversions = 0
    for i in inside:
        for j in outside:
            if dist[j] <= dist[i]:
                inversions += 1

    floor = n / n_valid
    precision_cc = (precision - floor) / (1.0 - floor)
    f_score_cc = 0.0
    if precision_cc > 0 and recall > 0:
        f_score_cc = 2.0 * precision_cc * recall / (precision_cc + recall)

    return {
        "precision": float(precision),
        "recall": float(recall),
        "f_score": float(f_score),
        "margin": float(rho_min - rho_max),
        "inversions": float(inversions),
        "precision_cc": float(precision_cc),
        "f_score_cc": float(f_score_cc),
    }


# ---------------------------------------------------------------------------------------------
# SPEC section 10: certified top-N truncation
# ---------------------------------------------------------------------------------------------


def ref_truncation(alpha, values, selected, valid, candidates=None) -> dict:
    """Tail mass and relative output error of the renormalised selection (SPEC section 10).

    ``valid``: the query's keys T_t (the output and the tail are over them); ``candidates``: the
    keys the selection was drawn from (default ``valid``; the sink-removed group leaves the
    sink out), which fix whether N is in range::

        o    = sum_{i in T_t} alpha_i v_i
        tau  = sum_{i in T_t, i not in S} alpha_i
        kept = sum_{i in S} alpha_i                        (over the selected keys, never 1 - tau)
        o_N  = (sum_{i in S} alpha_i v_i) / kept
        truncation_error = ||o - o_N|| / ||o||              (NaN when o = 0 or kept < 1e-6)

    Both NaN when N = |S| is outside ``1 <= N < #candidates``.
    """
    alpha = _f64(alpha)
    values = _f64(values)
    selected = _bool(selected)
    valid = _bool(valid)
    candidates = valid if candidates is None else _bool(candidates)
    n = sum(1 for i in range(len(selected)) if selected[i])
    if not (1 <= n < len(_valid_indices(candidates))):
        return {"tail_mass": math.nan, "truncation_error": math.nan}

    o = np.zeros(values.shape[1], dtype=np.float64)
    kept = np.zeros(values.shape[1], dtype=np.float64)
    tail = 0.0
    kept_mass = 0.0
    for i in _valid_indices(valid):
        o = o + alpha[i] * values[i]
        if selected[i]:
            kept = kept + alpha[i] * values[i]
            kept_mass += float(alpha[i])
        else:
            tail += float(alpha[i])
    norm_o = _norm(o)
    error = _norm(o - kept / kept_mass) / norm_o if norm_o > 0 and kept_mass >= 1e-6 else math.nan
    return {"tail_mass": tail, "truncation_error": error}


# ---------------------------------------------------------------------------------------------
# SPEC section 4: sink diagnostics for one query
# ---------------------------------------------------------------------------------------------


def ref_sink(alpha, values, valid, sink) -> dict:
    """Sink diagnostics for one query (SPEC section 4).

    ``sink`` is the index of the sink key (first valid position of the sequence); the "others"
    are the valid keys j != sink::

        mass        = alpha_sink
        norm_ratio  = ||v_sink|| / mean_j ||v_j||
        cosine      = mean_j cos(v_sink, v_j)                (signed, never clipped)
        mean_cosine = cos(v_sink, mean_j v_j)
        share       = alpha_sink ||v_sink|| / sum_{valid j (sink included)} alpha_j ||v_j||
                      (NaN when that sum is 0)

    with cos(a, b) = <a, b> / (||a|| ||b|| + 1e-12). All NaN when there is no other valid key.
    """
    alpha = _f64(alpha)
    values = _f64(values)
    valid = _bool(valid)
    sink = int(sink)

    others = [j for j in _valid_indices(valid) if j != sink]
    if not others:
        return dict.fromkeys(SINK_KEYS, math.nan)

    v_sink = values[sink]
    norm_sink = _norm(v_sink)

    mean_other_norm = sum(_norm(values[j]) for j in others) / len(others)
    with np.errstate(divide="ignore", invalid="ignore"):
        norm_ratio = float(np.float64(norm_sink) / np.float64(mean_other_norm))

    cosine = sum(_cos(v_sink, values[j]) for j in others) / len(others)

    mean_other = np.zeros(values.shape[1], dtype=np.float64)
    for j in others:
        mean_other = mean_other + values[j]
    mean_other = mean_other / len(others)
    mean_cosine = _cos(v_sink, mean_other)

    total = 0.0
    for j in _valid_indices(valid):
        total += float(alpha[j]) * _norm(values[j])
    share = math.nan if total == 0 else float(alpha[sink]) * norm_sink / total

    return {
        "mass": float(alpha[sink]),
        "norm_ratio": norm_ratio,
        "cosine": float(cosine),
        "mean_cosine": float(mean_cosine),
        "share": float(share),
    }


# ---------------------------------------------------------------------------------------------
# SPEC section 5: source-winner vote for one query
# ---------------------------------------------------------------------------------------------


def ref_vote(alpha, values, valid, t, sink) -> str:
    """Source-winner vote of one query (SPEC section 5).

    j* = argmax over valid j of alpha_j ||v_j||, ties to the LOWER index (scan in increasing
    index, replace only on a strictly larger contribution). Returns "current" if j* == t
    (checked first), "sink" if j* == sink, else "other".
    """
    alpha = _f64(alpha)
    values = _f64(values)
    valid = _bool(valid)

    winner = None
    best = -math.inf
    for j in _valid_indices(valid):
        contribution = float(alpha[j]) * _norm(values[j])
        if winner is None or contribution > best:
            winner, best = j, contribution
    if winner is None:
        raise ValueError("no valid key to vote for")

    if winner == int(t):
        return "current"
    if winner == int(sink):
        return "sink"
    return "other"


def ref_label(counts) -> str | None:
    """Plurality label from vote counts (current, sink, other); ties Retriever > Mixer > Reset.

    Scanning in the order Retriever, Mixer, Reset and replacing only on a strictly larger count
    implements the tie rule. With no votes at all the head has no label: None (SPEC §5).
    """
    if sum(counts) == 0:
        return None
    best_label, best_count = LABELS[0], counts[0]
    for label, count in zip(LABELS[1:], counts[1:]):
        if count > best_count:
            best_label, best_count = label, count
    return best_label


# ---------------------------------------------------------------------------------------------
# the full per-layer pipeline, by loops
# ---------------------------------------------------------------------------------------------


def _head_values(v: np.ndarray, b: int, h: int, n_heads: int, W_O) -> np.ndarray:
    """Values ``[pos, d]`` read by query head ``h`` in sequence ``b`` (SPEC section 1).

    Query head h reads kv head ``h // (n_heads // n_kv)``. With ``W_O`` (``[head, d_head,
    d_model]``) each row is mapped to output space, ``v_i @ W_O[h]``.
    """
    n_kv = v.shape[2]
    if n_heads % n_kv != 0:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv={n_kv}")
    kv = h // (n_heads // n_kv)
    rows = []
    for i in range(v.shape[1]):
        row = v[b, i, kv, :]
        if W_O is not None:
            row = row @ W_O[h]
        rows.append(row)
    return np.array(rows, dtype=np.float64)


def _sequence_layout(mask_row: np.ndarray):
    """(sink, valid query positions) of one sequence; sink is None when nothing is valid."""
    positions = [t for t in range(len(mask_row)) if mask_row[t] == 1]
    if not positions:
        return None, []
    return positions[0], positions


def _key_mask(mask_row: np.ndarray, t: int, window=None) -> np.ndarray:
    """Valid keys of query t: {i : mask[i] == 1 and i <= t}, and t - window < i with a sliding
    window (SPEC section 1: the keys the query can see)."""
    valid = np.zeros(len(mask_row), dtype=bool)
    for i in range(len(mask_row)):
        if mask_row[i] == 1 and i <= t and (window is None or i > t - window):
            valid[i] = True
    return valid


def _sink_query(t: int, sink: int, window, queries: str) -> int:
    """The query whose sink figures stand for query t (SPEC section 1, sink-visible reading):
    with the last-query protocol on a sliding-window layer, the last query that sees the sink,
    min(t, sink + window - 1); t itself otherwise."""
    if queries == "last" and window is not None:
        return min(t, sink + window - 1)
    return t


def _ranking_scores(alpha: np.ndarray, values: np.ndarray, rank_by: str):
    """None (rank by alpha) or the contributions alpha_i ||v_i|| (rank by contribution)."""
    if rank_by == "attention":
        return None
    if rank_by == "contribution":
        return np.array([float(alpha[i]) * _norm(values[i]) for i in range(len(alpha))])
    raise ValueError(f"unknown rank_by {rank_by!r}")


def ref_null_values(values, listed, drawn, kind="values") -> np.ndarray:
    """The values of one permutation of a null of SPEC section 3: key ``listed[i]`` draws key
    ``drawn[i]``; every other key keeps its value.

    * "values" and "unselected": it takes ``v_drawn``;
    * "norms": it keeps its direction and takes the norm of ``v_drawn``;
    * "directions": it keeps its norm and takes the direction of ``v_drawn``.

    A zero vector has no direction: a key whose own value ("norms") or drawn value
    ("directions") is zero gets the zero vector.
    """
    values = _f64(values)
    moved = values.copy()
    for k, src in zip(listed, drawn):
        if kind in ("values", "unselected"):
            moved[k] = values[src]
        elif kind == "norms":
            own = _norm(values[k])
            moved[k] = values[k] / own * _norm(values[src]) if own > 0 else 0.0
        elif kind == "directions":
            other = _norm(values[src])
            moved[k] = values[src] / other * _norm(values[k]) if other > 0 else 0.0
        else:
            raise ValueError(f"unknown shuffle {kind!r}")
    return moved


def ref_analyze(
    pattern,
    v,
    n_values,
    queries="last",
    attention_mask=None,
    distance="euclidean",
    W_O=None,
    rank_by="attention",
    shuffles=None,
    window=None,
    randoms=None,
    shuffle="values",
    sink=None,
) -> dict:
    """The whole per-layer analysis for ONE layer, by loops (SPEC sections 1-5 and 10).

    ``pattern``: ``[batch, head, query, key]``; ``v``: ``[batch, pos, kv_head, d_head]``;
    ``attention_mask``: ``[batch, pos]`` of 0/1 or None (all ones); ``W_O``: optional
    ``[head, d_head, d_model]`` (output space; then the values for head h are
    ``v[b, :, kv(h), :] @ W_O[h]`` everywhere: selection, metrics, sink diagnostics, votes).

    Per sequence b: start = first position with mask 1; sink = start (``sink=None``), or
    start + sink[b] (``sink``: one int per sequence, or one int for all; keys before the sink are
    ordinary keys); query t is valid iff mask[b, t] == 1;
    its valid keys are {i : mask[b, i] == 1, i <= t}. Chosen queries: "last" = the largest
    valid t, "all" = every valid t.

    Groups, per head and N:

    * "top": top-N among the valid keys; "sink_removed": the sink deleted from the key set
      (neither selectable nor scored), top-N re-selected among the rest. Aggregation: per
      sequence nan-mean over its chosen queries, then nan-mean over sequences.
    * "shuffled" (only with ``shuffles``): ``shuffles(b, h, t, domain)`` returns permutations
      ``σ`` of ``domain``, the non-sink valid keys in position order. The null moves ``listed``:
      the whole domain, or for ``shuffle="unselected"`` the keys outside the top-N set; key
      ``listed[i]`` draws the ``i``-th key of ``listed`` in ``σ``'s order (the sink keeps its own
      value), and ``ref_null_values`` builds the values of the null ``shuffle``. The top-N set
      of the real alpha is scored on those values; the mean over permutations is one instance.
    * "random" (only with ``randoms``): ``randoms(b, h, t, keys)`` returns orderings of the
      valid keys; the first N keys of each are a random subset, scored around its own
      aggregate; the mean over orderings is one instance.
    * ``window`` (SPEC section 1, sliding windows): query t's valid keys are also
      ``i > t - window``. A query whose valid keys miss the sink has no sink: it is in no
      sink_in / sink_out group and no paired ratio, its sink_removed metrics and sink
      diagnostics are NaN, every valid key is shuffled, and it cannot vote "sink". With
      ``queries="last"``, the sink-dependent figures (sink_in / sink_out, sink_removed, paired,
      sink diagnostics) are read at ``min(t, sink + window - 1)`` (``_sink_query``).
    * the "top" and "sink_removed" groups (and "sink_in" / "sink_out", which split "top") also
      get the truncation figures of ``ref_truncation`` (SPEC section 10); the baselines
      ("random", "shuffled") carry NaN there: metrics ``METRICS + TRUNCATION``.
    * paired sink effect ("paired_ratios"): per (head, N), the list of
      F_N(top) / F_N(sink removed) over the instances whose top-N set holds the sink (inf when
      only the second is 0; instances where both are 0 are left out).
    * "sink_in" / "sink_out": the "top" instances with N in range, split by whether the sink is
      in S_N; plain mean over all instances pooled over sequences and queries (NaN if empty);
      plus the instance counts.

    Sink diagnostics: ``ref_sink`` for each chosen query with at least one valid key != sink,
    per-sequence nan-mean then nan-mean over sequences. Taxonomy: ``ref_vote`` over EVERY valid
    query t > start (independent of ``queries``), counts pooled over sequences: "vote_counts"
    those of the queries that decide the label (every one without a window; t - window < sink
    with one), "beyond_counts" the others; "block_counts" maps (b, block) to the deciding counts
    of block (t - start - 1) // 128 of sequence b, complete blocks (128 deciding queries) only.
    """
    pattern = _f64(pattern)
    v = _f64(v)
    W_O = None if W_O is None else _f64(W_O)
    sink_arg = sink
    n_values = [int(n) for n in n_values]
    if isinstance(queries, str) and queries not in ("last", "all"):
        raise ValueError(f"unknown queries {queries!r}")
    if distance not in ("euclidean", "cosine"):
        raise ValueError(f"unknown distance {distance!r}")
    if rank_by not in ("attention", "contribution"):
        raise ValueError(f"unknown rank_by {rank_by!r}")

    n_batch, n_heads, _, n_pos = pattern.shape
    if attention_mask is None:
        mask = np.ones((n_batch, n_pos), dtype=np.int64)
    else:
        mask = np.asarray(attention_mask).astype(np.int64)

    n_n = len(n_values)
    every = METRICS + TRUNCATION
    scored = ("top", "random", "shuffled", "sink_removed")
    out: dict = {}
    for g in GROUPS:
        for m in every:
            out[f"{g}_{m}"] = np.full((n_heads, n_n), np.nan)
    out["paired_ratios"] = [[[] for _ in range(n_n)] for _ in range(n_heads)]
    out["sink_in_count"] = np.zeros((n_heads, n_n), dtype=np.int64)
    out["sink_out_count"] = np.zeros((n_heads, n_n), dtype=np.int64)
    for k in SINK_KEYS:
        out[f"sink_{k}"] = np.full(n_heads, np.nan)
    for m in every:  # the random baseline's standard errors (SPEC section 3)
        out[f"random_se_sequences_{m}"] = np.full((n_heads, n_n), np.nan)
        out[f"random_se_monte_carlo_{m}"] = np.full((n_heads, n_n), np.nan)
    out["vote_counts"] = np.zeros((n_heads, 3), dtype=np.int64)
    out["beyond_counts"] = np.zeros((n_heads, 3), dtype=np.int64)
    out["block_counts"] = {}
    out["vote_fractions"] = np.full((n_heads, 3), np.nan)
    out["labels"] = []

    for h in range(n_heads):
        # per (N, group, metric): list over sequences of that sequence's nan-mean
        per_seq = {(ni, g, m): [] for ni in range(n_n) for g in scored for m in every}
        # per (N, metric): per sequence, the list of (row mean, its Monte Carlo variance)
        random_rows = {(ni, m): [] for ni in range(n_n) for m in every}
        # per (N, group, metric): pooled list of instance values (sink_in / sink_out)
        pooled = {(ni, g, m): [] for ni in range(n_n) for g in ("sink_in", "sink_out")
                  for m in every}
        sink_per_seq = {k: [] for k in SINK_KEYS}
        votes = dict.fromkeys(VOTES, 0)
        beyond = dict.fromkeys(VOTES, 0)

        for b in range(n_batch):
            start, valid_queries = _sequence_layout(mask[b])
            if start is None:
                continue
            if sink_arg is None:
                sink = start
            else:
                sink = start + (int(sink_arg) if np.ndim(sink_arg) == 0 else int(sink_arg[b]))
            values = _head_values(v, b, h, n_heads, W_O)
            if isinstance(queries, str):
                chosen = valid_queries if queries == "all" else [max(valid_queries)]
            else:  # explicit absolute positions per sequence (sampled or given queries)
                chosen = [t for t in queries[b] if t in valid_queries]

            # --- separability groups ---
            for ni, n in enumerate(n_values):
                this_seq = {(g, m): [] for g in scored for m in every}
                for m in every:
                    random_rows[(ni, m)].append([])
                for t in chosen:
                    alpha = pattern[b, h, t, :]
                    valid = _key_mask(mask[b], t, window)
                    sees_sink = bool(valid[sink])
                    scores = _ranking_scores(alpha, values, rank_by)

                    # "top"
                    sel = ref_top_n(alpha, valid, n, scores=scores)
                    res = {**ref_separability(alpha, values, sel, valid, distance),
                           **ref_truncation(alpha, values, sel, valid)}
                    for m in every:
                        this_seq[("top", m)].append(res[m])

                    # The sink's figures are read at the last query that sees it (SPEC section 1,
                    # sink-visible reading): ts = min(t, sink + window - 1) for the last query.
                    ts = _sink_query(t, sink, window, queries)
                    if ts != t:
                        alpha_s, valid_s = pattern[b, h, ts, :], _key_mask(mask[b], ts, window)
                        scores_s = _ranking_scores(alpha_s, values, rank_by)
                        sel_s = ref_top_n(alpha_s, valid_s, n, scores=scores_s)
                        res_s = {**ref_separability(alpha_s, values, sel_s, valid_s, distance),
                                 **ref_truncation(alpha_s, values, sel_s, valid_s)}
                    else:
                        alpha_s, valid_s, scores_s, sel_s, res_s = alpha, valid, scores, sel, res
                    sees_sink = bool(valid_s[sink])
                    n_valid = int(valid_s.sum())
                    if 1 <= n < n_valid and sees_sink:
                        group = "sink_in" if sel_s[sink] else "sink_out"
                        for m in every:
                            pooled[(ni, group, m)].append(res_s[m])

                    # "sink_removed": the tail and the output keep the sink (a query that cannot
                    # see the sink has none: skipped)
                    valid_wo = valid_s.copy()
                    valid_wo[sink] = False
                    sel_wo = ref_top_n(alpha_s, valid_wo, n, scores=scores_s)
                    res_wo = {**ref_separability(alpha_s, values, sel_wo, valid_wo, distance),
                              **ref_truncation(alpha_s, values, sel_wo, valid_s, candidates=valid_wo)}
                    if not sees_sink:
                        res_wo = _nan_metrics()
                    for m in every:
                        this_seq[("sink_removed", m)].append(res_wo[m])

                    # paired sink effect
                    f_with, f_wo = res_s["f_score"], res_wo["f_score"]
                    if sel_s[sink] and not (math.isnan(f_with) or math.isnan(f_wo)):
                        if f_wo > 0:
                            out["paired_ratios"][h][ni].append(f_with / f_wo)
                        elif f_with > 0:
                            out["paired_ratios"][h][ni].append(math.inf)

                    # "shuffled": the output too is made of the shuffled values
                    if shuffles is not None:
                        domain = [k for k in _valid_indices(valid) if k != sink]
                        listed = [k for k in domain if not (shuffle == "unselected" and sel[k])]
                        samples = []
                        for sigma in shuffles(b, h, t, domain):
                            perm = [k for k in sigma if k in set(listed)]
                            moved = ref_null_values(values, listed, perm, shuffle)
                            # SPEC section 10: the baselines carry no truncation figures.
                            samples.append({**ref_separability(alpha, moved, sel, valid, distance),
                                            **dict.fromkeys(TRUNCATION, math.nan)})
                        for m in every:
                            this_seq[("shuffled", m)].append(_plain_mean([x[m] for x in samples]))

                    # "random"
                    if randoms is not None and 1 <= n < int(valid.sum()):
                        samples = []
                        for ordering in randoms(b, h, t, _valid_indices(valid)):
                            subset = np.zeros(n_pos, dtype=bool)
                            subset[list(ordering[:n])] = True
                            samples.append({**ref_separability(alpha, values, subset, valid, distance),
                                            **dict.fromkeys(TRUNCATION, math.nan)})
                        for m in every:
                            this_seq[("random", m)].append(_plain_mean([x[m] for x in samples]))
                            random_rows[(ni, m)][-1].append((_plain_mean([x[m] for x in samples]),
                                                             _variance_of_mean([x[m] for x in samples])))

                for g in scored:
                    for m in every:
                        per_seq[(ni, g, m)].append(_nanmean(this_seq[(g, m)]))

            # --- sink diagnostics over the chosen queries ---
            this_seq_sink = {k: [] for k in SINK_KEYS}
            for t in chosen:
                t = _sink_query(t, sink, window, queries)
                valid = _key_mask(mask[b], t, window)
                if not valid[sink] or not any(valid[j] for j in range(n_pos) if j != sink):
                    continue
                res = ref_sink(pattern[b, h, t, :], values, valid, sink)
                for k in SINK_KEYS:
                    this_seq_sink[k].append(res[k])
            for k in SINK_KEYS:
                sink_per_seq[k].append(_nanmean(this_seq_sink[k]))

            # --- taxonomy over every valid query after the first ---
            in_block: dict = {}
            for t in valid_queries:
                if t <= start:
                    continue
                valid = _key_mask(mask[b], t, window)
                vote = ref_vote(pattern[b, h, t, :], values, valid, t, sink)
                if window is None or t - window < sink:
                    votes[vote] += 1
                    counts = in_block.setdefault((t - start - 1) // 128, dict.fromkeys(VOTES, 0))
                    counts[vote] += 1
                else:
                    beyond[vote] += 1
            for block, counts in in_block.items():
                if sum(counts.values()) == 128:
                    cell = out["block_counts"].setdefault((b, block), np.zeros((n_heads, 3), dtype=np.int64))
                    cell[h] = [counts[name] for name in VOTES]

        for ni in range(n_n):
            for m in every:
                over, monte_carlo = _baseline_errors(random_rows[(ni, m)])
                out[f"random_se_sequences_{m}"][h, ni] = over
                out[f"random_se_monte_carlo_{m}"][h, ni] = monte_carlo
            for g in scored:
                for m in every:
                    out[f"{g}_{m}"][h, ni] = _nanmean(per_seq[(ni, g, m)])
            for g in ("sink_in", "sink_out"):
                for m in every:
                    out[f"{g}_{m}"][h, ni] = _plain_mean(pooled[(ni, g, m)])
                out[f"{g}_count"][h, ni] = len(pooled[(ni, g, "f_score")])

        for k in SINK_KEYS:
            out[f"sink_{k}"][h] = _nanmean(sink_per_seq[k])

        counts = [votes[name] for name in VOTES]
        total = sum(counts)
        out["vote_counts"][h, :] = counts
        out["beyond_counts"][h, :] = [beyond[name] for name in VOTES]
        if total > 0:
            out["vote_fractions"][h, :] = [c / total for c in counts]
        out["labels"].append(ref_label(counts))

    return out


# ---------------------------------------------------------------------------------------------
# SPEC section 6d: the shell certificate for one query
# ---------------------------------------------------------------------------------------------


def ref_shell_bounds(alpha, values, selected, valid, k) -> dict:
    """Shell certificate of one query (SPEC section 6d), literally, Euclidean distance.

    With y_j = alpha_j v_j, a_j = ||y_j||, s = sum_{i in S} y_i and D_j = ||y_j - s||::

        L_j = | ||s|| - a_j |                     for every valid j
        E   = S + the k unselected valid keys with the smallest L_j (ties -> lower index)
        Dlow_j = D_j if j in E else L_j
        rho_max = max_{i in S} D_i                rho_min_low = min_{j not in S} Dlow_j
        P_low = N / (N + #{j not in S : Dlow_j <= rho_max})
        R_low = #{i in S : D_i < rho_min_low} / N
        F_low = harmonic mean (0 when R_low = 0)

    Returns ``{"precision", "recall", "f_score"}``; all NaN when N is outside ``1 <= N < #valid``.
    """
    alpha = _f64(alpha)
    values = _f64(values)
    selected = _bool(selected)
    valid = _bool(valid)
    n_valid = len(_valid_indices(valid))
    n = sum(1 for i in range(len(selected)) if selected[i])
    if not (1 <= n < n_valid):
        return {"precision": math.nan, "recall": math.nan, "f_score": math.nan}

    dist = ref_distances(alpha, values, selected, valid)
    s = np.zeros(values.shape[1], dtype=np.float64)
    for i in _valid_indices(valid):
        if selected[i]:
            s = s + alpha[i] * values[i]
    norm_s = _norm(s)
    inside = [i for i in _valid_indices(valid) if selected[i]]
    outside = [j for j in _valid_indices(valid) if not selected[j]]
    shell = {j: abs(norm_s - abs(float(alpha[j])) * _norm(values[j])) for j in outside}
    exact = set(sorted(outside, key=lambda j: (shell[j], j))[: int(k)])
    low = {j: (dist[j] if j in exact else shell[j]) for j in outside}

    rho_max = max(dist[i] for i in inside)
    rho_min_low = min(low[j] for j in outside)
    contaminants = sum(1 for j in outside if low[j] <= rho_max)
    recalled = sum(1 for i in inside if dist[i] < rho_min_low)
    precision = n / (n + contaminants)
    recall = recalled / n
    f_score = 0.0 if recall == 0 else 2.0 * precision * recall / (precision + recall)
    return {"precision": float(precision), "recall": float(recall), "f_score": float(f_score)}


# ---------------------------------------------------------------------------------------------
# SPEC sections 3 and 6a: the inversion certificate; the bounds of one layer, by loops
# ---------------------------------------------------------------------------------------------


def ref_inversion_bounds(n, inversions) -> dict:
    """Inversion certificates of one instance (SPEC sections 3 and 6a), from its GInv_N::

        P_low = N / (N + GInv)        R_low = max(0, 1 - GInv / N)
        F_low = harmonic mean (0 when R_low = 0)

    Returns ``{"precision", "recall", "f_score"}``; all NaN when ``inversions`` is NaN (N out of
    range).
    """
    n, inversions = int(n), float(inversions)
    if math.isnan(inversions):
        return {"precision": math.nan, "recall": math.nan, "f_score": math.nan}
    precision = n / (n + inversions)
    recall = max(0.0, 1.0 - inversions / n)
    f_score = 0.0 if recall == 0 else 2.0 * precision * recall / (precision + recall)
    return {"precision": float(precision), "recall": float(recall), "f_score": float(f_score)}


def _with_separated(bound: dict) -> dict:
    """``bound`` plus "separated": 1.0 where it certifies P = R = 1, 0.0 where not, NaN where
    undefined (ours)."""
    p, r = bound["precision"], bound["recall"]
    if math.isnan(p) or math.isnan(r):
        return {**bound, "separated": math.nan}
    return {**bound, "separated": 1.0 if p == 1 and r == 1 else 0.0}


def ref_bounds(pattern, v, n_values, queries="last", attention_mask=None, window=None,
               rank_by="attention") -> dict:
    """The mean lower bounds of the top-N sets of ONE layer, by loops (SPEC section 6).

    Same inputs, chosen queries, candidate keys (``window`` included) and top-N sets as
    ``ref_analyze`` (``queries``: "last" or "all"; Euclidean distance, which the bounds assume).
    Per instance (a chosen query and an N in range): ``ref_inversion_bounds`` of its measured
    GInv_N ("inversion"), ``ref_shell_bounds`` with ``k = 0`` ("shell") and ``k = N``
    ("shell_n"), each with "separated". Aggregated as the "top" group: per sequence the nan-mean
    over its chosen queries, then the nan-mean over sequences.

    Returns ``{f"{kind}_{metric}": [head, n]}`` for ``kind`` in ``BOUND_KINDS`` and ``metric``
    in ``BOUND_METRICS``.
    """
    pattern = _f64(pattern)
    v = _f64(v)
    n_values = [int(n) for n in n_values]
    if queries not in ("last", "all"):
        raise ValueError(f"unknown queries {queries!r}")
    n_batch, n_heads, _, n_pos = pattern.shape
    mask = (np.ones((n_batch, n_pos), dtype=np.int64) if attention_mask is None
            else np.asarray(attention_mask).astype(np.int64))
    shell_k = {"shell": lambda n: 0, "shell_n": lambda n: n}  # the keys measured exactly
    out = {f"{kind}_{m}": np.full((n_heads, len(n_values)), np.nan) for kind in BOUND_KINDS
           for m in BOUND_METRICS}
    for h in range(n_heads):
        per_seq = {(ni, kind, m): [] for ni in range(len(n_values)) for kind in BOUND_KINDS
                   for m in BOUND_METRICS}
        for b in range(n_batch):
            start, valid_queries = _sequence_layout(mask[b])
            if start is None:
                continue
            values = _head_values(v, b, h, n_heads, None)
            chosen = valid_queries if queries == "all" else [max(valid_queries)]
            for ni, n in enumerate(n_values):
                this_seq = {(kind, m): [] for kind in BOUND_KINDS for m in BOUND_METRICS}
                for t in chosen:
                    alpha = pattern[b, h, t, :]
                    valid = _key_mask(mask[b], t, window)
                    sel = ref_top_n(alpha, valid, n, scores=_ranking_scores(alpha, values, rank_by))
                    if not sel.any():  # N out of range: no instance
                        continue
                    for kind in BOUND_KINDS:
                        if kind == "inversion":
                            inversions = ref_separability(alpha, values, sel, valid)["inversions"]
                            bound = ref_inversion_bounds(n, inversions)
                        else:
                            bound = ref_shell_bounds(alpha, values, sel, valid, shell_k[kind](n))
                        for m, x in _with_separated(bound).items():
                            this_seq[(kind, m)].append(x)
                for kind in BOUND_KINDS:
                    for m in BOUND_METRICS:
                        per_seq[(ni, kind, m)].append(_nanmean(this_seq[(kind, m)]))
        for ni in range(len(n_values)):
            for kind in BOUND_KINDS:
                for m in BOUND_METRICS:
                    out[f"{kind}_{m}"][h, ni] = _nanmean(per_seq[(ni, kind, m)])
    return out
