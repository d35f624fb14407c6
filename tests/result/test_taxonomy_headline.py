"""Unlabelled heads (SPEC §5) and the headline range 2 ≤ N ≤ (t+1)/4 (SPEC §3) in the result's
text, tables, views, plots, report and the taxonomy removal order."""

from __future__ import annotations

import math
import re

import pytest
import torch
from result_fakes import fake

import tl_geometry
from tl_geometry import views
from tl_geometry.ablation.orderings import taxonomy_order
from tl_geometry.functional.taxonomy import CLASSES, UNLABELLED, labels_from_votes
from tl_geometry.result import headline as _result_headline
from tl_geometry.result import text as _result_text


def unlabelled_fake(**kwargs):
    """``fake()`` with heads (layer position 0, head 1) and (1, 3) given no votes at all."""
    r = fake(**kwargs)
    r.vote_counts[0, 1] = 0
    r.vote_counts[1, 3] = 0
    return r


# --- unlabelled heads -------------------------------------------------------------------------
def test_no_votes_is_no_label_never_a_retriever():
    counts = torch.tensor([[0.0, 0.0, 0.0], [3.0, 3.0, 3.0], [0.0, 2.0, 2.0], [float("nan")] * 3])
    assert labels_from_votes(counts).tolist() == [UNLABELLED, 0, 1, UNLABELLED]
    assert labels_from_votes(torch.zeros(2, 5, 3)).eq(UNLABELLED).all()


def test_unlabelled_heads_are_none_and_left_out_of_counts_and_shares():
    r = unlabelled_fake(layers=(3, 5), n_heads=4)
    assert r.labels[0][1] is None and r.labels[1][3] is None
    assert r.label(3, 1) is None and r.label(5, 3) is None and r.label(3, 0) in CLASSES
    assert r.n_unlabelled == 2
    counts = r.class_counts()
    assert list(counts.columns) == list(CLASSES) and int(counts.to_numpy().sum()) == 6
    labelled = [x for row in r.labels for x in row if x is not None]
    assert {c: int(counts[c].sum()) for c in CLASSES} == {c: labelled.count(c) for c in CLASSES}
    assert r.sel(layer=3, head=1)["label"] is None
    table = r.heads_table()
    assert table.label.isna().sum() == 2 and table.label.value_counts().sum() == 6
    long = r.to_pandas()
    assert long[long.label.isna()][["layer", "head"]].drop_duplicates().values.tolist() == [[3, 1], [5, 3]]


def test_summary_and_repr_show_unlabelled_and_share_over_labelled_heads():
    r = unlabelled_fake(layers=(3, 5), n_heads=4)
    text = r.summary(top=None)
    totals = _result_text.class_totals(r)
    shares = [f"{c} {k} ({100 * k / 6:.1f}%)" for c, k in totals.items()]
    flat = " ".join(text.split())  # the line wraps at 100 columns
    assert "Classes: " + ", ".join(shares) + "; 2 unlabelled (no votes; not in the shares)" in flat
    rows = {tuple(map(int, line.split()[:2])): line.split()[2]
            for line in text.splitlines() if line[:5].strip().isdigit()}
    assert rows[(3, 1)] == rows[(5, 3)] == "unlabelled" and "Retriever" in rows.values()
    assert "unlabelled=2" in repr(r)
    assert "unlabelled" not in repr(fake())  # only when there are some


def test_taxonomy_view_greys_unlabelled_heads_and_shares_over_the_labelled():
    r = unlabelled_fake(layers=(3, 5), n_heads=4)
    grid = views.taxonomy_view(r).fragment()
    cells = re.findall(r'<td><div style="background:([^;]+);[^"]*" title="([^"]*)">([^<]*)</div>', grid)
    flat = [x for row in r.labels for x in row]
    assert len(cells) == len(flat) == 8
    for (color, title, short), label in zip(cells, flat):
        assert color == views.class_color(label)
        if label is None:
            assert color == views.CLASS_COLORS["unlabelled"] and short == "—" and ": unlabelled" in title
    totals = _result_text.class_totals(r)
    for c, k in totals.items():
        assert f"{c}: {k} ({100 * k / 6:.1f}%)" in grid
    assert "unlabelled: 2 (no votes; not in the shares)" in grid
    assert "Retriever / Mixer / Reset / unlabelled" in grid
    assert "unlabelled" not in views.taxonomy_view(fake()).fragment()


def test_plots_handle_unlabelled_heads(tmp_path):
    r = unlabelled_fake(layers=(3, 5), n_heads=4, n_values=(1, 2, 4))
    fig = views.f_curves_plot(r, by="class")
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    labelled = [x for row in r.labels for x in row if x is not None]
    assert titles[:3] == [f"{c}: {labelled.count(c)} head" + ("" if labelled.count(c) == 1 else "s")
                          for c in CLASSES]
    assert titles[3] == "all 8 heads"
    sink = views.sink_plot(r)
    assert "unlabelled" in [t.get_text() for t in sink.axes[0].get_legend().get_texts()]
    bars = views.class_counts_plot(r).axes[0].patches
    assert sum(p.get_height() for p in bars) == 6
    views.save_figure(fig, tmp_path / "f", formats=("png",))


def test_taxonomy_order_removes_unlabelled_heads_after_every_class():
    r = unlabelled_fake(layers=(0, 1), n_heads=4, n_values=(2,))
    order = taxonomy_order(r).heads
    assert set(order[-2:]) == {(0, 1), (1, 3)}
    rank = {"Mixer": 0, "Reset": 1, "Retriever": 2}
    classes = [rank[r.labels[layer][head]] for layer, head in order[:-2]]
    assert classes == sorted(classes)


def test_a_one_position_analysis_is_all_unlabelled_and_reports(tmp_path):
    from test_views import synthetic_cache

    cache = synthetic_cache(n_pos=1)
    with pytest.warns(UserWarning, match="cannot be evaluated"):
        r = tl_geometry.analyze_heads(cache, n_values=(1, 2), random_samples=2)
    assert r.n_unlabelled == r.n_layers * r.n_heads and r.class_counts().to_numpy().sum() == 0
    assert "Retriever 0, Mixer 0, Reset 0; 8 unlabelled" in " ".join(r.summary().split())
    page = tl_geometry.write_report(r, tmp_path).read_text()
    assert "8 unlabelled (no votes; not in the shares)" in page and "nan%" not in page


# --- the headline range -----------------------------------------------------------------------
@pytest.mark.parametrize(("n_positions", "n_values", "want"), [
    (20, (1, 2, 4, 8), (2, 4)),
    (128, (1, 2, 4, 8, 16, 32, 64), (2, 4, 8, 16, 32)),
    (7, (1, 2, 4), ()),
    (None, (1, 2, 4, 8, 16, 63), (2, 4, 8, 16, 63)),   # t+1 not recorded: every N ≥ 2
])
def test_headline_n_is_2_to_a_quarter_of_the_keys_and_the_rest_is_dense(n_positions, n_values, want):
    meta = {} if n_positions is None else {"n_positions": n_positions}
    r = fake(n_values=n_values, metadata=meta)
    assert r.headline_n == want
    dense = [n for n in n_values if _result_headline.is_dense(r, n)]
    assert dense == [n for n in n_values if n >= 2 and n not in want]
    text = _result_headline.headline_text(r)
    assert ("not recorded" in text) == (n_positions is None)


def test_summary_marks_dense_n_and_headlines_only_the_range():
    r = fake(n_values=(1, 2, 4, 8), metadata={"n_positions": 20})
    text = r.summary(n_values=(2, 4, 8), top=3)
    assert "Headline range 2 ≤ N ≤ (t+1)/4 = 5: N = 2, 4;" in text
    assert "mean F_8†:" in text and "mean F_2:" in text and "mean F_4:" in text
    assert "F8† top/rnd" in text and "F2 top/rnd" in text
    line = next(x for x in text.splitlines() if x.startswith("  headline N = 2..4:"))
    top = float(line.split("top-N ")[1].split()[0])
    assert math.isclose(top, float(r.f_score[..., 1:3].mean()), abs_tol=1e-3)
    # a dense first N is never the ranking N
    dense_first = fake(n_values=(2, 4, 8), metadata={"n_positions": 16})
    assert "by F_2 gain" in dense_first.summary(n_values=(8, 2), top=2)


def test_f_curves_shade_the_dense_n():
    dense = views.f_curves_plot(fake(n_values=(1, 2, 4, 8), metadata={"n_positions": 20}))
    spans = [p for p in dense.axes[3].patches if p.get_label().startswith("dense N")]
    assert len(spans) == 1
    x0, x1 = spans[0].get_x(), spans[0].get_x() + spans[0].get_width()  # a Rectangle in data x
    assert math.isclose(x0, 5.0) and x1 > 8
    legend = [t.get_text() for t in dense.legends[0].get_texts()]
    assert "dense N > (t+1)/4 (not headlined)" in legend
    sparse = views.f_curves_plot(fake(n_values=(1, 2, 4), metadata={"n_positions": 64}))
    assert not [p for ax in sparse.axes for p in ax.patches if p.get_label().startswith("dense N")]


def test_report_headlines_the_range_and_marks_dense_n():
    from tl_geometry.views.report import _header, n_means_table

    r = fake(n_values=(1, 2, 4, 8), metadata={"n_positions": 20})
    table = n_means_table(r)
    assert table["N"].tolist() == ["1", "2", "4", "8†"]
    assert math.isclose(table["F top-N"][1], float(r.f_score[..., 1].mean()))
    head = _header(r, [])
    assert "headline range 2 ≤ N ≤ (t+1)/4" in head and "N ≤ 5: 2, 4 (dense N, marked †" in head
    assert "mean F_N over N = 2..4" in head
    assert f"{float(r.f_score[..., 1:3].mean()):.3f}" in head
