"""Certified top-N truncation (SPEC §10): the tail mass and relative output error of every
selection the engine scores, their exact 90th percentiles, the certified budgets and the result
file that holds them — checked against the loop reference (tests/reference.py) on synthetic GQA
caches, on both backends."""

from __future__ import annotations

import math
import warnings

import jaxtyping
import numpy as np
import pytest
import torch
from cases import make_case
from reference import METRICS, TRUNCATION, ref_analyze, ref_top_n, ref_truncation
from result_fakes import fake
from shared_checks import assert_metrics_equal_reference, drop_format_6
from test_nulls import engine_shuffles

import tl_geometry
from tl_geometry.engine import Accumulator, analyze_layer, check_options
from tl_geometry.engine.rng import GOLDEN, SAMPLE_STRIDE, mix, sequence_keys
from tl_geometry.functional import Truncation, truncation
from tl_geometry.functional.separability import TRUNCATION_NAMES
from tl_geometry.functional.stats import nearest_rank_percentile
from tl_geometry.result import NO_BUDGET, HeadAnalysis, truncation_budgets
from tl_geometry.result import io as _result_io

N_VALUES = (1, 2, 3, 5, 8)
SAMPLES = 3
CASES = [
    {"ties": True, "duplicates": True, "sink": True},
    {"padding": "left", "n_kv": 1},
    {"padding": "right", "n_heads": 6, "n_kv": 3},
]


def engine_randoms(seed: int, layer: int, mask: np.ndarray | None):
    """The engine's random orderings of the valid keys (partial Fisher–Yates, engine/rng.py)."""

    def draw(b: int, h: int, t: int, keys: list[int]) -> list[list[int]]:
        real_index = t if mask is None else int(mask[b, : t + 1].sum()) - 1
        row_key = mix(mix(int(sequence_keys(seed, layer, [b])[0]) + real_index) + h)
        orders = []
        for sample in range(SAMPLES):
            perm, m = list(keys), len(keys)
            for r in range(m - 1):  # the first N keys are fixed after N steps: prefixes nest
                u = mix(row_key + GOLDEN * (sample * SAMPLE_STRIDE + r + 1))
                j = r + (((u >> 32) * (m - r)) >> 32)
                perm[r], perm[j] = perm[j], perm[r]
            orders.append(perm)
        return orders

    return draw


def _mask(case) -> np.ndarray | None:
    return None if case.attention_mask is None else case.attention_mask.numpy()


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("queries", ["last", "all"])
@pytest.mark.parametrize("case_options", CASES)
def test_every_group_equals_the_reference(backend, queries, case_options):
    """tail_mass and truncation_error of the top-N and sink-removed selections and of the sink-in /
    sink-out instances, to 1e-6; the baselines carry none (SPEC §10: NaN); the random group's
    P/R/F to 1e-9."""
    case = make_case(75, batch=3, **case_options)
    result = tl_geometry.analyze_heads(
        case.cache(), n_values=N_VALUES, attention_mask=case.attention_mask, queries=queries,
        random_samples=SAMPLES, shuffle_samples=SAMPLES, backend=backend)
    mask = _mask(case)
    want = ref_analyze(case.pattern.double().numpy(), case.v.double().numpy(), N_VALUES, queries=queries,
                       attention_mask=mask, shuffles=engine_shuffles(0, 0, mask),
                       randoms=engine_randoms(0, 0, mask))
    scored = ("top", "sink_removed", "sink_in", "sink_out")
    assert_metrics_equal_reference(result, want, scored, TRUNCATION, tol=1e-6)
    for group in scored:
        assert not np.isnan(want[f"{group}_tail_mass"]).all(), group  # the comparison compared
    for group in ("random", "shuffled"):
        for m in TRUNCATION:
            assert result.metric(m, group).isnan().all(), (group, m)
    assert_metrics_equal_reference(result, want, ("random",), METRICS)  # the random group has no other reference


def _instances(case, n_values, queries):
    """Per head and N, every (sequence, chosen query)'s reference τ_N and error of the top-N set."""
    pattern, v = case.pattern.double().numpy(), case.v.double().numpy()
    batch, n_heads, n_pos, _ = pattern.shape
    mask = np.ones((batch, n_pos), dtype=int) if case.attention_mask is None else case.attention_mask.numpy()
    group = n_heads // v.shape[2]
    out = {(h, ni, m): [] for h in range(n_heads) for ni in range(len(n_values)) for m in TRUNCATION}
    for b in range(batch):
        real = [t for t in range(n_pos) if mask[b, t]]
        for t in (real if queries == "all" else real[-1:]):
            valid = np.array([bool(mask[b, i]) and i <= t for i in range(n_pos)])
            for h in range(n_heads):
                alpha = pattern[b, h, t]
                for ni, n in enumerate(n_values):
                    sel = ref_top_n(alpha, valid, n)
                    res = ref_truncation(alpha, v[b, :, h // group], sel, valid)
                    for m in TRUNCATION:
                        if not math.isnan(res[m]):
                            out[(h, ni, m)].append(res[m])
    return out


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("queries", ["last", "all"])
@pytest.mark.parametrize("case_options", CASES[:2])
def test_percentiles_are_the_exact_nearest_rank_90th(backend, queries, case_options):
    case = make_case(76, batch=4, **case_options)
    result = tl_geometry.analyze_heads(case.cache(), n_values=N_VALUES, attention_mask=case.attention_mask,
                                       queries=queries, random_samples=0, shuffle_samples=0, backend=backend)
    instances = _instances(case, N_VALUES, queries)
    for (h, ni, m), values in instances.items():
        got = result.truncation_percentile(m)[0, h, ni].item()
        if not values:
            assert math.isnan(got)
            continue
        want = float(np.quantile(values, 0.9, method="inverted_cdf"))
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6), (h, ni, m)
        assert sum(x <= got + 1e-9 for x in values) >= 0.9 * len(values)  # the certificate's meaning
    assert torch.equal(result.p90_tail_mass, result.truncation_percentile("tail_mass"))


def test_percentiles_do_not_depend_on_batching_and_merge_exactly():
    """Batches added one by one, and two accumulators merged, give the same bits as one batch."""
    case = make_case(77, batch=5, padding="left")
    opts = check_options(n_values=N_VALUES, queries="all", random_samples=2, shuffle_samples=0)
    mask = case.attention_mask.bool()
    sink = mask.long().argmax(-1)

    def run(parts: list[tuple[int, int]]) -> Accumulator:
        acc = Accumulator.zeros(1, case.pattern.shape[1], len(N_VALUES), n_sequences=5)
        for b0, b1 in parts:
            acc.add(0, analyze_layer(case.pattern[b0:b1], case.v[b0:b1], mask[b0:b1], sink[b0:b1], opts,
                                     layer=0, sequence_offset=b0, mask_given=True), b0)
        return acc

    whole = run([(0, 5)]).finish([0], opts, 12, {})
    batched = run([(0, 2), (2, 3), (3, 5)]).finish([0], opts, 12, {})
    merged = run([(0, 2)]).merge(run([(2, 5)])).finish([0], opts, 12, {})
    assert not whole.truncation_p90.isnan().all()
    for other in (batched, merged):
        assert torch.equal(other.truncation_p90.isnan(), whole.truncation_p90.isnan())
        torch.testing.assert_close(other.truncation_p90, whole.truncation_p90, rtol=0, atol=0, equal_nan=True)
    direct = tl_geometry.analyze_heads(case.cache(), n_values=N_VALUES, queries="all", random_samples=2,
                                       shuffle_samples=0, attention_mask=case.attention_mask)
    torch.testing.assert_close(direct.truncation_p90, whole.truncation_p90, rtol=0, atol=0, equal_nan=True)


def test_layers_added_at_once_equal_layers_added_one_by_one():
    """``add_layers`` stacks each statistic over the layers: every sum and count is the one the
    layers added one by one give, per-window rows and bounds included, over two batches."""
    case = make_case(80, batch=4, padding="left")
    opts = check_options(n_values=N_VALUES, random_samples=3, per_window=True, bounds=True)
    mask = case.attention_mask.bool()
    sink = mask.long().argmax(-1)
    stats = [[analyze_layer(case.pattern[b0:b1] if layer == 0 else case.pattern[b0:b1].flip(1), case.v[b0:b1],
                            mask[b0:b1], sink[b0:b1], opts, layer=layer, sequence_offset=b0, mask_given=True)
              for layer in range(3)] for b0, b1 in ((0, 3), (3, 4))]
    one_by_one, at_once = (Accumulator.zeros(3, 4, len(N_VALUES), per_window=True) for _ in range(2))
    for (b0, _), batch in zip(((0, 3), (3, 4)), stats):
        for li, layer in enumerate(batch):
            one_by_one.add(li, layer, b0)
        at_once.add_layers(range(3), batch, b0)
    for mine, theirs in zip(at_once.tensors(), one_by_one.tensors()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_layer_stats_hold_no_view_of_the_per_query_rows(backend):
    """``analyze_heads`` holds every layer's statistics until it adds them at once: none may keep
    the layer's per-query rows (``[batch, head, query, group, n, metric]``) alive through a view."""
    case = make_case(81, batch=3, n_pos=16, window=5)
    opts = check_options(n_values=(1, 2, 3), queries="all", per_window=True, bounds=True, backend=backend)
    for window in (None, 5):
        stats = analyze_layer(case.pattern, case.v, torch.ones(3, 16, dtype=torch.bool),
                              torch.zeros(3, dtype=torch.long), opts, layer=0, mask_given=False, window=window)
        for name, x in stats._asdict().items():
            if isinstance(x, torch.Tensor):
                assert x.untyped_storage().nbytes() == x.numel() * x.element_size(), (name, window)


def test_a_batch_with_another_query_count_is_refused():
    case = make_case(78, batch=2)
    mask, sink = torch.ones(2, 12, dtype=torch.bool), torch.zeros(2, dtype=torch.long)
    acc = Accumulator.zeros(1, 4, 2, n_sequences=2, n_queries=1)
    stats = analyze_layer(case.pattern, case.v, mask, sink, check_options(n_values=(1, 2), queries="all"),
                          layer=0, mask_given=False)
    with pytest.raises(ValueError, match="12 chosen queries per sequence, the earlier ones 1"):
        acc.add(0, stats)


# --- the functional form ------------------------------------------------------------------------


def test_functional_truncation_equals_the_reference_and_the_engine():
    case = make_case(79, batch=3, n_heads=4, n_kv=2, padding="right")
    result = tl_geometry.analyze_heads(case.cache(), n_values=(2, 5), attention_mask=case.attention_mask,
                                       random_samples=0, shuffle_samples=0)
    mask = case.attention_mask.bool()
    last = mask.long().cumsum(-1).argmax(-1)
    key_mask = mask & (torch.arange(12)[None, :] <= last[:, None])
    alpha = case.pattern[torch.arange(3), :, last]  # [batch, head, key]
    values = case.v.double().permute(0, 2, 1, 3).repeat_interleave(2, dim=1)  # [batch, head, key, d]
    for ni, n in enumerate((2, 5)):
        got = truncation(alpha, values, n, key_mask=key_mask[:, None, :])
        assert isinstance(got, Truncation) and Truncation._fields == TRUNCATION_NAMES
        for b in range(3):
            for h in range(4):
                sel = ref_top_n(alpha[b, h].double().numpy(), key_mask[b].numpy(), n)
                want = ref_truncation(alpha[b, h].double().numpy(), values[b, h].numpy(), sel, key_mask[b].numpy())
                for m in TRUNCATION:
                    assert getattr(got, m)[b, h].item() == pytest.approx(want[m], rel=1e-9, abs=1e-12, nan_ok=True)
        for m in TRUNCATION:  # one query per sequence: the engine's mean is the mean over sequences
            torch.testing.assert_close(getattr(got, m).nanmean(0), result.metric(m)[0, :, ni],
                                       rtol=1e-9, atol=1e-12, equal_nan=True)


def test_identity_and_edge_cases():
    torch.manual_seed(0)
    alpha = torch.softmax(torch.randn(6, 10, dtype=torch.float64), -1)
    values = torch.randn(6, 10, 3, dtype=torch.float64)
    for n in range(1, 10):
        sel = tl_geometry.functional.top_n_mask(alpha, n)
        tau = (alpha * ~sel).sum(-1, keepdim=True)
        mu_h = ((alpha * sel)[..., None] * values).sum(-2) / (1 - tau)
        mu_t = ((alpha * ~sel)[..., None] * values).sum(-2) / tau
        o = (alpha[..., None] * values).sum(-2)
        # SPEC §10: o − o_N = τ_N (μ_T − μ_H)
        want = torch.linalg.vector_norm(tau * (mu_t - mu_h), dim=-1) / torch.linalg.vector_norm(o, dim=-1)
        got = truncation(alpha, values, n)
        torch.testing.assert_close(got.truncation_error, want, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got.tail_mass, tau.squeeze(-1), rtol=0, atol=1e-15)
    a = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    v = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, 2.0]], dtype=torch.float64)
    zero = truncation(a, v, 1)  # o = 0: no relative error
    assert zero.tail_mass.item() == 0.5 and math.isnan(zero.truncation_error.item())
    nothing = truncation(torch.tensor([0.0, 0.0, 0.5, 0.5]), v, 2,
                         selected=torch.tensor([True, True, False, False]))  # τ = 1: nothing kept
    assert nothing.tail_mass.item() == 1.0 and math.isnan(nothing.truncation_error.item())
    out = truncation(a, v, 4)  # N = |T_t|: undefined
    assert math.isnan(out.tail_mass.item()) and math.isnan(out.truncation_error.item())
    whole = truncation(torch.tensor([0.7, 0.3, 0.0]), v[:3], 2)  # an empty tail: exact zeros
    assert whole.tail_mass.item() == 0.0 and whole.truncation_error.item() == 0.0


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_engine_edge_cases_zero_output_empty_tail_and_nothing_kept(backend):
    """A zero output gives a NaN error (not a crash, not 0); a tail of exact zeros gives exactly
    τ = 0 and error 0; a sink-removed set that keeps less than 1e-6 gives a NaN error and its τ;
    the random baseline carries no truncation figures."""
    n_pos = 6
    pattern = torch.zeros(1, 3, n_pos, n_pos, dtype=torch.float64)
    for t in range(n_pos):
        pattern[0, :, t, : t + 1] = 1 / (t + 1)
    pattern[0, 0, -1] = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0])  # head 0: two keys only
    pattern[0, 1, -1] = torch.tensor([0.0, 0.0, 0.25, 0.75, 0.0, 0.0])  # head 1: two others
    pattern[0, 2, -1] = torch.tensor([1 - 5e-7, 1e-7, 1e-7, 1e-7, 1e-7, 1e-7])  # head 2: all but 5e-7 on the sink
    v = torch.randn(1, n_pos, 1, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    v[0, 1] = -v[0, 0]  # both heads read these values; head 0's output is exactly 0
    cache = {"blocks.0.attn.hook_pattern": pattern, "blocks.0.attn.hook_v": v}
    result = tl_geometry.analyze_heads(cache, n_values=(1, 2, 3), random_samples=SAMPLES, shuffle_samples=0,
                                       backend=backend)
    assert result.tail_mass[0, 0].tolist() == [0.5, 0.0, 0.0]
    assert result.truncation_error[0, 0].isnan().all()  # o = 0
    assert result.tail_mass[0, 1, 1:].tolist() == [0.0, 0.0]  # the two keys with weight kept
    assert result.truncation_error[0, 1, 1:].tolist() == [0.0, 0.0]
    dropped_tail = result.metric("tail_mass", "sink_removed")[0, 2]
    torch.testing.assert_close(dropped_tail, torch.tensor([1 - 1e-7, 1 - 2e-7, 1 - 3e-7], dtype=torch.float64))
    assert result.metric("truncation_error", "sink_removed")[0, 2].isnan().all()  # kept ≤ 3e-7 < 1e-6
    assert not result.truncation_error[0, 2].isnan().any()  # the top-N set holds the sink
    for m in TRUNCATION:
        assert result.metric(m, "random").isnan().all(), m


def test_the_kept_mass_is_summed_over_the_selection_not_formed_from_the_tail():
    """SPEC §10: a float32 row sums to 1 only within round-off, so ``1 − τ_N`` of a selection
    that keeps little is that round-off. Summed over the selected keys, the figure of a float32
    row is the float64 row's to 1e-5; below 1e-6 kept it is NaN for both."""
    logits = torch.tensor([17.0, 0.0, 0.3, -0.2, 0.1, 0.0, 0.2, -0.1], dtype=torch.float64)
    values = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    tiny = torch.zeros(8, dtype=torch.bool)
    tiny[3] = True  # α_3 ≈ 3e-8
    pair = tiny.clone()
    pair[1:] = True  # every key but the first: about 3e-7 kept
    for selected in (tiny, pair):
        for dtype in (torch.float32, torch.float64):
            out = truncation(torch.softmax(logits, -1).to(dtype), values, int(selected.sum()), selected=selected)
            assert math.isnan(out.truncation_error.item()), dtype
    logits[1:] += 3.0  # every other key about 8e-7: the seven of them keep about 6e-6, above 1e-6
    errors = [truncation(torch.softmax(logits, -1).to(dtype), values, 7, selected=pair).truncation_error.item()
              for dtype in (torch.float32, torch.float64)]
    assert errors[0] == pytest.approx(errors[1], rel=1e-5)
    alpha = torch.softmax(logits, -1)
    want = ref_truncation(alpha.numpy(), values.numpy(), pair.numpy(), np.ones(8, dtype=bool))
    assert errors[1] == pytest.approx(want["truncation_error"], rel=1e-9)


# --- budgets --------------------------------------------------------------------------------------


def _with_p90(values: list[list[list[float]]], n_values=(2, 4, 8)) -> HeadAnalysis:
    r = fake(layers=(3, 5), n_heads=2, n_values=n_values)
    p90 = torch.full((2, 2, 2, len(n_values)), torch.nan, dtype=torch.float64)
    p90[0] = torch.tensor(values, dtype=torch.float64)
    return HeadAnalysis(**{**vars(r), "truncation_p90": p90})


def test_truncation_budgets_are_the_smallest_certified_n(monkeypatch):
    r = _with_p90([[[0.3, 0.04, 0.01], [0.05, 0.02, 0.0]],
                   [[0.5, 0.2, 0.1], [math.nan, math.nan, math.nan]]])
    budgets = truncation_budgets(r)  # ε = 0.05: ≤ counts
    assert budgets.dtype == torch.int64 and budgets.shape == (2, 2)
    assert budgets.tolist() == [[4, 2], [NO_BUDGET, NO_BUDGET]]
    assert truncation_budgets(r, eps=0.2).tolist() == [[4, 2], [4, NO_BUDGET]]
    assert truncation_budgets(r, eps=0.0).tolist() == [[NO_BUDGET, 8], [NO_BUDGET, NO_BUDGET]]
    assert torch.equal(tl_geometry.truncation_budgets(r, 0.01), truncation_budgets(r, eps=0.01))
    unsorted = _with_p90([[[0.04, 0.3, 0.01], [0.02, 0.05, 0.0]], [[0.2, 0.5, 0.1]] * 2], n_values=(4, 2, 8))
    assert truncation_budgets(unsorted).tolist() == [[4, 2], [NO_BUDGET, NO_BUDGET]]
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)  # the errors users get
    for bad in (-0.1, 1.5, math.nan, "0.05", True):
        with pytest.raises(ValueError, match="eps must be a tail mass in"):
            truncation_budgets(r, eps=bad)
    with pytest.raises(ValueError, match="no truncation percentiles"):
        truncation_budgets(HeadAnalysis(**{**vars(fake()), "truncation_p90": None}))


def test_budgets_of_a_real_analysis_certify_what_they_say():
    case = make_case(80, batch=6, n_pos=16)
    result = tl_geometry.analyze_heads(case.cache(), n_values=(1, 2, 4, 8), queries="all",
                                       random_samples=0, shuffle_samples=0)
    budgets = truncation_budgets(result, eps=0.2)
    instances = _instances(case, (1, 2, 4, 8), "all")
    for h in range(4):
        k = int(budgets[0, h])
        if k == NO_BUDGET:
            continue
        values = instances[(h, (1, 2, 4, 8).index(k), "tail_mass")]
        assert sum(x <= 0.2 for x in values) >= 0.9 * len(values)


# --- the file -----------------------------------------------------------------------------------


def test_files_keep_the_percentiles_and_format_4_files_load_quietly(tmp_path):
    case = make_case(81, batch=3)
    result = tl_geometry.analyze_heads(case.cache(), n_values=(1, 2, 4), random_samples=2, shuffle_samples=2)
    path = result.save(tmp_path / "r.pt")
    loaded = HeadAnalysis.load(path)
    torch.testing.assert_close(loaded.truncation_p90, result.truncation_p90, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(loaded.scores, result.scores, rtol=0, atol=0, equal_nan=True)
    payload = torch.load(path, weights_only=True)
    assert payload["format"] == "tl_geometry.HeadAnalysis/9"
    assert payload["names"]["truncation_metric"] == ["tail_mass", "truncation_error"]
    # What format 4 wrote: no truncation metrics, no percentiles.
    names = payload["names"]["metric"]
    keep = [i for i, m in enumerate(names) if m not in TRUNCATION]
    old = {**payload, "format": "tl_geometry.HeadAnalysis/4", "scores": payload["scores"][:, keep],
           "names": {**payload["names"], "metric": [names[i] for i in keep]},
           "axes": {k: v for k, v in payload["axes"].items() if k != "truncation_p90"}}
    del old["truncation_p90"], old["names"]["truncation_metric"]
    drop_format_6(old)
    old["checksum"] = _result_io.checksum(old)
    torch.save(old, tmp_path / "old.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the metrics format 5 added are expected to be missing
        four = HeadAnalysis.load(tmp_path / "old.pt")
    assert four.truncation_p90 is None and four.p90_tail_mass.isnan().all()
    assert four.tail_mass.isnan().all() and four.metric("truncation_error", "random").isnan().all()
    assert torch.equal(four.f_score, result.f_score)
    with pytest.raises(ValueError, match="no truncation percentiles"):
        truncation_budgets(four)
    # A format-5 file that lacks them is damaged or foreign: that still warns.
    five = {**old, "format": "tl_geometry.HeadAnalysis/5"}
    five["checksum"] = _result_io.checksum(five)
    torch.save(five, tmp_path / "five.pt")
    with pytest.warns(UserWarning, match="filled"):
        HeadAnalysis.load(tmp_path / "five.pt")


def test_names_and_shortcuts():
    r = fake()
    assert tl_geometry.result.METRIC_NAMES[-2:] == TRUNCATION_NAMES == ("tail_mass", "truncation_error")
    assert hasattr(HeadAnalysis, "tail_mass") and hasattr(HeadAnalysis, "truncation_error")
    for group in ("random", "shuffled", "sink_removed", "sink_in", "sink_out"):  # through the accessor
        assert r.metric("tail_mass", group).shape == r.metric("truncation_error", group).shape == r.f_score.shape
    assert torch.equal(r.p90_truncation_error, r.truncation_p90[1])
    old = HeadAnalysis(**{**vars(r), "truncation_p90": None})  # a file of format 4
    assert old.p90_truncation_error.isnan().all()  # NaN, not an error
    with pytest.raises(ValueError, match="unknown truncation metric 'f_score'"):
        r.truncation_percentile("f_score")
    assert "p90_tail_mass" in r.quantities() and "tail_mass" in r.to_pandas()


def test_nearest_rank_percentile():
    x = torch.tensor([[3.0, math.nan], [1.0, math.nan], [2.0, math.nan]] + [[float(i), 1.0] for i in range(4, 11)])
    got = nearest_rank_percentile(x, 0.9)
    assert got[0].item() == 9.0 and got[1].item() == 1.0  # ⌈0.9·10⌉ = 9th of 1…10; all of [1]*7
    assert nearest_rank_percentile(torch.empty(0, 2), 0.9).isnan().all()
    with pytest.raises(ValueError, match=r"q must be in \(0, 1\]"):
        nearest_rank_percentile(x, 0.0)
