"""The engine's two backends, its exactness on near-ties, and its random stream."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from cases import make_case
from reference import ref_analyze
from shared_checks import assert_metrics_equal_reference

import tl_geometry
from tl_geometry.functional.separability import METRIC_NAMES

N_VALUES = (1, 2, 3, 5, 8)


@pytest.mark.parametrize("options", [
    {}, {"queries": "all"}, {"distance": "cosine", "queries": "all"}, {"rank_by": "contribution"},
])
@pytest.mark.parametrize("case_options", [
    {"ties": True, "duplicates": True, "sink": True},
    {"padding": "left", "n_kv": 1},
    {"padding": "right", "dtype": torch.bfloat16, "n_heads": 6, "n_kv": 3},
])
def test_torch_twin_equals_numba_kernels(options, case_options):
    """Same numbers, random baseline included (one stream), and both equal the reference."""
    case = make_case(70, batch=3, **case_options)
    kwargs = dict(n_values=N_VALUES, attention_mask=case.attention_mask, random_samples=5, **options)
    compiled = tl_geometry.analyze_heads(case.cache(), backend="numba", **kwargs)
    twin = tl_geometry.analyze_heads(case.cache(), backend="torch", **kwargs)
    torch.testing.assert_close(compiled.scores, twin.scores, equal_nan=True, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(compiled.sink, twin.sink, equal_nan=True, rtol=1e-9, atol=1e-9)
    assert torch.equal(compiled.vote_counts, twin.vote_counts)
    assert torch.equal(compiled.group_counts, twin.group_counts)
    want = ref_analyze(case.pattern.double().numpy(), case.v.double().numpy(), N_VALUES,
                       queries=options.get("queries", "last"),
                       attention_mask=None if case.attention_mask is None else case.attention_mask.numpy(),
                       distance=options.get("distance", "euclidean"),
                       rank_by=options.get("rank_by", "attention"))
    assert_metrics_equal_reference(twin, want, ("top",), ("precision", "recall", "f_score", "margin", "inversions"),
                                   tol=1e-5)


@pytest.mark.parametrize("shuffle", ["values", "norms", "directions", "unselected"])
@pytest.mark.parametrize("case_options", [
    {"ties": True, "duplicates": True, "sink": True, "padding": "left"},
    {"dtype": torch.bfloat16, "n_heads": 6, "n_kv": 3, "padding": "right"},
])
def test_kernel_reads_narrow_values_in_float32_bit_for_bit(shuffle, case_options):
    """A float32 or narrower cache's values reach the compiled kernel in float32 (widened there
    before any arithmetic); every figure equals that of the same cache in float64, exactly."""
    case = make_case(71, batch=3, **case_options)
    kwargs = dict(n_values=N_VALUES, attention_mask=case.attention_mask, random_samples=5, shuffle=shuffle,
                  backend="numba")
    for queries in ("last", "all"):
        narrow = tl_geometry.analyze_heads(case.cache(), queries=queries, **kwargs)
        wide = tl_geometry.analyze_heads({k: v.double() for k, v in case.cache().items()}, queries=queries,
                                         **kwargs)
        for name in ("scores", "sink", "vote_counts", "group_counts"):
            assert torch.equal(getattr(narrow, name).nan_to_num(-7.0), getattr(wide, name).nan_to_num(-7.0)), name


def _near_tie_cache(seed: int) -> tuple[dict[str, torch.Tensor], np.ndarray, np.ndarray]:
    """One query whose unselected keys tie, up to ~1e-15 relative, with a selected key.

    ``s`` is dominated by one large contribution (‖s‖ ≈ 1) while a second selected key and
    several unselected ones have contributions of ~1e-6 that are copies of it scaled by
    1 ± k·1e-10: their D² differ by ~1e-16, the round-off of D² = E + ‖s‖² (‖s‖² ≈ 1), while
    E = D² − ‖s‖² (~1e-6) is computed to ~1e-22.
    """
    rng = np.random.default_rng(seed)
    n_pos, d = 8, 4
    alpha = np.zeros(n_pos)
    alpha[:] = rng.uniform(0.01, 0.02, n_pos)
    alpha[1], alpha[2] = 0.5, 0.3  # top-2: a large and a tiny contribution
    alpha /= alpha.sum()
    v = rng.normal(size=(n_pos, d))
    v[1] = v[1] / np.linalg.norm(v[1]) / alpha[1]  # ‖y_1‖ = 1
    small = rng.normal(size=d) * 1e-6
    v[2] = small / alpha[2]
    # y_j = y_2 · (1 + k_j·1e-10) with distinct k_j ≠ 0: every true gap is far above float64's
    # resolution of E, and far below that of D².
    ks = rng.permutation([-5, -4, -3, -2, -1, 1, 2, 3, 4, 5])
    for j in range(3, n_pos):
        v[j] = small * (1 + ks[j] * 1e-10) / alpha[j]
    pattern = np.zeros((1, 1, n_pos, n_pos))
    for t in range(n_pos):
        pattern[0, 0, t, : t + 1] = 1 / (t + 1)
    pattern[0, 0, -1] = alpha
    cache = {"blocks.0.attn.hook_pattern": torch.tensor(pattern),
             "blocks.0.attn.hook_v": torch.tensor(v[None, :, None, :])}
    return cache, alpha, v


def _exact_scores(alpha: np.ndarray, v: np.ndarray, n: int) -> tuple[Fraction, Fraction, int]:
    """P, R and GInv of the top-n set in exact rational arithmetic (SPEC §3)."""
    a = [Fraction(float(x)) for x in alpha]
    vv = [[Fraction(float(x)) for x in row] for row in v]
    order = sorted(range(len(a)), key=lambda i: (-a[i], i))
    chosen = set(order[:n])
    s = [sum(a[i] * vv[i][c] for i in chosen) for c in range(len(vv[0]))]
    d2 = [sum((a[k] * vv[k][c] - s[c]) ** 2 for c in range(len(s))) for k in range(len(a))]
    out = [k for k in range(len(a)) if k not in chosen]
    rho_max = max(d2[i] for i in chosen)
    rho_min = min(d2[j] for j in out)
    precision = Fraction(n, n + sum(d2[j] <= rho_max for j in out))
    recall = Fraction(sum(d2[i] < rho_min for i in chosen), n)
    inversions = sum(d2[j] <= d2[i] for i in chosen for j in out)
    return precision, recall, inversions


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_near_ties_are_ordered_exactly(backend):
    """The E-form comparison agrees with exact rational arithmetic where the D-form cannot."""
    d_form_wrong = 0
    for seed in range(25):
        cache, alpha, v = _near_tie_cache(seed)
        result = tl_geometry.analyze_heads(cache, n_values=(2, 3), random_samples=0, backend=backend)
        for i, n in enumerate((2, 3)):
            precision, recall, inversions = _exact_scores(alpha, v, n)
            assert result.inversions[0, 0, i].item() == inversions, (seed, n)
            assert result.precision[0, 0, i].item() == pytest.approx(float(precision), abs=1e-15)
            assert result.recall[0, 0, i].item() == pytest.approx(float(recall), abs=1e-15)
            # The old form: D² = α²‖v‖² − 2α⟨v, s⟩ + ‖s‖², compared after the square root.
            order = np.lexsort((np.arange(len(alpha)), -alpha))
            chosen = np.zeros(len(alpha), bool)
            chosen[order[:n]] = True
            s = (alpha[chosen, None] * v[chosen]).sum(0)
            dist = np.sqrt(np.maximum(alpha**2 * (v * v).sum(1) - 2 * alpha * (v @ s) + s @ s, 0))
            naive = sum(int((dist[~chosen] <= dist[k]).sum()) for k in np.flatnonzero(chosen))
            d_form_wrong += naive != inversions
    assert d_form_wrong > 0  # the cases really defeat the D-form


def test_random_samples_zero_turns_the_baseline_off():
    case = make_case(71, batch=2)
    off = tl_geometry.analyze_heads(case.cache(), n_values=(2, 3), random_samples=0)
    on = tl_geometry.analyze_heads(case.cache(), n_values=(2, 3), random_samples=4)
    assert torch.isnan(off.random_f_score).all()
    torch.testing.assert_close(off.f_score, on.f_score)
    torch.testing.assert_close(off.sink, on.sink, equal_nan=True)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_batch_width_changes_nothing_but_summation_order(backend):
    """Each sequence's figures do not depend on its batch: only the mean's sum order changes."""
    case = make_case(72, batch=4, padding="left", sink=True)
    kwargs = dict(n_values=N_VALUES, random_samples=3, queries="all", backend=backend)
    together = tl_geometry.analyze_heads(case.cache(), attention_mask=case.attention_mask, **kwargs)
    parts = []
    for b in range(4):
        one = {k: v[b : b + 1] for k, v in case.cache().items()}
        parts.append(tl_geometry.analyze_heads(one, attention_mask=case.attention_mask[b : b + 1], **kwargs))
    # Mean over sequences of per-sequence means, by hand from the single-sequence results.
    stacked = torch.stack([p.scores for p in parts])
    finite = torch.isfinite(stacked)
    by_hand = torch.where(finite, stacked, 0).sum(0) / finite.sum(0)
    # Top-N and sink removed (random draws follow the sequence's index, 0 when alone).
    for name in ("top", "sink_removed"):
        g = tl_geometry.result.GROUPS.index(name)
        torch.testing.assert_close(together.scores[g], by_hand[g], equal_nan=True, rtol=1e-12, atol=1e-12)
    assert torch.equal(together.vote_counts, sum(p.vote_counts for p in parts))


def test_numba_backend_refuses_other_devices():
    case = make_case(73)
    meta = {k: v.to("meta") for k, v in case.cache().items()}
    with pytest.raises(ValueError, match="meta"):
        tl_geometry.analyze_heads(meta)


@pytest.mark.parametrize("options", [{"queries": "all"}, {"queries": "all", "distance": "cosine"},
                                     {"queries": "last", "shuffle": "unselected"}])
def test_long_rows_count_inversions_as_the_torch_twin(options):
    """Rows of up to 80 keys with N up to 64: the compiled kernel counts inversions over the
    contaminating keys alone once that saves work (large N, few contaminating keys); its mean
    counts and every other figure equal the torch twin's, which compares every key."""
    case = make_case(31, batch=2, n_pos=80, d=6, ties=True, sink=True, padding="right")
    kwargs = dict(n_values=(1, 4, 16, 32, 64), attention_mask=case.attention_mask, random_samples=3,
                  shuffle_samples=3, **options)
    compiled = tl_geometry.analyze_heads(case.cache(), backend="numba", **kwargs)
    twin = tl_geometry.analyze_heads(case.cache(), backend="torch", **kwargs)
    torch.testing.assert_close(compiled.scores, twin.scores, rtol=1e-9, atol=1e-9, equal_nan=True)
    assert (compiled.scores[:, METRIC_NAMES.index("inversions")].nan_to_num(0) > 0).any()


@pytest.mark.parametrize("stop", [0, 3, 4, 9, 16])
def test_rows_added_four_at_a_time_round_as_one_at_a_time(stop):
    """The kernel adds weighted value rows (the outputs and s_N of SPEC §10) four per pass;
    every component is still summed row after row, so the sums are the plain loop's bit for bit."""
    from tl_geometry.engine.compiled.score import _add_rows

    rng = np.random.default_rng(stop)
    values = rng.standard_normal((20, 7)) * 10.0 ** rng.integers(-8, 8, size=(20, 1))
    weights = rng.random(20)
    index = rng.permutation(20)
    vecs = rng.standard_normal((2, 7))
    want, want_total = vecs.copy(), 0.5
    for j in range(1, stop):
        want[1] += weights[index[j]] * values[index[j]]
        want_total += weights[index[j]]
    total = _add_rows(index, 1, stop, weights, values, vecs, 1, 0.5)
    assert np.array_equal(vecs, want) and total == want_total


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("options", [{"queries": "all"}, {"queries": "last", "shuffle": "unselected"},
                                     {"queries": "all", "distance": "cosine"}])
def test_inner_products_from_the_gram_matrix_or_from_the_vectors_agree(backend, options, monkeypatch):
    """Short sequences and many queries read the inner products from tied Gram matrices, the
    last query of long ones from the vectors (``layer._uses_gram``): forced either way, the same
    numbers within round-off, exact ties kept (duplicated vectors, tied weights), the same votes."""
    from tl_geometry.engine import layer

    case = make_case(72, batch=3, ties=True, duplicates=True, sink=True, padding="left")
    kwargs = dict(n_values=N_VALUES, attention_mask=case.attention_mask, random_samples=5, backend=backend,
                  **options)
    monkeypatch.setattr(layer, "_uses_gram", lambda *args: True)
    from_gram = tl_geometry.analyze_heads(case.cache(), **kwargs)
    monkeypatch.setattr(layer, "_uses_gram", lambda *args: False)
    from_vectors = tl_geometry.analyze_heads(case.cache(), **kwargs)
    torch.testing.assert_close(from_gram.scores, from_vectors.scores, equal_nan=True, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(from_gram.sink, from_vectors.sink, equal_nan=True, rtol=1e-12, atol=1e-12)
    assert torch.equal(from_gram.group_counts, from_vectors.group_counts)
    assert torch.equal(from_gram.vote_counts, from_vectors.vote_counts)


def test_the_gram_matrix_is_read_where_it_is_cheaper():
    """The cost rule: every query of a short window and the last query of a short one read Gram
    matrices, the last query of a long window reads the vectors, and no matrix above the cap."""
    from types import SimpleNamespace as NS

    from tl_geometry.engine import layer
    from tl_geometry.engine.options import check_options

    def uses(n_pos, n_queries, group_size=3, d=64, window=None):
        block = NS(source=NS(shape=(1, 9, n_pos)), queries=torch.zeros(1, n_queries), group_size=group_size,
                   window=window)
        return layer._uses_gram(block, check_options(), d)

    assert uses(128, 1) and uses(1024, 1024) and uses(4096, 4096)
    assert not uses(4096, 1) and not uses(16384, 1) and not uses(16384, 256)
    assert uses(512, 1) and not uses(512, 1, window=64)  # a window's rows read few keys
    assert not uses(12000, 12000)  # 1.07 GiB per group: above GRAM_MAX_BYTES
