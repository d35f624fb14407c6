"""SPEC §4 "Statistical unit" (value-only figures over KV heads) and SPEC §6d "Reading 'tracks'"
(ρ within each headline N; best-N agreement against its chance rate), on hand-built results."""

from __future__ import annotations

import math

import pytest
import torch
from result_fakes import fake

from tl_geometry.result import units
from tl_geometry.result.schema import names
from tl_geometry.result.tracking import agreement_vs_chance

SINK = names()["sink_field"].index
REGIME = names()["regime_field"].index


def _grouped(group: int = 3, n_heads: int = 9, *, record: bool = True, space: str = "value", bounds=False):
    """A result whose value-only figures are equal inside groups of ``group`` query heads, while
    the sink mass (it reads α) differs per query head."""
    meta = {"n_kv_heads": n_heads // group} if record else {}
    r = fake(layers=(0, 1), n_heads=n_heads, bounds=bounds, metadata={**meta, "space": space})
    kv = torch.arange(n_heads) // group
    per_kv = torch.tensor([[0.1, 0.4, 2.0, 0.7], [0.2, 0.3, -0.5, 0.9]], dtype=torch.float64)
    for f in units.VALUE_ONLY_SINK_FIELDS:
        r.sink[SINK(f)] = per_kv[:, kv]
    if bounds:
        for f in units.VALUE_ONLY_REGIME_FIELDS:
            r.regime[REGIME(f)] = (per_kv + 10)[:, kv]
    return r


def test_value_only_figures_reduce_to_kv_heads():
    r = _grouped()
    assert r.kv_group_size == 3 and r.n_kv_heads == 3
    kappa = r.kv_heads("sink_norm_ratio")
    torch.testing.assert_close(kappa, torch.tensor([[0.1, 0.4, 2.0], [0.2, 0.3, -0.5]], dtype=torch.float64))
    assert torch.equal(r.kv_heads(r.sink_cosine), r.sink_cosine[:, ::3])
    # The sink mass reads α: it differs inside a group, so it is not reduced — it stays per query head.
    with pytest.raises(ValueError, match="not a value-only quantity"):
        r.kv_heads("sink_mass")
    with pytest.raises(ValueError, match="unknown key"):
        r.kv_heads("sink_kappa")
    table = r.kv_heads_table()
    assert len(table) == 6 and table.query_heads.tolist()[:3] == ["0-2", "3-5", "6-8"]
    assert table.sink_norm_ratio.tolist() == [0.1, 0.4, 2.0, 0.2, 0.3, -0.5]
    assert units.unit_text(r) == "6 KV heads"


def test_identity_within_a_group_tolerates_rounding_and_nan_only():
    r = _grouped()
    r.sink[SINK("cosine"), 0, 1] += 1e-9  # float rounding: still one KV head
    r.sink[SINK("norm_ratio"), 1, 3:6] = math.nan  # a KV head with no defined κ: NaN agrees with NaN
    assert r.kv_heads("sink_cosine").shape == (2, 3) and r.kv_heads("sink_norm_ratio")[1, 1].isnan()
    r.sink[SINK("cosine"), 0, 1] += 1e-3
    with pytest.raises(ValueError, match="differs between query heads of one KV group"):
        r.kv_heads("sink_cosine")


def test_group_size_without_metadata_is_inferred_and_output_space_is_per_query_head():
    assert _grouped(record=False).kv_group_size == 3  # files written before metadata["n_kv_heads"]
    assert _grouped(3, 12, record=False).kv_group_size == 3  # 12 heads: 12, 6 and 4 do not fit, 3 does
    assert _grouped(4, 4, record=False, bounds=True).kv_group_size == 4  # MQA
    assert fake().kv_group_size == 1  # every head its own values
    out = _grouped(space="output")
    assert out.kv_group_size == 1 and out.n_kv_heads == 9  # values v W_O[h] are per query head
    assert "over the 18 heads" in out.summary()


def test_summary_counts_value_only_figures_over_kv_heads():
    r = _grouped(bounds=True)
    line = " ".join(r.summary().split())  # the wrapped paragraph as one line
    assert "over the 6 KV heads, not the 18 query heads" in line
    # κ over KV heads: [0.1, 0.4, 2.0, 0.2, 0.3, -0.5] → median 0.25, 5 of 6 below 1.
    assert "median κ 0.250" in line and "κ < 1 for 83.3%" in line
    assert "negative for 16.7%" in line
    assert r.kv_heads("regime_kappa").shape == (2, 3)


def test_agreement_against_its_chance_rate():
    measured = torch.tensor([2.0, 2.0, 2.0, 2.0, 4.0, math.nan])
    always_two = torch.full((6,), 2.0)
    a = agreement_vs_chance(measured, always_two)
    # 4 of 5 agree, and so does every shuffle: chance 0.8 · 1 = 0.8, no excess, p = 1.
    assert a.heads == 5 and a.agreement == pytest.approx(0.8) and a.chance == pytest.approx(0.8)
    assert a.excess == pytest.approx(0.0) and a.p_value == 1.0 and not a.above_chance
    values = torch.arange(40.0) % 4 + 1  # four best Ns, ten heads each
    perfect = agreement_vs_chance(values, values.clone(), seed=1)
    assert perfect.agreement == 1.0 and perfect.chance == pytest.approx(0.25)
    assert perfect.p_value == pytest.approx(1 / 1001) and perfect.above_chance
    assert perfect.text().startswith("100.0 % of 40 heads (chance 25.0 %, excess +75.0 points")
    assert agreement_vs_chance(values, values, seed=1) == perfect  # seeded
    none = agreement_vs_chance(torch.tensor([math.nan]), torch.tensor([2.0]))
    assert none.heads == 0 and math.isnan(none.agreement) and not none.above_chance
    with pytest.raises(ValueError, match="n_shuffles"):
        agreement_vs_chance(values, values, n_shuffles=0)


def test_exact_chance_matches_the_mean_of_many_shuffles():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(1, 4, (60,), generator=g).double()
    b = torch.randint(1, 3, (60,), generator=g).double()
    exact = agreement_vs_chance(a, b).chance
    perms = torch.rand(20000, 60, generator=g).argsort(-1)
    assert (b[perms] == a).double().mean().item() == pytest.approx(exact, abs=2e-3)


def test_rho_is_read_within_each_headline_n_not_pooled():
    """Both curves fall with N for every head, but within each N the bound orders the heads
    backwards: pooled over (head, N), ρ looks large; within each N it is −1."""
    r = fake(layers=(0,), n_heads=4, n_values=(1, 2, 4, 8), bounds=True, metadata={"n_positions": 32})
    metric, kind = names()["metric"].index("f_score"), names()["bound_kind"].index("shell_n")
    level = torch.tensor([0.0, 0.9, 0.6, 0.3], dtype=torch.float64)  # per N: falls with N
    head = torch.tensor([0.0, 0.01, 0.02, 0.03], dtype=torch.float64)
    r.scores[0, metric, 0] = level[None, :] + head[:, None]
    r.bounds[kind, metric] = (level[None, :] - head[:, None])[None] * 0.5
    table = r.rho_by_n("shell_n")
    assert table.n.tolist() == [2, 4, 8] and table.heads.tolist() == [4, 4, 4]
    assert table.rho.tolist() == pytest.approx([-1.0, -1.0, -1.0])
    from tl_geometry.functional.stats import spearman

    pooled = spearman(r.bound("shell_n")[..., 1:], r.f_score[..., 1:])
    assert pooled > 0.7  # what pooling would have reported
    summary = " ".join(r.summary().split())  # wrapped lines as one
    assert "within each headline N: N=2: -1.00, N=4: -1.00, N=8: -1.00" in summary
    best = r.best_n_vs_chance("shell_n")
    assert best.heads == 4 and best.agreement == 1.0 and best.chance == 1.0 and not best.above_chance
    assert "at or below chance: it predicts nothing" in summary


@pytest.mark.real_model
def test_real_value_only_figures_are_identical_inside_a_kv_group(smollm2):
    """SmolLM2 (9 query heads share 3 KV heads): κ, c_sink, cos(v_sink, mean v) and the regime
    diagnostics agree inside each group, the sink mass does not; both front doors record n_kv."""
    import tl_geometry

    r = tl_geometry.analyze_heads(smollm2.cache, n_values=(2, 4), layers=[0, 5], bounds=True,
                                  random_samples=2, progress=False)
    assert r.metadata["n_kv_heads"] == 3 and r.kv_group_size == 3 and r.n_kv_heads == 3
    for name in units.value_only_names():
        assert r.kv_heads(name).shape == (2, 3), name
    with pytest.raises(ValueError, match="not a value-only quantity"):
        r.kv_heads("sink_mass")
    r.metadata.pop("n_kv_heads")
    assert r.kv_group_size == 3  # inferred for files written without it
    assert "over the 6 KV heads, not the 18 query heads" in " ".join(r.summary().split())
    streamed = tl_geometry.analyze_model(smollm2.model, smollm2.tokens[:1], n_values=(2,), layers=[1],
                                         random_samples=2, progress=False)
    assert streamed.metadata["n_kv_heads"] == 3 and streamed.kv_heads("sink_cosine").shape == (1, 3)
