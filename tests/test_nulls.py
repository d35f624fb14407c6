"""The value-shuffle null, the chance-corrected scores and the paired sink effect (SPEC §3)
against the loop reference, on both backends."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from cases import make_case
from reference import METRICS, ref_analyze

import tl_geometry
from tl_geometry.engine import paired
from tl_geometry.engine.rng import GOLDEN, SAMPLE_STRIDE, SHUFFLE_SALT, mix, sequence_keys

N_VALUES = (1, 2, 3, 5, 8)
SHUFFLES = 3


def engine_shuffles(seed: int, layer: int, mask: np.ndarray | None):
    """The engine's value permutations, re-derived from the documented stream (engine/rng.py)."""

    def draw(b: int, h: int, t: int, listed: list[int]) -> list[list[int]]:
        """Fisher–Yates shuffles of ``listed`` (the keys the null moves, in position order)."""
        real_index = t if mask is None else int(mask[b, : t + 1].sum()) - 1
        row_key = mix(mix(int(sequence_keys(seed, layer, [b])[0]) + real_index) + h)
        shuffle_key = mix(row_key ^ SHUFFLE_SALT)
        perms = []
        for sample in range(SHUFFLES):
            perm = list(listed)
            m = len(perm)
            for r in range(m - 1):
                u = mix(shuffle_key + GOLDEN * (sample * SAMPLE_STRIDE + r + 1))
                j = r + (((u >> 32) * (m - r)) >> 32)
                perm[r], perm[j] = perm[j], perm[r]
            perms.append(perm)
        return perms

    return draw


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
    for group in ("top", "shuffled", "sink_removed", "sink_in", "sink_out"):
        for m in METRICS:
            np.testing.assert_allclose(result.metric(m, group)[0].numpy(), want[f"{group}_{m}"],
                                       rtol=1e-9, atol=1e-9, equal_nan=True, err_msg=f"{group} {m}")
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


def test_shuffled_is_batch_and_chunk_independent(monkeypatch):
    case = make_case(73, batch=4, padding="left")
    kwargs = dict(n_values=(1, 2, 4), queries="all", attention_mask=case.attention_mask)
    whole = tl_geometry.analyze_heads(case.cache(), **kwargs)
    from tl_geometry.engine import layer

    monkeypatch.setattr(layer, "MIN_CHUNK_BYTES", 1)
    monkeypatch.setattr(layer, "CHUNK_FRACTION", 1e-9)  # one sequence, one group per chunk
    chunked = tl_geometry.analyze_heads(case.cache(), **kwargs)
    for name in ("shuffled_f_score", "shuffled_f_score_cc", "f_score_cc", "paired_sink_ratio"):
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), equal_nan=True,
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
