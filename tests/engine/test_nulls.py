"""The value-shuffle null, the chance-corrected scores and the paired sink effect (SPEC §3)
against the loop reference, on both backends."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from cases import make_case
from reference import METRICS, ref_analyze
from shared_checks import assert_metrics_equal_reference
from streams import engine_shuffles

import tl_geometry
from tl_geometry import HeadAnalysis
from tl_geometry.engine import paired

N_VALUES = (1, 2, 3, 5, 8)
SHUFFLES = 3


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("options", [{}, {"queries": "all"}, {"queries": "all", "rank_by": "contribution"}])
@pytest.mark.parametrize("case_options", [
    {"ties": True, "duplicates": True, "sink": True},
    {"padding": "left", "n_kv": 1},
    {"padding": "right", "n_heads": 6, "n_kv": 3},
])
def test_shuffled_cc_and_paired_equal_the_reference(backend, options, case_options):
    case = make_case(71, batch=3, **case_options)
    result = tl_geometry.analyze_heads(
        case.cache(), n_values=N_VALUES, attention_mask=case.attention_mask, random_samples=0,
        shuffle_samples=SHUFFLES, backend=backend, **options)
    mask = None if case.attention_mask is None else case.attention_mask.numpy()
    want = ref_analyze(case.pattern.double().numpy(), case.v.double().numpy(), N_VALUES,
                       queries=options.get("queries", "last"), attention_mask=mask,
                       rank_by=options.get("rank_by", "attention"),
                       shuffles=engine_shuffles(0, 0, mask))
    assert_metrics_equal_reference(result, want, ("top", "shuffled", "sink_removed", "sink_in", "sink_out"), METRICS)
    for h, per_n in enumerate(want["paired_ratios"]):
        for ni, ratios in enumerate(per_n):
            got = [result.paired_sink(f)[0, h, ni].item() for f in ("ratio", "halved", "count")]
            assert got[2] == len(ratios)
            if not ratios:
                assert math.isnan(got[0]) and math.isnan(got[1])
                continue
            assert got[1] == sum(r <= 0.5 for r in ratios) / len(ratios)
            lower_median = sorted(ratios)[(len(ratios) - 1) // 2]
            if lower_median in (0.0, math.inf):
                assert got[0] == lower_median
            else:  # the histogram's bin centre: within half a bin of 1/32 octave
                assert abs(math.log2(got[0]) - math.log2(lower_median)) <= 1 / 64 + 1e-12


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_random_and_shuffle_streams_are_independent_and_seeded():
    case = make_case(72, batch=2)
    run = lambda **kw: tl_geometry.analyze_heads(case.cache(), n_values=(2, 3), **kw)  # noqa: E731
    base = run(random_samples=4, shuffle_samples=4)
    _same(base.scores, run(random_samples=4, shuffle_samples=4).scores)
    # Turning one baseline off leaves the other's numbers bit for bit.
    _same(run(random_samples=0, shuffle_samples=4).shuffled_f_score, base.shuffled_f_score)
    _same(run(random_samples=4, shuffle_samples=0).random_f_score, base.random_f_score)
    assert torch.isnan(run(shuffle_samples=0).shuffled_f_score).all()
    assert not torch.equal(run(seed=1, random_samples=4, shuffle_samples=4).shuffled_f_score,
                           base.shuffled_f_score)


@pytest.mark.parametrize("shuffle", ["values", "norms", "directions", "unselected"])
def test_shuffled_is_batch_and_chunk_independent(monkeypatch, shuffle):
    case = make_case(73, batch=4, padding="left")
    kwargs = dict(n_values=(1, 2, 4), queries="all", attention_mask=case.attention_mask, shuffle=shuffle)
    whole = tl_geometry.analyze_heads(case.cache(), **kwargs)
    from tl_geometry.engine import layer

    monkeypatch.setattr(layer, "MIN_CHUNK_BYTES", 1)
    monkeypatch.setattr(layer, "CHUNK_FRACTION", 1e-9)  # one sequence, one group per chunk
    chunked = tl_geometry.analyze_heads(case.cache(), **kwargs)
    for metric, group in (("f_score", "shuffled"), ("f_score_cc", "shuffled"), ("f_score_cc", "top")):
        torch.testing.assert_close(chunked.metric(metric, group), whole.metric(metric, group), equal_nan=True,
                                   rtol=1e-12, atol=0)
    torch.testing.assert_close(chunked.paired_sink("ratio"), whole.paired_sink("ratio"), equal_nan=True,
                               rtol=1e-12, atol=0)
    _same(chunked.paired, whole.paired)


def test_chance_correction_is_zero_on_the_floor_and_one_when_separable():
    # Two far-apart clusters: the top-2 set is perfectly separable (P = R = P* = F* = 1); at
    # N = 4 of 5 keys every unselected key is inside the ball: P is its floor, P* = F* = 0.
    alpha = torch.tensor([[0.05, 0.4, 0.35, 0.1, 0.1]])
    values = torch.tensor([[0.0, 0.0], [10.0, 0.0], [10.0, 0.1], [0.0, 1.0], [0.1, 1.0]])
    two = tl_geometry.functional.separability(alpha, values, 2)
    assert two.precision_cc.item() == two.f_score_cc.item() == 1.0
    four = tl_geometry.functional.separability(alpha, values, 4)
    if four.precision.item() == 4 / 5:
        assert four.precision_cc.item() == 0.0 and four.f_score_cc.item() == 0.0


def test_paired_figures_from_a_histogram():
    ratios = torch.tensor([0.25, 0.5, 0.5 + 1e-9, 1.0, 3.0, math.inf, 0.0], dtype=torch.float64)
    with_sink, removed = ratios.double(), torch.ones(7, dtype=torch.float64)
    removed[5], with_sink[5] = 0.0, 0.7
    hist, halved = paired.paired_counts(with_sink[None, None, :, None], removed[None, None, :, None],
                                        torch.ones(1, 1, 7, 1, dtype=torch.bool))
    ratio, fraction, count = paired.paired_figures(hist, halved)[:, 0, 0].tolist()
    assert count == 7 and fraction == 3 / 7  # 0, 0.25 and 0.5 (not 0.5 + 1e-9)
    assert abs(math.log2(ratio) - math.log2(0.5 + 1e-9)) <= 1 / 64  # the lower median


@pytest.mark.parametrize("bad", [-1, 2.5, True, "16"])
def test_bad_shuffle_samples_are_refused_before_any_work(bad):
    case = make_case(74)
    cache = case.cache()
    before = {k: v.clone() for k, v in cache.items()}
    with pytest.raises(ValueError, match="shuffle_samples must be a non-negative int"):
        tl_geometry.analyze_heads(cache, shuffle_samples=bad)
    assert all(torch.equal(cache[k], before[k]) for k in cache)


# --- the decomposition nulls: norms, directions, unselected (SPEC §3) -------------------------

KINDS = ("norms", "directions", "unselected")


def _zero_values(case):
    """``case`` with a zero value vector at one non-sink key of every sequence and KV head:
    the zero rule of the norms and directions nulls (a zero vector has no direction)."""
    v = case.v.clone()
    v[:, 3] = 0.0
    return type(case)(case.pattern, v, case.attention_mask)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("shuffle", KINDS)
@pytest.mark.parametrize("options, case_options", [
    ({}, {"ties": True, "duplicates": True, "sink": True}),
    ({"queries": "all"}, {"padding": "left", "n_kv": 1, "zero": True}),
    ({"queries": "all", "distance": "cosine"}, {"padding": "right", "n_heads": 6, "n_kv": 3}),
    ({"queries": "all", "rank_by": "contribution"}, {"duplicates": True, "zero": True}),
])
def test_each_null_equals_the_reference(backend, shuffle, options, case_options):
    case_options = dict(case_options)
    zero = case_options.pop("zero", False)
    case = make_case(75, batch=3, **case_options)
    if zero:
        case = _zero_values(case)
    result = tl_geometry.analyze_heads(
        case.cache(), n_values=N_VALUES, attention_mask=case.attention_mask, random_samples=0,
        shuffle_samples=SHUFFLES, shuffle=shuffle, backend=backend, **options)
    assert result.metadata["shuffle"] == shuffle == result.shuffle
    mask = None if case.attention_mask is None else case.attention_mask.numpy()
    want = ref_analyze(case.pattern.double().numpy(), case.v.double().numpy(), N_VALUES,
                       queries=options.get("queries", "last"), attention_mask=mask,
                       distance=options.get("distance", "euclidean"),
                       rank_by=options.get("rank_by", "attention"),
                       shuffles=engine_shuffles(0, 0, mask), shuffle=shuffle)
    assert_metrics_equal_reference(result, want, ("top", "shuffled"), METRICS)


def _one_query_cache(values: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """One sequence, one head per KV head, random causal attention; ``values [pos, head, d]``."""
    n_pos, n_heads = values.shape[:2]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, n_heads, n_pos, n_pos, generator=g, dtype=torch.float64) * 2
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    pattern = torch.softmax(logits.masked_fill(~causal, -torch.inf), dim=-1)
    return {"blocks.0.attn.hook_pattern": pattern, "blocks.0.attn.hook_v": values[None]}


def _null_equals_top(cache, shuffle: str, backend: str, n_values, **kwargs) -> HeadAnalysis:
    """The ``shuffle`` null's metrics equal the top-N set's (up to the round-off of the mean
    over the permutations: five equal numbers need not average to themselves bit for bit)."""
    result = tl_geometry.analyze_heads(cache, n_values=n_values, random_samples=0, shuffle_samples=5,
                                       shuffle=shuffle, backend=backend, **kwargs)
    for m in METRICS:
        top, null = result.metric(m, "top"), result.metric(m, "shuffled")
        assert torch.isfinite(top).any()
        torch.testing.assert_close(null, top, rtol=1e-12, atol=1e-12, equal_nan=True, msg=m)
    return result


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_norms_null_is_top_n_when_every_non_sink_norm_is_equal(backend):
    # Signed permutations of (1, 2, 2, 4): every norm is 5 exactly, the directions differ.
    rng = np.random.default_rng(0)
    n_pos, n_heads = 14, 3
    base = np.array([1.0, 2.0, 2.0, 4.0])
    v = np.stack([[rng.permutation(base) * rng.choice([-1.0, 1.0], 4) for _ in range(n_heads)]
                  for _ in range(n_pos)])
    v[0] *= 0.1  # the sink keeps its own (short) value
    cache = _one_query_cache(torch.from_numpy(v), 1)
    for queries in ("last", "all"):
        _null_equals_top(cache, "norms", backend, (1, 2, 3, 5, 8), queries=queries)
    # The values null, which moves the directions too, differs.
    values = tl_geometry.analyze_heads(cache, n_values=(2, 3, 5, 8), random_samples=0, shuffle_samples=5,
                                       backend=backend, queries="all")
    assert not torch.equal(values.shuffled_f_score, values.f_score)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_directions_null_is_top_n_when_every_non_sink_value_is_parallel(backend):
    rng = np.random.default_rng(1)
    n_pos, n_heads = 14, 3
    u = rng.normal(size=(n_heads, 6))
    v = rng.uniform(0.2, 3.0, (n_pos, n_heads, 1)) * u[None]
    v[0] = rng.normal(size=(n_heads, 6))  # the sink's value points anywhere
    cache = _one_query_cache(torch.from_numpy(v), 2)
    for distance in ("euclidean", "cosine"):
        _null_equals_top(cache, "directions", backend, (1, 2, 3, 5, 8), queries="all",
                         distance=distance)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_unselected_null_is_top_n_when_the_unselected_values_are_equal(backend):
    rng = np.random.default_rng(2)
    n_pos, n_heads = 12, 4
    cache = _one_query_cache(torch.zeros(n_pos, n_heads, 5, dtype=torch.float64), 3)
    alpha = cache["blocks.0.attn.hook_pattern"][0, :, -1]  # [head, key]
    v = np.repeat(rng.normal(size=(1, n_heads, 5)), n_pos, axis=0)  # one value per head …
    for h in range(n_heads):  # … except at the top-2 keys of the last query and at the sink
        for k in [*torch.sort(alpha[h], descending=True, stable=True).indices[:2].tolist(), 0]:
            v[k, h] = rng.normal(size=5)
    cache["blocks.0.attn.hook_v"] = torch.from_numpy(v)[None]
    # U_N holds only equal values at every N ≥ 2 (the top-2 keys and the sink are never in it).
    result = _null_equals_top(cache, "unselected", backend, (2, 3, 5))
    assert result.f_score.lt(1).any()  # not a trivially separable selection
    # The values null also moves the selected keys' values: it does not equal the top-N set.
    values = tl_geometry.analyze_heads(cache, n_values=(2, 3, 5), random_samples=0, shuffle_samples=5,
                                       backend=backend)
    assert not torch.allclose(values.shuffled_f_score, values.f_score)


@pytest.mark.parametrize("bad", ["value", "keys", "", None, 3])
def test_unknown_shuffle_kind_is_refused_before_any_work(bad):
    case = make_case(76)
    cache = case.cache()
    before = {k: v.clone() for k, v in cache.items()}
    with pytest.raises(ValueError, match=r"shuffle must be 'values' .*'norms' .*'directions' .*'unselected'"):
        tl_geometry.analyze_heads(cache, shuffle=bad)
    assert all(torch.equal(cache[k], before[k]) for k in cache)


def test_the_default_null_is_the_values_null_and_leaves_the_other_groups_alone():
    case = make_case(77, batch=2, padding="left")
    kwargs = dict(n_values=(1, 2, 4), queries="all", attention_mask=case.attention_mask, random_samples=3,
                  shuffle_samples=3)
    default = tl_geometry.analyze_heads(case.cache(), **kwargs)
    assert default.metadata["shuffle"] == "values" == default.shuffle
    # the settings line names no other null (the legend's "shuffled = the top-N keys ..." may share a line)
    assert not any(f"shuffled = the {kind} null" in default.summary() for kind in (*KINDS, "values"))
    _same(tl_geometry.analyze_heads(case.cache(), shuffle="values", **kwargs).scores, default.scores)
    others = [g for g in tl_geometry.result.GROUPS if g != "shuffled"]
    for kind in KINDS:
        r = tl_geometry.analyze_heads(case.cache(), shuffle=kind, **kwargs)
        assert r.metadata["shuffle"] == kind and f"shuffled = the {kind} null" in r.summary()
        for group in others:
            _same(r.metric("f_score", group), default.metric("f_score", group))
        assert not torch.equal(r.shuffled_f_score.nan_to_num(), default.shuffled_f_score.nan_to_num())


def test_the_null_kind_survives_a_file_and_old_files_read_as_values(tmp_path):
    case = make_case(78)
    r = tl_geometry.analyze_heads(case.cache(), n_values=(1, 2), shuffle="directions", shuffle_samples=2)
    loaded = HeadAnalysis.load(r.save(tmp_path / "directions.pt"))
    assert loaded.metadata["shuffle"] == "directions" == loaded.shuffle
    old = {k: v for k, v in r.metadata.items() if k != "shuffle"}  # a file written before the option
    loaded = HeadAnalysis.load(HeadAnalysis(**{**vars(r), "metadata": old}).save(tmp_path / "old.pt"))
    assert "shuffle" not in loaded.metadata and loaded.shuffle == "values"  # metadata round-trips as is


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("path", ["gram", "vectors"])
@pytest.mark.parametrize("options", [{}, {"queries": "all"}])
def test_both_inner_product_paths_equal_the_reference(backend, path, options, monkeypatch):
    """Every metric of every group against the loop reference on each path the cost rule can
    choose (``layer._uses_gram``): the inner products from Gram matrices, and from the vectors
    with the margin's distances computed directly (ties, duplicated values, a compressed sink)."""
    from tl_geometry.engine import layer

    monkeypatch.setattr(layer, "_uses_gram", lambda *args: path == "gram")
    case = make_case(73, batch=3, ties=True, duplicates=True, sink=True)
    result = tl_geometry.analyze_heads(case.cache(), n_values=N_VALUES, random_samples=0,
                                       shuffle_samples=SHUFFLES, backend=backend, **options)
    want = ref_analyze(case.pattern.double().numpy(), case.v.double().numpy(), N_VALUES,
                       queries=options.get("queries", "last"), shuffles=engine_shuffles(0, 0, None))
    assert_metrics_equal_reference(result, want, ("top", "shuffled", "sink_removed", "sink_in", "sink_out"), METRICS,
                                   what=f"{path} ")
