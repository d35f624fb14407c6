"""The value-shuffle null, the chance-corrected F* and the paired sink effect (SPEC §3) in the
summary, the plots, the views and the report; results without paired figures still show."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from result_fakes import fake

import tl_geometry
from tl_geometry import HeadAnalysis, views
from tl_geometry.result import null_decomposition
from tl_geometry.result import schema as _result_schema
from tl_geometry.result.headline import EQUAL, LOWERS, RAISES, geometry_reading
from tl_geometry.views.report import n_means_table, sink_effect_section


def paired_fake(seed: int = 0) -> HeadAnalysis:
    """``fake()`` (N = 2, 4, 8 of t+1 = 20 keys) with random paired figures; some heads have no
    instance holding the sink (count 0, ratio and fraction NaN)."""
    r = fake(layers=(3, 5), n_heads=4, n_values=(2, 4, 8), metadata={"n_positions": 20})
    g = torch.Generator().manual_seed(seed)
    shape = (len(_result_schema.PAIRED_FIELDS), 2, 4, 3)
    paired = torch.rand(shape, generator=g, dtype=torch.float64)
    paired[0] *= 2  # ratios in [0, 2)
    paired[2] = torch.randint(0, 4, shape[1:], generator=g).double()
    paired[:2][:, paired[2] == 0] = torch.nan
    return HeadAnalysis(**{**vars(r), "paired": paired})


def test_paired_sink_summary_is_the_median_over_heads_next_to_the_pooled_means():
    r = paired_fake()
    table = r.paired_sink_summary()
    assert table.n.tolist() == [2, 4, 8] and table.dense.tolist() == [False, False, True]
    for i, row in table.iterrows():
        ratios = [float(r.paired_sink_ratio[li, h, i]) for li in range(2) for h in range(4)
                  if r.paired_sink("count")[li, h, i] > 0]
        halved = [float(r.paired_sink_halved[li, h, i]) for li in range(2) for h in range(4)
                  if r.paired_sink("count")[li, h, i] > 0]
        assert row.paired_heads == len(ratios)
        assert row.paired_instances == int(r.paired_sink("count")[..., i].sum())
        if ratios:
            assert math.isclose(row.paired_median_ratio, float(np.median(ratios)))
            assert math.isclose(row.paired_median_halved, float(np.median(halved)))
        else:
            assert math.isnan(row.paired_median_ratio)
        for group in ("sink_in", "sink_out"):  # pooled: every instance of every head
            f, count = r.metric("f_score", group)[..., i].flatten(), r.count(group)[..., i].flatten()
            want = sum(float(a * b) for a, b in zip(f, count)) / float(count.sum())
            assert math.isclose(row[f"pooled_f_{group}"], want)
        assert math.isclose(row.f_sink_removed, float(r.sink_removed_f_score[..., i].mean()))


def test_a_result_without_paired_figures_still_shows(tmp_path):
    r = HeadAnalysis(**{**vars(fake(n_values=(2, 4), metadata={"n_positions": 64})), "paired": None})
    table = r.paired_sink_summary()
    assert table.paired_median_ratio.isna().all() and (table.paired_heads == 0).all()
    assert "paired sink effect" not in r.summary()
    section = "".join(sink_effect_section(r))
    assert "No head has a paired instance here" in section and "pooled F, sink in S_N" in section


def test_summary_shows_f_star_shuffled_and_the_paired_sink_effect():
    r = paired_fake()
    text = r.summary(top=2)
    line = next(x for x in text.splitlines() if x.startswith("  mean F_2:"))
    assert f"(F* {float(r.f_score_cc[..., 0].mean()):.3f})" in line
    assert f"shuffled {float(r.shuffled_f_score[..., 0].mean()):.3f}" in line
    assert line.index("top-N") < line.index("shuffled") < line.index("random") < line.index("sink removed")
    table = r.paired_sink_summary().set_index("n")
    assert "paired sink effect" in text
    if table.paired_heads[2]:
        assert f"    N=2: F_N(with) / F_N(removed) {table.paired_median_ratio[2]:.2f}, " in text


def test_plots_and_views_show_the_shuffled_null_and_f_star():
    r = paired_fake()
    fig = views.f_curves_plot(r, by="class")
    names = {line.get_label() for line in fig.axes[3].get_lines()}
    assert {"top N keys", "N random keys", "top N, values shuffled"} <= names
    cc = views.f_curves_plot(r, by="layer", metric="f_score_cc")
    top = next(line for line in cc.axes[0].get_lines() if line.get_label() == "top N keys")
    assert np.allclose(top.get_ydata(), r.f_score_cc[0].mean(0).numpy())
    assert cc.axes[0].get_ylabel() == "F* of N keys" and cc._suptitle.get_text().startswith("Chance-corrected F")
    with pytest.raises(ValueError, match="metric must be one of"):
        views.f_curves_plot(r, metric="fscore")
    grid = views.taxonomy_view(r).fragment()
    assert "(F* " in grid and "shuffled " in grid


def test_report_tables_hold_f_star_shuffled_and_both_sink_comparisons():
    r = paired_fake()
    table = n_means_table(r)
    assert list(table.columns) == ["N", "F top-N", "F* top-N", "F shuffled", "F random", "F sink removed",
                                   "top − shuffled", "shuffled − random", "geometry"]
    assert np.allclose(table["top − shuffled"], table["F top-N"] - table["F shuffled"])
    assert math.isclose(table["F shuffled"][0], float(r.shuffled_f_score[..., 0].mean()))
    section = "".join(sink_effect_section(r))
    assert "Sink effect on F_N: pooled and paired" in section and "paired: median ratio" in section
    assert "8†" in section and "No head has a paired instance" not in section


def test_report_of_a_real_analysis_has_the_sink_effect_and_its_csv(tmp_path):
    import pandas as pd
    from test_views import synthetic_cache

    r = tl_geometry.analyze_heads(synthetic_cache(n_pos=20), n_values=(1, 2, 4, 8), random_samples=2)
    page = tl_geometry.write_report(r, tmp_path).read_text()
    csv = pd.read_csv(tmp_path / "sink_effect.csv")
    assert csv.n.tolist() == [1, 2, 4, 8] and "paired_median_ratio" in csv
    has = (r.paired_sink("count") > 0).sum(dim=(0, 1))
    assert csv.paired_heads.tolist() == has.tolist()
    assert "Sink effect on F_N: pooled and paired" in page and "sink_effect.csv" in page


# --- reading the top − null gap with both signs, and its decomposition (SPEC §3) ---------------

def test_a_gap_is_read_with_both_signs():
    assert geometry_reading(0.05) == geometry_reading(0.3) == RAISES
    assert geometry_reading(-0.05) == geometry_reading(-0.3) == LOWERS  # never "equal"
    assert geometry_reading(0.049) == geometry_reading(-0.049) == geometry_reading(0.0) == EQUAL
    assert geometry_reading(math.nan) == "undefined"


def _with_shuffled_f(result: HeadAnalysis, gap: list[float]) -> HeadAnalysis:
    """``result`` with F_N(shuffled) = F_N(top) − gap[i] at every head."""
    scores = result.scores.clone()
    g_top, g_shuffled = (_result_schema.GROUPS.index(g) for g in ("top", "shuffled"))
    f = _result_schema.names()["metric"].index("f_score")
    scores[g_shuffled, f] = scores[g_top, f] - torch.tensor(gap, dtype=scores.dtype)
    return HeadAnalysis(**{**vars(result), "scores": scores})


def test_report_table_reads_a_negative_gap_as_geometry_lowering_separability():
    r = _with_shuffled_f(paired_fake(), [-0.2, 0.0, 0.1])
    assert n_means_table(r)["geometry"].tolist() == [LOWERS, EQUAL, RAISES]


@pytest.fixture(scope="module")
def four_nulls():
    from test_views import synthetic_cache

    cache = synthetic_cache(n_pos=20)
    return {kind: tl_geometry.analyze_heads(cache, n_values=(1, 2, 4, 8), random_samples=0, shuffle_samples=3,
                                            shuffle=kind)
            for kind in ("values", "norms", "directions", "unselected")}


def test_decomposition_is_the_mean_gap_per_null(four_nulls):
    table = null_decomposition(four_nulls)
    assert list(table.columns) == ["n", "dense", "top", "top − values", "top − norms", "top − directions",
                                   "top − unselected", "reading"]
    assert table.n.tolist() == [1, 2, 4, 8] and table.dense.tolist() == [False, False, False, True]
    top = four_nulls["values"].f_score_cc
    for kind, r in four_nulls.items():
        want = (top - r.metric("f_score_cc", "shuffled")).nanmean(dim=(0, 1))
        np.testing.assert_allclose(table[f"top − {kind}"], want.numpy(), rtol=1e-12)
    assert table.reading.tolist() == [geometry_reading(x) for x in table["top − values"]]
    raw = null_decomposition({"norms": four_nulls["norms"]}, metric="f_score")  # any subset, any metric
    assert list(raw.columns) == ["n", "dense", "top", "top − norms"]
    np.testing.assert_allclose(raw["top"], four_nulls["norms"].f_score.nanmean(dim=(0, 1)).numpy())


def test_decomposition_refuses_results_it_cannot_compare(four_nulls):
    with pytest.raises(ValueError, match="needs a mapping"):
        null_decomposition({})
    with pytest.raises(ValueError, match="unknown null 'keys'"):
        null_decomposition({"keys": four_nulls["values"]})
    with pytest.raises(ValueError, match=r"results\['norms'\] was made with shuffle='values'"):
        null_decomposition({"norms": four_nulls["values"]})
    other = HeadAnalysis(**{**vars(four_nulls["norms"]), "metadata": {**four_nulls["norms"].metadata, "seed": 1}})
    with pytest.raises(ValueError, match="do not share"):
        null_decomposition({"values": four_nulls["values"], "norms": other})


def test_report_shows_the_decomposition_when_given_the_other_nulls(four_nulls, tmp_path):
    import pandas as pd

    nulls = {k: v for k, v in four_nulls.items() if k != "values"}
    page = tl_geometry.write_report(four_nulls["values"], tmp_path, nulls=nulls).read_text()
    assert "Decomposing the top − shuffled gap" in page and "F*(top) − F*(unselected)" in page
    assert "null_decomposition.csv" in page
    csv = pd.read_csv(tmp_path / "null_decomposition.csv")
    np.testing.assert_allclose(csv["top − norms"], null_decomposition(four_nulls)["top − norms"])
    plain = tl_geometry.write_report(four_nulls["values"], tmp_path / "plain").read_text()
    assert "Decomposing" not in plain and "the values null" in plain
    with pytest.raises(ValueError, match="was made with shuffle='norms'"):
        tl_geometry.write_report(four_nulls["values"], tmp_path / "bad", nulls={"directions": nulls["norms"]})
    assert not (tmp_path / "bad").exists()  # refused before anything is written
