"""write_report on a synthetic cache: the folder's files, a self-contained page, the Ablation
section, and the command's argument checks (no model is loaded here)."""

from __future__ import annotations

import re

import pandas as pd
import pytest
import torch
from test_views import N_HEADS, N_LAYERS, synthetic_cache

import tl_geometry
from tl_geometry import HeadAnalysis, views
from tl_geometry.cli.main import main


@pytest.fixture(scope="module")
def analysed():
    cache = synthetic_cache(n_pos=20)
    return cache, tl_geometry.analyze_heads(cache, n_values=(1, 2, 4, 8), random_samples=4, bounds=True)


def test_report_folder_holds_page_tables_figures_and_analysis(analysed, tmp_path):
    cache, result = analysed
    tokens = [f"tok{i}" for i in range(20)]
    index = tl_geometry.write_report(result, tmp_path / "rep", cache=cache, tokens=tokens)
    out = index.parent
    assert index == tmp_path / "rep" / "index.html"
    for name in ("analysis.pt", "heads.csv", "metrics.csv", "class_counts.csv", "sink_effect.csv"):
        assert (out / name).stat().st_size > 0
    for stem in ("f_by_class", "f_cc_by_class", "f_by_layer", "sink", "class_counts"):
        assert (out / "figures" / f"{stem}.png").is_file() and (out / "figures" / f"{stem}.svg").is_file()
    loaded = HeadAnalysis.load(out / "analysis.pt")
    assert torch.equal(loaded.scores.nan_to_num(-9), result.scores.nan_to_num(-9))
    heads = pd.read_csv(out / "heads.csv")
    assert len(heads) == N_LAYERS * N_HEADS and set(heads.label) <= {"Retriever", "Mixer", "Reset"}
    page = index.read_text()
    assert page.count("var CircuitsVis=") == 1
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert page.count("data:image/png;base64,") == 5  # every figure inlined
    # one attention, contribution and token view per class present, plus taxonomy and sink grids
    n_classes = len({x for row in result.labels for x in row})
    assert page.count('class="tlg-widget') == 2 + 4 * n_classes
    assert "Ablation" not in page


def test_report_states_what_the_classes_are_once_and_links_to_it(analysed, tmp_path):
    """The class, margin and stability definitions: once, near the top, under an anchor; the
    taxonomy grid's caption and the label-confidence section link to it."""
    import html

    from tl_geometry.result.text import CLASSES_TEXT

    _, result = analysed
    page = tl_geometry.write_report(result, tmp_path).read_text()
    assert page.count(html.escape(CLASSES_TEXT)) == 1
    anchor = page.index(f'id="{views.report.CLASSES_ID}"')
    assert anchor < page.index("Head taxonomy") and page.index(html.escape(CLASSES_TEXT)) > anchor
    links = [m.start() for m in re.finditer(f'href="#{views.report.CLASSES_ID}"', page)]
    confidence = page.index("<h2>Label confidence</h2>")
    assert len(links) == 2 and page.index("Head taxonomy") < links[0] < confidence < links[1]
    # A taxonomy view on its own still states the definitions.
    assert html.escape(CLASSES_TEXT) in views.taxonomy_view(result).fragment()


def test_report_without_cache_has_no_token_views(analysed, tmp_path):
    _, result = analysed
    page = tl_geometry.write_report(result, tmp_path).read_text()
    assert "CircuitsVis" not in page and page.count('class="tlg-widget') == 2


def test_ablation_section_appears_when_prune_left_its_tables(analysed, tmp_path):
    _, result = analysed
    old = pd.DataFrame({"layer": [0, 1, 1], "head": [2, 0, 3], "loss": [3.1, 9.0, 3.2],
                        "loss_increase": [0.1, 6.0, 0.2], "critical": [False, True, False]})
    assert "not determined" in tl_geometry.views.report.critical_text(old)  # no SE: no rule
    old.assign(loss_increase_se=[0.01, 0.5, 0.3], outlier=[False, True, True]
               ).to_csv(tmp_path / "sensitivity.csv", index=False)
    pd.DataFrame({"ordering": ["random", "random", "taxonomy", "taxonomy"], "seed": [0, 0, 0, 0],
                  "retention": [1.0, 0.5, 1.0, 0.5], "n_removed": [0, 4, 0, 4],
                  "loss": [3.0, 4.0, 3.0, 3.4], "perplexity": [20.1, 54.6, 20.1, 30.0]}
                 ).to_csv(tmp_path / "sparsification.csv", index=False)
    page = tl_geometry.write_report(result, tmp_path).read_text()
    assert "<h2>Ablation</h2>" in page and "Critical heads: L1H0." in page
    assert (tmp_path / "figures" / "ablation.png").is_file() and page.count("data:image/png;base64,") == 6
    assert page.index("6.0000") < page.index("0.2000")  # sorted by loss increase


def test_example_heads_pick_the_largest_gain_per_class(analysed):
    _, result = analysed
    gain = result.f_gain[..., 1]
    for cls, layer, head in tl_geometry.views.report.example_heads(result):
        li = result.layers.index(layer)
        assert result.labels[li][head] == cls
        same = torch.tensor([[x == cls for x in row] for row in result.labels])
        assert float(gain[li, head]) == float(gain[same].nan_to_num(-9).max())


def test_write_report_rejects_a_non_analysis(tmp_path):
    with pytest.raises(TypeError, match="HeadAnalysis"):
        tl_geometry.write_report({"not": "an analysis"}, tmp_path)


@pytest.mark.parametrize("argv, message", [
    (["report", "--n-seqs", "0"], "--n-seqs: must be ≥ 1"),
    (["report", "--text", "/no/such/file.txt"], "does not exist"),
    (["report", "--model", "gpt9"], "Unknown model 'gpt9'"),
])
def test_report_command_checks_arguments_before_loading(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_views_module_is_public():
    assert "views" in tl_geometry.__all__ and "write_report" in tl_geometry.__all__
    assert set(views.__all__) <= set(dir(views))
