"""The vectorised functional layer against the slow NumPy per-query reference (tests/reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cases import make_case
from jaxtyping import TypeCheckError
from reference import ref_separability, ref_sink, ref_top_n, ref_vote

import tl_geometry.functional as F

TOL = 1e-5
METRICS = ("precision", "recall", "f_score", "margin", "inversions")

# (seed, options) covering ties, duplicated vectors, a compressed sink, GQA/MQA, half precision.
CASES = [
    (0, {}),
    (1, {"ties": True}),
    (2, {"duplicates": True}),
    (3, {"ties": True, "duplicates": True}),
    (4, {"sink": True}),
    (5, {"sink": True, "ties": True, "n_kv": 1}),
    (6, {"n_kv": 4}),
    (7, {"dtype": torch.float16, "duplicates": True}),
    (8, {"dtype": torch.bfloat16, "ties": True}),
    (9, {"n_heads": 6, "n_kv": 2, "n_pos": 17, "d": 3}),
]


def _rows(case):
    """Every (b, h, t) with its alpha row, the KV head's values and the valid-key mask."""
    pattern, v = case.pattern.double(), case.v.double()
    batch, n_heads, n_pos, _ = pattern.shape
    group = n_heads // v.shape[2]
    for b in range(batch):
        for h in range(n_heads):
            for t in range(n_pos):
                valid = np.arange(n_pos) <= t
                yield b, h, t, pattern[b, h, t].numpy(), v[b, :, h // group].numpy(), valid


def _assert_close(got: float, want: float, what: str) -> None:
    if np.isnan(want):
        assert np.isnan(got), f"{what}: expected NaN, got {got}"
    else:
        assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{what}: {got} != {want}"


@pytest.mark.parametrize("seed,options", CASES)
@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
def test_separability_matches_reference_every_query(seed, options, distance):
    case = make_case(seed, **options)
    pattern, v = case.pattern, case.v
    _, n_heads, n_pos, _ = pattern.shape
    n_kv = v.shape[2]
    group = n_heads // n_kv
    # Values [b, head, 1 (query), key, d] by index, broadcast over queries: the vectorised call.
    values = v.permute(0, 2, 1, 3)[:, F.kv_head_index(n_heads, n_kv)][:, :, None]
    key_mask = F.causal_key_mask(n_pos)
    for n in (0, 1, 2, 3, 5, n_pos - 1, n_pos):
        got = F.separability(pattern, values, n, key_mask=key_mask, distance=distance)
        for b, h, t, alpha, vals, valid in _rows(case):
            sel = ref_top_n(alpha, valid, n)
            want = ref_separability(alpha, vals, sel, valid, distance)
            for m in METRICS:
                _assert_close(float(getattr(got, m)[b, h, t]), want[m], f"{m} b{b} h{h} t{t} N={n}")
    assert group >= 1


@pytest.mark.parametrize("seed,options", CASES[:6])
def test_separability_of_given_selection_matches_reference(seed, options):
    case = make_case(seed, **options)
    g = torch.Generator().manual_seed(seed)
    pattern, v = case.pattern, case.v
    n_heads, n_kv, n_pos = pattern.shape[1], v.shape[2], pattern.shape[-1]
    values = v.permute(0, 2, 1, 3)[:, F.kv_head_index(n_heads, n_kv)][:, :, None]
    key_mask = F.causal_key_mask(n_pos).expand_as(pattern)
    n = 3
    ranks = F.random_ranks(key_mask, 1, g)[..., 0, :]
    selected = (ranks < n) & key_mask
    got = F.separability(pattern, values, n, key_mask=key_mask, selected=selected)
    for b, h, t, alpha, vals, valid in _rows(case):
        want = ref_separability(alpha, vals, selected[b, h, t].numpy(), valid)
        for m in METRICS:
            _assert_close(float(getattr(got, m)[b, h, t]), want[m], f"{m} b{b} h{h} t{t}")


@pytest.mark.parametrize("seed,options", CASES)
def test_top_n_mask_ties_go_to_lower_index(seed, options):
    case = make_case(seed, **options)
    n_pos = case.pattern.shape[-1]
    key_mask = F.causal_key_mask(n_pos)
    for n in (1, 2, 4):
        got = F.top_n_mask(case.pattern.double(), n, key_mask)
        for b, h, t, alpha, _, valid in _rows(case):
            want = ref_top_n(alpha, valid, n)
            if want.any():  # n in range
                assert np.array_equal(got[b, h, t].numpy(), want), (b, h, t, n)


@pytest.mark.parametrize("seed,options", CASES)
def test_sink_diagnostics_match_reference(seed, options):
    case = make_case(seed, **options)
    pattern, v = case.pattern, case.v
    n_heads, n_kv, n_pos = pattern.shape[1], v.shape[2], pattern.shape[-1]
    values = v.permute(0, 2, 1, 3)[:, F.kv_head_index(n_heads, n_kv)][:, :, None]
    got = F.sink_diagnostics(pattern, values, F.causal_key_mask(n_pos), torch.tensor(0))
    for b, h, t, alpha, vals, valid in _rows(case):
        want = ref_sink(alpha, vals, valid, 0)
        for field in want:
            _assert_close(float(getattr(got, field)[b, h, t]), want[field], f"{field} b{b} h{h} t{t}")


@pytest.mark.parametrize("seed,options", CASES)
def test_source_votes_match_reference(seed, options):
    case = make_case(seed, **options)
    pattern, v = case.pattern, case.v
    n_heads, n_kv, n_pos = pattern.shape[1], v.shape[2], pattern.shape[-1]
    values = v.permute(0, 2, 1, 3)[:, F.kv_head_index(n_heads, n_kv)][:, :, None]
    got = F.source_votes(pattern, values, F.causal_key_mask(n_pos), torch.arange(n_pos), torch.tensor(0))
    for b, h, t, alpha, vals, valid in _rows(case):
        if t >= 1:
            assert F.VOTES[int(got[b, h, t])] == ref_vote(alpha, vals, valid, t, 0), (b, h, t)


def test_value_dots_matches_dense_computation_without_expanding():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(2, 3, 1, 1, 7, 4, generator=g, dtype=torch.float64)  # shared by q and sel
    weights = torch.randn(2, 3, 5, 6, 7, generator=g, dtype=torch.float64)
    got = F.value_dots(weights, values)
    s = (weights[..., None] * values).sum(-2)  # the dense [.., key, d] product, for reference only
    torch.testing.assert_close(got.aggregate_sq_norm, (s * s).sum(-1))
    torch.testing.assert_close(got.dots, (values * s[..., None, :]).sum(-1))


def test_kv_head_index_gqa_and_mqa():
    assert F.kv_head_index(9, 3).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert F.kv_head_index(4, 1).tolist() == [0, 0, 0, 0]
    assert F.kv_head_index(4, 4).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="multiple"):
        F.kv_head_index(9, 2)


def test_random_ranks_are_seeded_nested_and_valid_only():
    mask = F.causal_key_mask(6).expand(3, 6, 6)
    a = F.random_ranks(mask, 4, torch.Generator().manual_seed(1))
    b = F.random_ranks(mask, 4, torch.Generator().manual_seed(1))
    c = F.random_ranks(mask, 4, torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    selected = a[..., None, :] < torch.arange(1, 7)[:, None]  # [.., sample, n, key]
    assert (selected[..., :-1, :] <= selected[..., 1:, :]).all()  # nested prefixes over N
    # The valid keys take ranks 0 .. n_valid - 1, so a subset of size N < n_valid is valid only.
    valid_ranks = torch.where(mask[..., None, :], a, -1)
    assert (valid_ranks.amax(-1) == mask.sum(-1)[..., None] - 1).all()
    assert (torch.where(mask[..., None, :], a.max() + 1, a).amin(-1) >= mask.sum(-1)[..., None]).all()


def test_random_subsets_are_uniform():
    """Over many draws, each 2-subset of 4 keys appears with frequency 1/6."""
    mask = torch.ones(1, 4, dtype=torch.bool)
    ranks = F.random_ranks(mask, 6000, torch.Generator().manual_seed(0))[0]
    sets = (ranks < 2).long() @ torch.tensor([1, 2, 4, 8])
    counts = torch.bincount(sets, minlength=16)[[3, 5, 6, 9, 10, 12]].double()
    assert counts.sum() == 6000
    assert ((counts - 1000).abs() < 5 * (1000 * 5 / 6) ** 0.5).all(), counts


def test_separability_broadcasts_values_over_queries_without_copy():
    case = make_case(11, n_heads=2, n_kv=2)
    values = case.v.permute(0, 2, 1, 3)  # [b, h, key, d]
    key_mask = F.causal_key_mask(case.pattern.shape[-1])
    shared = F.separability(case.pattern, values[:, :, None], 2, key_mask=key_mask)
    dense = F.separability(
        case.pattern, values[:, :, None].expand(-1, -1, case.pattern.shape[2], -1, -1), 2,
        key_mask=key_mask,
    )
    for m in METRICS:
        torch.testing.assert_close(getattr(shared, m), getattr(dense, m), equal_nan=True)


def test_separability_nan_outside_range_and_validates_arguments():
    alpha = torch.tensor([0.5, 0.3, 0.2])
    values = torch.randn(3, 2)
    assert torch.isnan(F.separability(alpha, values, 3).f_score)
    assert torch.isnan(F.separability(alpha, values, 0).precision)
    # Under pytest the run-time type checker may answer first; both name the argument.
    with pytest.raises((TypeError, TypeCheckError)):
        F.separability(alpha, values, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exactly n=2"):
        F.separability(alpha, values, 2, selected=torch.tensor([True, False, False]))
    with pytest.raises(ValueError, match="invalid"):
        F.separability(alpha, values, 1, key_mask=torch.tensor([True, True, False]),
                       selected=torch.tensor([False, False, True]))
    with pytest.raises((ValueError, TypeCheckError), match="distance"):
        F.separability(alpha, values, 1, distance="manhattan")  # type: ignore[arg-type]


def test_functional_never_mutates_inputs():
    case = make_case(3, ties=True)
    before = (case.pattern.clone(), case.v.clone())
    values = case.v.permute(0, 2, 1, 3)[:, F.kv_head_index(4, 2)][:, :, None]
    F.separability(case.pattern, values, 2, key_mask=F.causal_key_mask(12), distance="cosine")
    F.sink_diagnostics(case.pattern, values, F.causal_key_mask(12), torch.tensor(0))
    assert torch.equal(before[0], case.pattern) and torch.equal(before[1], case.v)


@pytest.mark.parametrize("level", [0.9, 0.95, 0.99])
def test_t_quantile_inverts_the_t_distribution_on_both_sides_of_df_1000(level):
    """Exact bisection up to df = 1000, the Cornish–Fisher expansion beyond: both invert the
    closed-form distribution function (the normal quantile alone is 0.1–0.2 % low at 1001)."""
    from tl_geometry.functional.uncertainty import _t_two_sided, t_quantile

    for df in (3, 30, 1000, 1001, 4000, 100_000):
        t = t_quantile(level, df)
        assert abs(_t_two_sided(t, df) - level) < 1e-9, (df, t)
    assert abs(t_quantile(level, 1001) - t_quantile(level, 1000)) < 2e-5  # continuous at the switch
    assert t_quantile(0.95, 3) == pytest.approx(3.182446, abs=1e-6)


def test_sink_mean_cosine_weighs_the_other_keys_in_float64():
    """The mean of the other keys' values is formed with weights ``1/|J|`` in the compute dtype:
    with three other keys, float32 weights (1/3 rounded) move the cosine by about 1e-8."""
    values = torch.tensor([[1.0, 0.0], [0.3, 1.0], [0.7, -0.2], [0.1, 0.9]], dtype=torch.float64)
    got = F.sink_diagnostics(torch.full((4,), 0.25), values, torch.ones(4, dtype=torch.bool), 0)
    mean = values[1:].mean(0)
    want = float(values[0] @ mean / (values[0].norm() * mean.norm() + 1e-12))  # COSINE_EPS
    assert abs(float(got.mean_cosine) - want) <= 1e-14
