"""The compiled helpers of the engine against obviously-correct references: the stable ranking,
duplicate detection by hash and the tied Gram matrices, the inner products with a selection's
aggregate (exact ties kept), the sink geometry and the query reduction against their torch
twins."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from tl_geometry.engine.backend import NUMBA, TORCH
from tl_geometry.engine.compiled.borrow import borrow
from tl_geometry.engine.compiled.geometry import _first_duplicates, tie_duplicates
from tl_geometry.engine.compiled.geometry import sink_geometry as compiled_sink_geometry
from tl_geometry.engine.compiled.order import rank_keys
from tl_geometry.engine.compiled.score import _columns, _fill_dots
from tl_geometry.engine.options import NO_WINDOW
from tl_geometry.engine.paired import N_BINS
from tl_geometry.engine.twins.geometry import sink_geometry, tied_gram
from tl_geometry.engine.twins.score import _Dots
from tl_geometry.functional.heads import first_duplicate


@njit
def _through_borrowed(array, rows):  # pragma: no cover - compiled
    view = borrow(array)
    for i in range(rows):  # writes go to the caller's memory; slices of the view work as usual
        view[i, :] = view[i, :] * 2.0 + i
    return view[1:].sum(), view.shape, view.strides


def test_a_borrowed_view_is_the_array_itself():
    """The scoring kernel passes its arrays borrowed (no reference counting): a borrowed view
    reads and writes the same memory, with the same shape and strides, also for a strided view."""
    base = np.arange(24.0).reshape(4, 6)
    for array in (base.copy(), base.copy()[:, ::2]):
        want = array * 2.0 + np.arange(4)[:, None]
        total, shape, strides = _through_borrowed(array, 4)
        assert np.array_equal(array, want) and total == want[1:].sum()
        assert shape == array.shape and strides == array.strides


def _ranked(score: np.ndarray) -> np.ndarray:
    keys = np.arange(3, 3 + len(score), dtype=np.int64)  # keys need not start at 0
    m = len(score)
    out = np.empty(m, dtype=np.int64)
    rank_keys(keys, score, np.empty(m, np.float32), np.empty(m, np.uint64), out)
    return out - 3


@pytest.mark.parametrize("kind", ["float32", "float64", "ties", "signed_zeros", "negative"])
@pytest.mark.parametrize("m", [1, 2, 7, 64, 300])
def test_rank_is_a_stable_argsort(kind, m):
    """Descending weight, ties to the lower index, whichever of its two sorts runs."""
    rng = np.random.default_rng(m)
    score = -rng.uniform(0, 1, m).astype(np.float32).astype(np.float64)
    if kind == "float64":  # not float32-representable: the merge sort
        score = -rng.uniform(0, 1, m)
    elif kind == "ties":
        score = -rng.integers(0, 4, m).astype(np.float64) / 8
    elif kind == "signed_zeros":  # −0 and +0 must tie
        score = np.where(rng.integers(0, 2, m) == 1, -0.0, 0.0)
        score[::3] = -0.25
    elif kind == "negative":  # weights a little below zero (tolerated round-off) sort last
        score = rng.choice([-0.5, -0.25, 0.0, 1e-7, 2e-7], m)
    assert np.array_equal(_ranked(score), np.argsort(score, kind="stable"))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_inner_products_with_an_aggregate_keep_duplicates_tied(dtype):
    """``⟨v_k, s⟩`` from the vectors (no Gram matrix): equal to ``V s`` within round-off, bit for
    bit equal for bit-identical vectors, and the same bits whether the keys form one range or
    are gathered around padding (SPEC §3's exact ties). The torch twin ties them too."""
    rng = np.random.default_rng(5)
    n_key, d = 23, 7  # d not a multiple of 4: the tail of the component loop runs
    values = rng.normal(size=(n_key, d)).astype(dtype)
    values[[6, 15, 20]] = values[3]
    values[11] = -0.0 * values[11] + values[4]  # equal to v_4, a signed zero aside
    columns, gdiag = np.empty((d, n_key)), np.empty(n_key)
    _columns(values, n_key, columns, gdiag)
    vecs = np.zeros((2, d))
    vecs[1] = rng.normal(size=d)
    dots_range, dots_gathered = np.full(n_key, np.nan), np.full(n_key, np.nan)
    keys = np.arange(n_key, dtype=np.int64)
    _fill_dots(columns, vecs, keys, True, dots_range)
    _fill_dots(columns, vecs, keys, False, dots_gathered)
    assert np.array_equal(dots_range, dots_gathered)
    np.testing.assert_allclose(dots_range, values.astype(np.float64) @ vecs[1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gdiag, (values.astype(np.float64) ** 2).sum(-1), rtol=1e-12)
    for k in (6, 15, 20):
        assert dots_range[k] == dots_range[3] and gdiag[k] == gdiag[3]
    assert dots_range[11] == dots_range[4]
    twin = _Dots(torch.from_numpy(values.astype(np.float64))[None, None])
    got = twin(torch.from_numpy(rng.uniform(size=(1, 1, 5, n_key))))[0, 0]
    assert all(torch.equal(got[:, k], got[:, 3]) for k in (6, 15, 20))
    assert torch.equal(twin.squared_norms[0, 0, 6], twin.squared_norms[0, 0, 3])


def test_first_duplicates_compares_rows_whose_hashes_collide():
    """Rows ``(φ, 0)`` and ``(0, 1)`` have the same hash (weights 1, φ) but are different."""
    phi = 1.0 + 0.6180339887498949
    values = np.array([[phi, 0.0], [0.0, 1.0], [1.0, 2.0], [0.0, 1.0], [phi, 0.0], [1.0, 2.0],
                       [-0.0, 1.0]])
    got = _first_duplicates(values)
    want = first_duplicate(torch.from_numpy(values)).numpy()
    assert np.array_equal(np.where(got < 0, np.arange(len(values)), got), want)
    assert want.tolist() == [0, 1, 2, 1, 0, 2, 1]


@pytest.mark.parametrize("seed", range(4))
def test_first_duplicates_equals_the_torch_reference_on_many_classes(seed):
    """Many classes of equal rows, in any order and with signed zeros, through the hash table
    (whose slots fill up and wrap around)."""
    rng = np.random.default_rng(seed)
    distinct = rng.normal(size=(12, 6))
    distinct[3] = 0.0
    values = distinct[rng.integers(0, 12, size=70)]
    values[rng.random(values.shape) < 0.1] *= -0.0  # signed zeros: x · (−0.0) is −0.0 or +0.0 by x's sign
    got = _first_duplicates(values)
    want = first_duplicate(torch.from_numpy(values)).numpy()
    assert np.array_equal(np.where(got < 0, np.arange(len(values)), got), want)
    singles = np.bincount(want, minlength=len(values))[want] == 1
    assert np.array_equal(got < 0, singles)


def test_first_duplicates_of_distinct_rows_is_empty():
    values = np.random.default_rng(0).normal(size=(50, 8))
    assert (_first_duplicates(values) < 0).all()


def test_tie_kernel_equals_the_torch_tied_gram():
    """Rows and columns of bit-identical value vectors made identical in place, as the torch
    twin's tied_gram gives them (the Gram path of many queries, SPEC §3's exact ties)."""
    rng = np.random.default_rng(3)
    values = torch.from_numpy(rng.normal(size=(2, 3, 11, 5)))
    values[:, :, 7] = values[:, :, 4]
    values[0, 1, 9] = values[0, 1, 2]
    gram = (values @ values.transpose(-1, -2)).contiguous()
    tie_duplicates(values.numpy(), gram.numpy(), 11)
    assert torch.equal(gram, tied_gram(values))
    assert torch.equal(gram[:, :, 7], gram[:, :, 4]) and torch.equal(gram[:, :, :, 7], gram[:, :, :, 4])


@pytest.mark.parametrize("window", [1, 2, 3, 5, 40])
def test_the_band_of_a_sliding_window_is_tied_like_the_whole_matrix(window):
    """A sliding-window layer builds only the band ``|i − j| < w`` of its Gram matrix; tied, every
    entry of the band is the whole tied matrix's to round-off, duplicates' rows and columns are
    equal bit for bit within the band (also where their first keys lie beyond each other's
    window), and the tie writes nothing outside the band."""
    from tl_geometry.engine.twins.geometry import band_gram

    rng = np.random.default_rng(5)
    values = torch.from_numpy(rng.normal(size=(2, 1, 23, 6)))
    values[:, :, 17] = values[:, :, 3]  # 14 apart: beyond every window but the last
    values[:, :, 18] = values[:, :, 3]
    values[1, 0, 9] = values[1, 0, 8]
    gram = band_gram(values, window)
    built = gram.clone()
    tie_duplicates(values.numpy(), gram.numpy(), min(window, 23))
    i, j = torch.meshgrid(torch.arange(23), torch.arange(23), indexing="ij")
    band = (i - j).abs() < window
    torch.testing.assert_close(gram[..., band], tied_gram(values)[..., band], rtol=1e-12, atol=1e-12)
    assert torch.equal(gram[..., ~band], built[..., ~band])  # never read, never tied
    for a, b in ((17, 3), (18, 3), (18, 17)):
        for k in range(23):
            if abs(k - a) < window and abs(k - b) < window:
                assert torch.equal(gram[0, 0, a, k], gram[0, 0, b, k])
                assert torch.equal(gram[0, 0, k, a], gram[0, 0, k, b])
    assert torch.equal(gram[1, 0, 9, 9], gram[1, 0, 8, 8])
    if window > 1:  # neighbours: within every band but the diagonal's
        assert torch.equal(gram[1, 0, 8, 9], gram[1, 0, 8, 8])


def test_reduce_kernel_equals_its_torch_twin():
    """NaN rows, infinite and zero F ratios, ±inf sink fields, sink in and out of the set, and
    queries whose window does not hold the sink (in no sink group)."""
    rng = np.random.default_rng(1)
    b, h, q, n = 3, 4, 9, 5
    metrics = torch.from_numpy(rng.uniform(0, 1, (b, h, q, 4, n, 7)))
    metrics[rng.uniform(size=metrics.shape) < 0.1] = torch.nan
    f = metrics[..., 2]
    f[rng.uniform(size=f.shape) < 0.15] = 0.0  # ratios 0, +inf and 0/0
    metrics[:, :, 2, 0] = torch.nan  # a query where nothing is defined
    inside = torch.from_numpy(rng.uniform(size=(b, h, q, n)) < 0.5)
    sink = torch.from_numpy(rng.uniform(0, 3, (b, h, q, 5)))
    sink[rng.uniform(size=sink.shape) < 0.2] = torch.nan
    sink[0, 0, 0, 1] = torch.inf
    sink[:, 1, :, 3] = torch.nan  # a field never defined
    sees = torch.from_numpy(rng.uniform(size=(b, q)) < 0.8)  # queries whose window holds the sink
    inside &= sees[:, None, :, None]
    compiled = NUMBA.reduce_rows(metrics, inside, sink, sees)
    twin = TORCH.reduce_rows(metrics, inside, sink, sees)
    for name in compiled._fields:
        torch.testing.assert_close(getattr(compiled, name), getattr(twin, name), equal_nan=True,
                                   rtol=1e-12, atol=1e-12, msg=name)
    assert compiled.paired_hist.shape[-1] == N_BINS and compiled.paired_hist.sum() > 0
    assert compiled.paired_hist[..., 0].sum() > 0 and compiled.paired_hist[..., -1].sum() > 0
    assert compiled.inst_count.sum() < torch.isfinite(metrics[:, :, :, 0, :, 0]).sum()


@pytest.mark.parametrize("window", [NO_WINDOW, 40, 200])
def test_tally_kernel_equals_its_torch_twin(window):
    """Every vote kind and −1, left and right padding, sinks after the first real token, a
    window that hides the sink from later queries, full blocks of 128 deciding queries and a
    partial one."""
    rng = np.random.default_rng(window % 7)
    b, h, n_pos = 4, 3, 300
    vote_of = torch.from_numpy(rng.integers(-1, 3, (b, h, n_pos)).astype(np.int8))
    is_token = torch.ones(b, n_pos, dtype=torch.bool)
    is_token[1, :20] = False  # left padding
    is_token[2, 250:] = False  # right padding
    start = torch.tensor([0, 20, 0, 0])
    sink = torch.tensor([0, 20, 3, 9])
    compiled = NUMBA.tally(vote_of, is_token, start, sink, window)
    twin = TORCH.tally(vote_of, is_token, start, sink, window)
    for name in twin._fields:
        assert torch.equal(getattr(compiled, name), getattr(twin, name)), name
    assert (twin.blocks.sum() > 0) == (window > 128) and (twin.beyond.sum() > 0) == (window < n_pos)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("queries", ["all", "last", "shuffled"])
def test_sink_geometry_kernel_equals_its_torch_twin(queries, window):
    """κ and the cosines at the chosen queries, from the value vectors alone, on left-padded
    sequences (queries in any order, −1 and padded queries NaN; with a sliding
    window, NaN where the window does not hold the sink)."""
    rng = np.random.default_rng(2)
    b, g, k, d, group = 3, 2, 12, 5, 2
    values = torch.from_numpy(rng.normal(size=(b, g, k, d)))
    values[:, :, 7] = values[:, :, 4]  # duplicates
    values[0, :, 9] = values[0, :, 2]
    real = torch.ones(b, k, dtype=torch.bool)
    real[1, :3] = False  # left padding: the sink is the first real key
    real[2, :1] = False
    values = torch.where(real[:, None, :, None], values, 0.0)
    sink = real.long().argmax(-1)
    chosen = {"all": torch.arange(k).repeat(b, 1), "last": torch.full((b, 1), k - 1),
              "shuffled": torch.from_numpy(rng.permutation(k)).repeat(b, 1)}[queries].clone()
    chosen[0, 0] = -1
    fields = torch.full((b, g * group, chosen.shape[1], 5), torch.nan, dtype=torch.float64)
    compiled_sink_geometry(values.numpy(), real.numpy(), sink.numpy(), chosen.numpy(), 0, group, fields.numpy(),
                           NO_WINDOW if window is None else window)
    sees = chosen - (NO_WINDOW if window is None else window) < sink[:, None]
    want = sink_geometry(values, real, sink, chosen, sees).repeat_interleave(group, dim=1)
    ok = (chosen >= 0) & real.gather(1, chosen.clamp_min(0)) & sees
    if window is not None:
        assert not sees.all() and sees.any()
    want = torch.where(ok[:, None, :, None], want, torch.nan)
    torch.testing.assert_close(fields[..., 1:4], want, equal_nan=True, rtol=1e-12, atol=1e-12)
    assert fields[..., [0, 4]].isnan().all()  # fields 0 and 4 are score_rows's
