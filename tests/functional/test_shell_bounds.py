"""SPEC §6d: the shell certificate ``functional.shell_bounds``.

Against the slow NumPy reference (``tests/reference.py``) on general-position data, and as
hypothesis properties on exactly representable data (α in eighths, integer values: every
product and sum is exact in float64, so ties are real ties): never above the measured P/R/F,
exact at ``k = T − N``, non-decreasing in ``k``; duplicates and α = 0.
"""

from __future__ import annotations

import math

import jaxtyping
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import ref_shell_bounds, ref_top_n

import tl_geometry.functional as F
from tl_geometry.functional.shell import shell_bounds

FIELDS = ("precision", "recall", "f_score")


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: OpenMP hand-offs would dominate
    yield
    torch.set_num_threads(threads)


def _loop_reference(alpha, values, n, k, key_mask, selected=None):
    """ref_shell_bounds row by row; values [..., key, d] broadcast to alpha's rows."""
    rows = alpha.shape[:-1]
    values = values.expand(*rows, *values.shape[-2:])
    out = {f: np.full(rows, math.nan) for f in FIELDS}
    for idx in np.ndindex(*rows):
        a, v, valid = alpha[idx].numpy(), values[idx].numpy(), key_mask[idx].numpy()
        sel = ref_top_n(a, valid, n) if selected is None else selected[idx].numpy()
        if not sel.any():
            continue  # n out of range: NaN
        res = ref_shell_bounds(a, v, sel, valid, k)
        for f in FIELDS:
            out[f][idx] = res[f]
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [0, 1, 3, 50])
def test_matches_reference(seed, k):
    """GQA layout: values [batch, kv, 1, key, d] shared by the queries of two query heads."""
    g = torch.Generator().manual_seed(seed)
    n_key, d = 9, 4
    logits = torch.randn(2, 3, 2, 5, n_key, generator=g, dtype=torch.float64) * 2
    if seed % 2:
        logits = logits.round()  # attention ties: the selection's lower-index rule matters
    key_mask = torch.rand(2, 3, 2, 5, n_key, generator=g) < 0.8
    alpha = logits.masked_fill(~key_mask, -math.inf).softmax(-1).nan_to_num(0.0)
    values = torch.randn(2, 3, 1, 1, n_key, d, generator=g, dtype=torch.float64) * (1 + seed)
    for n in (1, 2, 4):
        ours = shell_bounds(alpha, values, n, k=k, key_mask=key_mask)
        ref = _loop_reference(alpha, values, n, k, key_mask)
        for f in FIELDS:
            np.testing.assert_allclose(getattr(ours, f).numpy(), ref[f], rtol=0, atol=1e-12, err_msg=f)


def test_reference_with_a_given_selection_and_a_sink():
    """A random selection (not top-N) and a compressed sink pointing against the rest."""
    g = torch.Generator().manual_seed(7)
    n_key, d, n = 10, 3, 3
    values = torch.randn(4, n_key, d, generator=g, dtype=torch.float64)
    values[:, 0] = -0.1 * values[:, 1:].mean(1)
    alpha = torch.randn(4, n_key, generator=g, dtype=torch.float64).softmax(-1)
    ranks = torch.rand(4, n_key, generator=g).argsort(-1).argsort(-1)
    selected = ranks < n
    key_mask = torch.ones(4, n_key, dtype=torch.bool)
    for k in (0, 2, 7):
        ours = shell_bounds(alpha, values, n, k=k, selected=selected)
        ref = _loop_reference(alpha, values, n, k, key_mask, selected)
        for f in FIELDS:
            np.testing.assert_allclose(getattr(ours, f).numpy(), ref[f], rtol=0, atol=1e-12)


@st.composite
def exact_cases(draw):
    """α in eighths (zeros and ties), small integer values (duplicates), optional mask, and a
    values tensor shared by several rows (MQA-like broadcast)."""
    n_key = draw(st.integers(2, 9))
    d = draw(st.integers(1, 4))
    rows = draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    alpha = torch.randint(0, 9, (rows, n_key), generator=g).double() / 8
    span = draw(st.sampled_from([1, 3]))  # span 1: few distinct vectors, many duplicates
    values = torch.randint(-span, span + 1, (n_key, d), generator=g).double()
    if draw(st.booleans()):
        alpha[:, draw(st.integers(0, n_key - 1))] = 0.0
    key_mask = None
    if draw(st.booleans()):
        key_mask = torch.rand(rows, n_key, generator=g) < 0.75
    n = draw(st.integers(1, n_key - 1))
    return alpha, values, key_mask, n


SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(case=exact_cases(), k=st.integers(0, 10))
def test_never_above_measured(case, k):
    alpha, values, key_mask, n = case
    bound = shell_bounds(alpha, values, n, k=k, key_mask=key_mask)
    measured = F.separability(alpha, values, n, key_mask=key_mask)
    for f in FIELDS:
        b, m = getattr(bound, f), getattr(measured, f)
        assert torch.equal(b.isnan(), m.isnan()), f
        assert (b[~b.isnan()] <= m[~m.isnan()]).all(), (f, b, m)


@SETTINGS
@given(case=exact_cases())
def test_exact_at_full_budget(case):
    alpha, values, key_mask, n = case
    bound = shell_bounds(alpha, values, n, k=alpha.shape[-1] - n, key_mask=key_mask)
    measured = F.separability(alpha, values, n, key_mask=key_mask)
    for f in FIELDS:
        torch.testing.assert_close(getattr(bound, f), getattr(measured, f), rtol=0, atol=0, equal_nan=True)


@SETTINGS
@given(case=exact_cases())
def test_monotone_in_k(case):
    alpha, values, key_mask, n = case
    previous = None
    for k in range(alpha.shape[-1] - n + 1):
        bound = shell_bounds(alpha, values, n, k=k, key_mask=key_mask)
        if previous is not None:
            for f in FIELDS:
                b, p = getattr(bound, f), getattr(previous, f)
                assert (b[~b.isnan()] >= p[~p.isnan()]).all(), (f, k)
        previous = bound


def test_duplicate_of_a_selected_key_is_contamination():
    """N = 1 with an exact duplicate outside the selection: D_dup = D_sel = L_dup, a tie. The
    norm-only certificate must count it (P̲ = 1/2), as the measured P does."""
    alpha = torch.tensor([0.3, 0.3, 0.1], dtype=torch.float64)
    values = torch.tensor([[0.7, -1.3, 2.1], [0.7, -1.3, 2.1], [5.0, 0.0, 0.0]], dtype=torch.float64)
    bound = shell_bounds(alpha, values, 1)
    measured = F.separability(alpha, values, 1)
    assert measured.precision.item() == 0.5
    assert bound.precision.item() == 0.5 and bound.recall.item() == 0.0


def test_zero_attention_keys():
    """α_j = 0: y_j = 0, so D_j = ‖s‖ = L_j exactly; zero keys tie with each other."""
    alpha = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 3.0], [-2.0, 1.0]], dtype=torch.float64)
    for k in (0, 1, 2):
        bound = shell_bounds(alpha, values, 2, k=k)
        measured = F.separability(alpha, values, 2)
        # D_sel = 0.5 < ‖s‖ = 0.707 = D_zero: separated, and the norms alone certify it.
        assert bound.f_score.item() == measured.f_score.item() == 1.0


def test_norm_only_can_be_loose_and_k_tightens():
    """An unselected key with the same norm as s but pointing away: L = 0 certifies nothing,
    its exact distance (K = 1) certifies everything."""
    alpha = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)
    values = torch.tensor([[1.0, 0.0], [1.0, 0.0], [-2.0, 0.0]], dtype=torch.float64)
    assert shell_bounds(alpha, values, 2, k=0).f_score.item() < 1.0
    assert shell_bounds(alpha, values, 2, k=1).f_score.item() == 1.0
    assert F.separability(alpha, values, 2).f_score.item() == 1.0


def test_out_of_range_n_is_nan_and_float32_input():
    alpha = torch.tensor([[0.2, 0.3, 0.5], [0.5, 0.5, 0.0]])
    values = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    key_mask = torch.tensor([[True, True, True], [True, True, False]])
    for n in (0, 2, 3, 5):
        out = shell_bounds(alpha, values, n, key_mask=key_mask)
        assert out.precision.dtype == torch.float64
        assert out.precision.isnan().tolist() == [n not in (1, 2), n != 1]
    assert not alpha.isnan().any() and alpha.dtype == torch.float32  # not modified


def test_bad_input(monkeypatch):
    # The errors users get: without the suite's run-time jaxtyping check (see test_bad_input.py).
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    alpha, values = torch.rand(4), torch.rand(4, 2)
    with pytest.raises(ValueError, match=r"k \(the number .* ≥ 0"):
        shell_bounds(alpha, values, 2, k=-1)
    with pytest.raises(TypeError, match="k must be an int"):
        shell_bounds(alpha, values, 2, k=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="n must be an int"):
        shell_bounds(alpha, values, True)
    with pytest.raises(ValueError, match="same number of keys"):
        shell_bounds(alpha, torch.rand(3, 2), 2)
    with pytest.raises(TypeError, match="key_mask must be a bool"):
        shell_bounds(alpha, values, 2, key_mask=torch.ones(4))
    with pytest.raises(ValueError, match="exactly n=2"):
        shell_bounds(alpha, values, 2, selected=torch.tensor([True, False, False, False]))
    with pytest.raises(ValueError, match="key_mask marks invalid"):
        shell_bounds(alpha, values, 1, key_mask=torch.tensor([False, True, True, True]),
                     selected=torch.tensor([True, False, False, False]))


def test_exported():
    assert F.shell_bounds is shell_bounds
