"""Self-checks of the slow NumPy reference (tests/reference.py) on tiny hand-worked examples.

Every expected number below is worked out by hand in the comments; the reference is then used
to check the vectorised implementation, so it must be right on its own.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from repo_paths import TESTS

sys.path.insert(0, str(TESTS))

from reference import (
    BOUND_KINDS,
    BOUND_METRICS,
    ref_analyze,
    ref_bounds,
    ref_distances,
    ref_inversion_bounds,
    ref_separability,
    ref_shell_bounds,
    ref_sink,
    ref_top_n,
    ref_vote,
)

ALL3 = np.array([True, True, True])


# ---------------------------------------------------------------------------------------------
# 3-key Euclidean example
# ---------------------------------------------------------------------------------------------
# alpha = [0.5, 0.3, 0.2]; v0 = (2, 0), v1 = (0, 2), v2 = (1.5, 3)
#   y0 = (1, 0), y1 = (0, 0.6), y2 = (0.3, 0.6)
# Top-2 by alpha: S = {0, 1};  s = y0 + y1 = (1, 0.6)
#   D0 = ||(0, -0.6)||   = 0.6
#   D1 = ||(-1, 0)||     = 1.0
#   D2 = ||(-0.7, 0)||   = 0.7
# rho_max = max(D0, D1) = 1.0;  rho_min = D2 = 0.7
# P = 2 / (2 + #{D2 <= 1.0}) = 2/3
# R = #{D_i < 0.7 : i in S} / 2 = #{D0} / 2 = 1/2
# F = 2 (2/3)(1/2) / (2/3 + 1/2) = (2/3) / (7/6) = 4/7
# margin = 0.7 - 1.0 = -0.3
# inversions: (i=0, j=2): 0.7 <= 0.6? no;  (i=1, j=2): 0.7 <= 1.0? yes  -> 1
#
# Top-1: S = {0}; s = y0 = (1, 0); D0 = 0, D1 = sqrt(1 + 0.36) = sqrt(1.36),
#   D2 = sqrt(0.49 + 0.36) = sqrt(0.85)
# rho_max = 0, rho_min = sqrt(0.85): P = 1, R = 1, F = 1, margin = sqrt(0.85), inversions 0.

ALPHA3 = np.array([0.5, 0.3, 0.2])
VALUES3 = np.array([[2.0, 0.0], [0.0, 2.0], [1.5, 3.0]])


def test_three_key_top_n():
    assert ref_top_n(ALPHA3, ALL3, 1).tolist() == [True, False, False]
    assert ref_top_n(ALPHA3, ALL3, 2).tolist() == [True, True, False]


def test_three_key_distances_n2():
    sel = ref_top_n(ALPHA3, ALL3, 2)
    d = ref_distances(ALPHA3, VALUES3, sel, ALL3)
    assert d[0] == pytest.approx(0.6)
    assert d[1] == pytest.approx(1.0)
    assert d[2] == pytest.approx(0.7)


def test_three_key_euclidean_n2():
    sel = ref_top_n(ALPHA3, ALL3, 2)
    r = ref_separability(ALPHA3, VALUES3, sel, ALL3)
    assert r["precision"] == pytest.approx(2 / 3)
    assert r["recall"] == pytest.approx(1 / 2)
    assert r["f_score"] == pytest.approx(4 / 7)
    assert r["margin"] == pytest.approx(-0.3)
    assert r["inversions"] == 1.0
    # inversion certificates (SPEC section 3): P >= N/(N+GInv), R >= max(0, 1 - GInv/N)
    assert r["precision"] >= 2 / (2 + 1) - 1e-12
    assert r["recall"] >= max(0.0, 1 - 1 / 2) - 1e-12


def test_three_key_euclidean_n1():
    sel = ref_top_n(ALPHA3, ALL3, 1)
    r = ref_separability(ALPHA3, VALUES3, sel, ALL3)
    assert (r["precision"], r["recall"], r["f_score"]) == (1.0, 1.0, 1.0)
    assert r["margin"] == pytest.approx(math.sqrt(0.85))
    assert r["inversions"] == 0.0


def test_inputs_not_modified_and_low_precision_cast():
    alpha = ALPHA3.astype(np.float16)
    values = VALUES3.astype(np.float16)
    a0, v0 = alpha.copy(), values.copy()
    sel = ref_top_n(alpha, ALL3, 2)
    r = ref_separability(alpha, values, sel, ALL3)
    assert np.array_equal(alpha, a0) and alpha.dtype == np.float16
    assert np.array_equal(values, v0) and values.dtype == np.float16
    # float16(0.3) and float16(0.2) are not exact, but the ordering D0 < D2 < D1 survives.
    assert r["precision"] == pytest.approx(2 / 3)
    assert r["recall"] == pytest.approx(1 / 2)


# ---------------------------------------------------------------------------------------------
# ties: a tie counts as contamination for P and is not recalled for R
# ---------------------------------------------------------------------------------------------
# d = 1, all numbers exact in binary.
# alpha = [0.5, 0.25, 0.25]; v = [2, -2, 6]  ->  y = [1, -0.5, 1.5]
# alpha tie between keys 1 and 2 -> the lower index (1) is selected: S = {0, 1}.
# s = 1 - 0.5 = 0.5;  D0 = |1 - 0.5| = 0.5,  D1 = |-0.5 - 0.5| = 1.0,  D2 = |1.5 - 0.5| = 1.0
# rho_max = 1.0 = rho_min (an exact tie between selected key 1 and unselected key 2)
# P = 2 / (2 + #{D2 <= 1.0}) = 2/3      (closed ball: the tie IS contamination)
# R = #{D_i < 1.0} / 2 = #{D0} / 2 = 1/2 (strict ball: key 1 is NOT recalled)
# F = 4/7, margin = 0, inversions: (0,2): 1.0 <= 0.5 no; (1,2): 1.0 <= 1.0 yes -> 1
# Breaking the tie (v2 = 6 + 2^-20 so D2 > 1.0) gives P = R = F = 1, inversions 0.

ALPHA_TIE = np.array([0.5, 0.25, 0.25])
VALUES_TIE = np.array([[2.0], [-2.0], [6.0]])


def test_alpha_tie_goes_to_lower_index():
    assert ref_top_n(ALPHA_TIE, ALL3, 2).tolist() == [True, True, False]
    # and with the tie entirely at the top: alpha = [0.25, 0.25, 0.5] -> keys 2 and 0
    assert ref_top_n(np.array([0.25, 0.25, 0.5]), ALL3, 2).tolist() == [True, False, True]


def test_distance_tie_is_contamination_and_not_recalled():
    sel = ref_top_n(ALPHA_TIE, ALL3, 2)
    d = ref_distances(ALPHA_TIE, VALUES_TIE, sel, ALL3)
    assert (d[0], d[1], d[2]) == (0.5, 1.0, 1.0)  # exact
    r = ref_separability(ALPHA_TIE, VALUES_TIE, sel, ALL3)
    assert r["precision"] == 2 / 3
    assert r["recall"] == 1 / 2
    assert r["f_score"] == pytest.approx(4 / 7)
    assert r["margin"] == 0.0
    assert r["inversions"] == 1.0


def test_broken_tie_is_clean():
    values = VALUES_TIE.copy()
    values[2, 0] = 6.0 + 2.0**-20
    sel = ref_top_n(ALPHA_TIE, ALL3, 2)
    r = ref_separability(ALPHA_TIE, values, sel, ALL3)
    assert (r["precision"], r["recall"], r["f_score"], r["inversions"]) == (1.0, 1.0, 1.0, 0.0)
    assert r["margin"] > 0


def test_r_zero_gives_f_zero():
    # y = [1, 1, 1] (v = [2, 4, 4]); S = {0, 1}; s = 2; D = [1, 1, 1].
    # P = 2 / (2 + 1) = 2/3; R = #{D_i < 1}/2 = 0 -> F = 0 (not 0/0); inversions = 2.
    r = ref_separability(ALPHA_TIE, np.array([[2.0], [4.0], [4.0]]),
                         np.array([True, True, False]), ALL3)
    assert r["precision"] == 2 / 3
    assert r["recall"] == 0.0
    assert r["f_score"] == 0.0
    assert r["inversions"] == 2.0


# ---------------------------------------------------------------------------------------------
# N = 1 Euclidean: F = 1 (the singleton is its own aggregate, D_i = 0 < D_j)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_n1_euclidean_is_trivially_separable(seed):
    rng = np.random.default_rng(seed)
    k, d = 7, 4
    alpha = rng.dirichlet(np.ones(k))
    values = rng.normal(size=(k, d))
    valid = np.ones(k, dtype=bool)
    for sel in (ref_top_n(alpha, valid, 1), np.eye(k, dtype=bool)[3]):  # also any singleton
        r = ref_separability(alpha, values, sel, valid)
        assert (r["precision"], r["recall"], r["f_score"]) == (1.0, 1.0, 1.0)
        assert r["inversions"] == 0.0 and r["margin"] > 0


@pytest.mark.parametrize("seed", range(5))
def test_inversion_certificates_and_margin_equivalence(seed):
    # SPEC section 3 theorems, on random data, both distances, all N.
    rng = np.random.default_rng(100 + seed)
    k, d = 9, 3
    alpha = rng.dirichlet(np.ones(k))
    values = rng.normal(size=(k, d))
    valid = np.ones(k, dtype=bool)
    valid[7:] = False  # keys 7, 8 do not exist for this query
    alpha[7:] = 0.0
    for distance in ("euclidean", "cosine"):
        for n in range(1, 7):
            sel = ref_top_n(alpha, valid, n)
            assert not sel[7:].any()
            r = ref_separability(alpha, values, sel, valid, distance)
            g = r["inversions"]
            assert r["precision"] >= n / (n + g) - 1e-12
            assert r["recall"] >= max(0.0, 1 - g / n) - 1e-12
            clean = r["margin"] > 0
            assert clean == (g == 0) == (r["precision"] == r["recall"] == r["f_score"] == 1.0)


def test_inversion_bounds_by_hand():
    # N = 2. GInv = 0: P = 2/2, R = 1, F = 1. GInv = 1: P = 2/3, R = 1 - 1/2 = 1/2,
    # F = 2 (2/3)(1/2) / (2/3 + 1/2) = 4/7. GInv = 3: P = 2/5, R = max(0, 1 - 3/2) = 0, F = 0.
    assert ref_inversion_bounds(2, 0.0) == {"precision": 1.0, "recall": 1.0, "f_score": 1.0}
    got = ref_inversion_bounds(2, 1.0)
    assert got == pytest.approx({"precision": 2 / 3, "recall": 0.5, "f_score": 4 / 7})
    assert ref_inversion_bounds(2, 3.0) == {"precision": 0.4, "recall": 0.0, "f_score": 0.0}
    assert all(math.isnan(x) for x in ref_inversion_bounds(2, math.nan).values())


def test_bounds_of_one_instance_are_its_direct_calls():
    # One sequence read at its last query: each mean is that one instance's bound; "separated" is
    # 1 exactly where the bound certifies P = R = 1.
    rng = np.random.default_rng(3)
    T, D = 7, 3
    pat = _causal_pattern(rng, 1, 1, T, np.ones((1, T), dtype=np.int64))
    v = rng.normal(size=(1, T, 1, D))
    out = ref_bounds(pat, v, [1, 3, 7])
    alpha, values, valid = pat[0, 0, -1], v[0, :, 0], np.ones(T, dtype=bool)
    for ni, n in enumerate([1, 3]):
        sel = ref_top_n(alpha, valid, n)
        direct = {"inversion": ref_inversion_bounds(n, ref_separability(alpha, values, sel, valid)["inversions"]),
                  "shell": ref_shell_bounds(alpha, values, sel, valid, 0),
                  "shell_n": ref_shell_bounds(alpha, values, sel, valid, n)}
        for kind in BOUND_KINDS:
            for m in ("precision", "recall", "f_score"):
                assert out[f"{kind}_{m}"][0, ni] == direct[kind][m], (kind, m, n)
            certified = direct[kind]["precision"] == direct[kind]["recall"] == 1
            assert out[f"{kind}_separated"][0, ni] == float(certified)
    assert all(math.isnan(out[f"{kind}_{m}"][0, 2]) for kind in BOUND_KINDS for m in BOUND_METRICS)  # N = T
    assert out["shell_f_score"][0, 0] == 1.0  # N = 1 is trivially separable, and the K = 0 shell sees it


# ---------------------------------------------------------------------------------------------
# N out of range -> NaN (never a crash, never a smaller N)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 3, 4, -1])
def test_n_out_of_range_is_nan(n):
    assert not ref_top_n(ALPHA3, ALL3, n).any()
    sel = np.zeros(3, dtype=bool)
    sel[: max(n, 0)] = True
    r = ref_separability(ALPHA3, VALUES3, sel, ALL3)
    assert all(math.isnan(x) for x in r.values())


def test_invalid_keys_are_ignored():
    # key 2 is invalid (e.g. a future key) even though it has the largest alpha.
    alpha = np.array([0.2, 0.1, 0.7])
    valid = np.array([True, True, False])
    assert ref_top_n(alpha, valid, 1).tolist() == [True, False, False]
    assert not ref_top_n(alpha, valid, 2).any()  # N = 2 = #valid is out of range
    # With N = 1 and one unselected valid key: S = {0}, y0 = 0.2, y1 = 0.1 * 3 = 0.3 (d = 1),
    # D0 = 0, D1 = 0.1; key 2's distance is never computed.
    values = np.array([[1.0], [3.0], [0.0]])
    d = ref_distances(alpha, values, np.array([True, False, False]), valid)
    assert set(d) == {0, 1}
    assert d[1] == pytest.approx(0.1)


def test_cosine_distance_by_hand():
    # y0 = 0.5 (2, 0) = (1, 0), y1 = 0.3 (0, 2) = (0, 0.6), y2 = 0.2 (1.5, 3) = (0.3, 0.6).
    # S = {0}, s = (1, 0): ||y0|| ||s|| = 1, so D0 = 1 - 1/(1 + 1e-12) ~ 1e-12 (the eta shows),
    # D1 = 1 - 0 = 1, D2 = 1 - 0.3 / (sqrt(0.45) * 1 + 1e-12).
    sel = ref_top_n(ALPHA3, ALL3, 1)
    d = ref_distances(ALPHA3, VALUES3, sel, ALL3, "cosine")
    assert d[0] == pytest.approx(1 - 1 / (1 + 1e-12), abs=1e-15)
    assert 0 < d[0] < 2e-12
    assert d[1] == pytest.approx(1.0)
    assert d[2] == pytest.approx(1 - 0.3 / math.sqrt(0.45))


# ---------------------------------------------------------------------------------------------
# sink diagnostics
# ---------------------------------------------------------------------------------------------


def test_sink_by_hand():
    # alpha = [0.5, 0.25, 0.25]; v_sink = (1, 0), v1 = (0, 2), v2 = (-2, 0); sink = 0
    # norms 1, 2, 2 -> norm_ratio = 1 / 2
    # cos(v_s, v1) = 0, cos(v_s, v2) = -1 -> cosine = -0.5 (signed)
    # mean of others = (-1, 1) -> mean_cosine = -1 / sqrt(2)
    # share = 0.5 * 1 / (0.5*1 + 0.25*2 + 0.25*2) = 0.5 / 1.5 = 1/3
    values = np.array([[1.0, 0.0], [0.0, 2.0], [-2.0, 0.0]])
    r = ref_sink(ALPHA_TIE, values, ALL3, 0)
    assert r["mass"] == 0.5
    assert r["norm_ratio"] == pytest.approx(0.5)
    assert r["cosine"] == pytest.approx(-0.5)
    assert r["mean_cosine"] == pytest.approx(-1 / math.sqrt(2))
    assert r["share"] == pytest.approx(1 / 3)


def test_sink_alone_or_zero_share():
    r = ref_sink(np.array([1.0, 0.0]), np.array([[1.0], [1.0]]), np.array([True, False]), 0)
    assert all(math.isnan(x) for x in r.values())
    # all contributions zero -> share NaN, other entries defined
    r = ref_sink(np.array([0.0, 0.0]), np.array([[1.0], [2.0]]), np.array([True, True]), 0)
    assert math.isnan(r["share"]) and r["norm_ratio"] == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------
# votes
# ---------------------------------------------------------------------------------------------


def test_vote_tie_goes_to_lower_index():
    # alpha = [0.5, 0.25, 0.25], ||v|| = [1, 2, 2] -> contributions [0.5, 0.5, 0.5]: all tie,
    # winner = key 0 = the sink.
    values = np.array([[1.0], [2.0], [-2.0]])
    assert ref_vote(ALPHA_TIE, values, ALL3, t=2, sink=0) == "sink"
    # contributions [0.1, 0.5, 0.5] at t = 2: winner key 1 (lower index), not the current key
    alpha = np.array([0.1, 0.25, 0.25])
    assert ref_vote(alpha, values, ALL3, t=2, sink=0) == "other"
    # contributions [0.1, 0.25, 0.5]: the current key wins
    values2 = np.array([[1.0], [1.0], [2.0]])
    assert ref_vote(alpha, values2, ALL3, t=2, sink=0) == "current"


# ---------------------------------------------------------------------------------------------
# the pipeline: consistency with the per-query functions
# ---------------------------------------------------------------------------------------------


def _causal_pattern(rng, b, h, t, mask):
    pat = np.zeros((b, h, t, t))
    for bi in range(b):
        for hi in range(h):
            for q in range(t):
                if mask[bi, q] == 0:
                    continue
                keys = [i for i in range(q + 1) if mask[bi, i] == 1]
                pat[bi, hi, q, keys] = rng.dirichlet(np.ones(len(keys)))
    return pat


def test_analyze_last_query_matches_direct_calls():
    # GQA: 4 query heads, 2 kv heads -> head h reads kv head h // 2. Sequence 1 is left-padded.
    rng = np.random.default_rng(7)
    B, H, KV, T, D = 2, 4, 2, 6, 3
    mask = np.ones((B, T), dtype=np.int64)
    mask[1, :2] = 0  # sink of sequence 1 is position 2
    pat = _causal_pattern(rng, B, H, T, mask)
    v = rng.normal(size=(B, T, KV, D))
    n_values = [1, 2, 3, 5, 6]
    out = ref_analyze(pat, v, n_values, attention_mask=mask)

    for h in range(H):
        for ni, n in enumerate(n_values):
            per_seq_f, per_seq_f_wo = [], []
            for b, sink in ((0, 0), (1, 2)):
                t = T - 1
                valid = np.array([mask[b, i] == 1 and i <= t for i in range(T)])
                alpha, values = pat[b, h, t], v[b, :, h // 2, :]
                sel = ref_top_n(alpha, valid, n)
                per_seq_f.append(ref_separability(alpha, values, sel, valid)["f_score"])
                valid_wo = valid.copy()
                valid_wo[sink] = False
                sel_wo = ref_top_n(alpha, valid_wo, n)
                per_seq_f_wo.append(
                    ref_separability(alpha, values, sel_wo, valid_wo)["f_score"])
            # np.nanmean of an all-NaN list would warn; do it by hand
            fin = [x for x in per_seq_f if not math.isnan(x)]
            exp = sum(fin) / len(fin) if fin else math.nan
            got = out["top_f_score"][h, ni]
            assert (math.isnan(exp) and math.isnan(got)) or got == pytest.approx(exp)
            fin = [x for x in per_seq_f_wo if not math.isnan(x)]
            exp = sum(fin) / len(fin) if fin else math.nan
            got = out["sink_removed_f_score"][h, ni]
            assert (math.isnan(exp) and math.isnan(got)) or got == pytest.approx(exp)

    # N = 1 Euclidean: F = 1; N = 6 is out of range for both sequences (6 and 4 valid keys)
    assert np.all(out["top_f_score"][:, 0] == 1.0)
    assert np.all(np.isnan(out["top_f_score"][:, 4]))
    # N = 5: only sequence 0 (6 valid keys) is in range; with the sink removed neither is.
    assert np.all(np.isfinite(out["top_f_score"][:, 3]))
    assert np.all(np.isnan(out["sink_removed_f_score"][:, 3]))
    # sink_in + sink_out counts = number of in-range "top" instances
    total = out["sink_in_count"] + out["sink_out_count"]
    assert total[:, 0].tolist() == [2] * H and total[:, 3].tolist() == [1] * H
    assert total[:, 4].tolist() == [0] * H
    assert np.all(np.isnan(out["sink_in_f_score"][:, 4]))
    # taxonomy is over every valid query after the sink: 5 + 3 = 8 votes per head
    assert out["vote_counts"].sum(axis=1).tolist() == [8] * H
    assert np.allclose(out["vote_fractions"].sum(axis=1), 1.0)
    assert len(out["labels"]) == H
    for h in range(H):
        counts = out["vote_counts"][h]
        best = max(counts)
        expected = ["Retriever", "Mixer", "Reset"][list(counts).index(best)]
        assert out["labels"][h] == expected


def test_analyze_all_queries_and_output_space():
    rng = np.random.default_rng(11)
    B, H, KV, T, D, M = 1, 2, 1, 5, 2, 3
    mask = np.ones((B, T), dtype=np.int64)
    pat = _causal_pattern(rng, B, H, T, mask)
    v = rng.normal(size=(B, T, KV, D))
    W_O = rng.normal(size=(H, D, M))
    out = ref_analyze(pat, v, [2], queries="all", W_O=W_O, distance="cosine",
                      rank_by="contribution")
    for h in range(H):
        values = v[0, :, 0, :] @ W_O[h]
        fs, sink_mass = [], []
        for t in range(T):
            valid = np.arange(T) <= t
            alpha = pat[0, h, t]
            scores = alpha * np.linalg.norm(values, axis=1)
            sel = ref_top_n(alpha, valid, 2, scores=scores)
            fs.append(ref_separability(alpha, values, sel, valid, "cosine")["f_score"])
            if t >= 1:
                sink_mass.append(ref_sink(alpha, values, valid, 0)["mass"])
        fin = [x for x in fs if not math.isnan(x)]  # t = 0, 1 are out of range for N = 2
        assert len(fin) == 3
        assert out["top_f_score"][h, 0] == pytest.approx(sum(fin) / len(fin))
        assert out["sink_mass"][h] == pytest.approx(sum(sink_mass) / len(sink_mass))
    assert out["vote_counts"].sum(axis=1).tolist() == [4] * H


def test_label_tie_order():
    # One head, T = 3, no padding; queries t = 1, 2 vote (t = 0 is the sink).
    # t = 1: alpha = [0.4, 0.6], ||v|| = 1 -> winner 1 = current
    # t = 2: alpha = [0.8, 0.1, 0.1]       -> winner 0 = sink
    # counts (1, 1, 0): tie between Retriever and Mixer -> Retriever
    pat = np.zeros((1, 1, 3, 3))
    pat[0, 0, 0, 0] = 1.0
    pat[0, 0, 1, :2] = [0.4, 0.6]
    pat[0, 0, 2, :] = [0.8, 0.1, 0.1]
    v = np.ones((1, 3, 1, 1))
    out = ref_analyze(pat, v, [1])
    assert out["vote_counts"][0].tolist() == [1, 1, 0]
    assert out["vote_fractions"][0].tolist() == [0.5, 0.5, 0.0]
    assert out["labels"] == ["Retriever"]
    # make t = 1 vote for the sink instead -> (0, 2, 0) -> Mixer
    pat[0, 0, 1, :2] = [0.6, 0.4]
    assert ref_analyze(pat, v, [1])["labels"] == ["Mixer"]
