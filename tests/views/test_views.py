"""Views and plots on synthetic caches: offline pages, exact contributions, cropping, bad input."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from matplotlib.figure import Figure

import tl_geometry
from tl_geometry import CacheError, views
from tl_geometry.functional import kv_head_index, top_n_mask

N_LAYERS, N_HEADS, N_KV, D_HEAD = 2, 4, 2, 5


def synthetic_cache(n_pos: int = 12, batch: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """Causal softmax patterns and random values, GQA (4 query heads read 2 KV heads)."""
    g = torch.Generator().manual_seed(seed)
    cache = {}
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    for layer in range(N_LAYERS):
        scores = torch.randn(batch, N_HEADS, n_pos, n_pos, generator=g) * 2
        scores[..., 0] += 2.0  # a sink that draws attention
        cache[f"blocks.{layer}.attn.hook_pattern"] = scores.masked_fill(~causal, -torch.inf).softmax(-1)
        values = torch.randn(batch, n_pos, N_KV, D_HEAD, generator=g)
        values[:, 0] *= 0.2  # a compressed sink value (κ < 1)
        cache[f"blocks.{layer}.attn.hook_v"] = values
    return cache


@pytest.fixture(scope="module")
def cache() -> dict[str, torch.Tensor]:
    return synthetic_cache()


@pytest.fixture(scope="module")
def result(cache):
    return tl_geometry.analyze_heads(cache, n_values=(1, 2, 4), random_samples=4, bounds=True)


def _widgets(view: views.View) -> list[views.Widget]:
    return [b for b in view.blocks if isinstance(b, views.Widget)]


def test_page_loads_bundle_once_and_references_no_network(cache, result):
    parts = [
        views.attention_view(cache, 0, [0, 3], n=2),
        views.contribution_view(cache, 1, 2),
        views.token_view(cache, 1, 1, tokens=[f"t{i}" for i in range(12)]),
        views.taxonomy_view(result),
        views.sink_view(result),
    ]
    page = views.page_html(parts)
    assert page.count("var CircuitsVis=") == 1  # the bundle, once
    assert "sourceMappingURL" not in page
    # No external resource: no src/href attribute, no ES import, no CSS url() with a scheme.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert not re.search(r"""import[^;]{0,200}["']https?://""", page)
    assert not re.search(r"url\(\s*['\"]?https?:", page)
    assert "/>" not in re.sub(r"<script>.*?</script>", "", page, flags=re.S)  # no self-closing div
    ids = re.findall(r'<div class="tlg-widget tlg-cv" id="([^"]+)"', page)
    assert len(ids) == len(set(ids)) == 3 == page.count("CircuitsVis.render(")
    assert page.count('class="tlg-widget') == sum(p.n_widgets for p in parts) == 6
    rest = page.replace(views.circuitsvis_bundle(), "")  # the bundle has "<script>" in a string
    assert rest.count("<script>") == rest.count("</script>") == 4


def test_repr_html_is_offline_and_bundles_only_when_needed(cache, result):
    with_widget = views.token_view(cache, 0, 0)._repr_html_()
    assert with_widget.count("var CircuitsVis=") == 1 and "unpkg" not in with_widget
    assert "CircuitsVis" not in views.taxonomy_view(result)._repr_html_()


def test_contribution_pattern_is_alpha_times_value_norm_of_the_kv_head(cache):
    heads = [1, 2]
    view = views.contribution_view(cache, 1, heads, batch=1)
    props = _widgets(view)[0].props
    mats = torch.tensor(props["attention"], dtype=torch.float64)
    assert props["attentionHeadNames"] == ["head 1 attention α", "head 1 contribution α‖v‖",
                                           "head 2 attention α", "head 2 contribution α‖v‖"]
    pattern = cache["blocks.1.attn.hook_pattern"][1].double()
    values = cache["blocks.1.attn.hook_v"][1].double()
    kv = kv_head_index(N_HEADS, N_KV)
    for i, h in enumerate(heads):
        norms = values[:, kv[h]].norm(dim=-1)  # [pos]: the KV head query head h reads
        expected = pattern[h] * norms
        expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(mats[2 * i], pattern[h], atol=1e-5, rtol=0)
        torch.testing.assert_close(mats[2 * i + 1], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(mats[2 * i + 1].sum(-1), torch.ones(12, dtype=torch.float64), atol=1e-4, rtol=0)


def test_top_n_keys_are_highlighted_with_ties_to_the_lower_index():
    cache = synthetic_cache(n_pos=8, batch=1)
    pattern = cache["blocks.0.attn.hook_pattern"].clone()
    pattern[0, 2, 6, :7] = torch.tensor([0.1, 0.2, 0.2, 0.2, 0.1, 0.1, 0.1])  # a three-way tie
    cache["blocks.0.attn.hook_pattern"] = pattern
    view = views.attention_view(cache, 0, 2, query=6, n=2)
    strip = next(b for b in view.blocks if isinstance(b, str) and "TopKeys" in b)
    top = re.findall(r'class="tlg-tok top[^"]*"[^>]*title="position (\d+)', strip)
    assert [int(p) for p in top] == [1, 2]
    expected = top_n_mask(pattern[0, 2, 6, :7], 2).nonzero().flatten().tolist()
    assert expected == [1, 2]


def test_long_sequences_are_cropped_with_a_visible_note():
    cache = synthetic_cache(n_pos=150, batch=1)
    tokens = [f"w{i}" for i in range(150)]
    view = views.attention_view(cache, 0, [0, 1], tokens=tokens, n=3, max_tokens=32)
    props = _widgets(view)[0].props
    assert len(props["tokens"]) == 33 and len(props["attention"][0]) == 33  # sink, gap, 31 positions
    # Rows and columns carry their position in the sequence, not their row in the crop.
    assert props["tokens"][:3] == ["0:w0", "1–118:cropped", "119:w119"] and props["tokens"][-1] == "149:w149"
    assert [int(t.split(":")[0]) for t in props["tokens"][2:]] == list(range(119, 150))
    (note,) = view.notes
    assert "labelled position:token" in note and "row k" not in note
    assert "tlg-note" in view.fragment() and "the 118 positions in between are cropped" in view.fragment()
    # The row of position p holds the attention of query p, over keys at their real positions.
    pattern = cache["blocks.0.attn.hook_pattern"][0, 0]
    row = props["tokens"].index("140:w140")
    assert props["attention"][0][row][props["tokens"].index("130:w130")] == pytest.approx(
        float(pattern[140, 130]), abs=1e-5)
    assert props["attention"][0][row][0] == pytest.approx(float(pattern[140, 0]), abs=1e-5)
    contribution = _widgets(views.contribution_view(cache, 0, 0, tokens=tokens, max_tokens=32))[0].props
    assert contribution["tokens"] == props["tokens"]
    query = views.attention_view(cache, 0, 0, tokens=tokens, n=2, query=99, max_tokens=32)
    assert _widgets(query)[0].props["tokens"][-1] == "99:w99"  # rows end at the query
    short = views.attention_view(synthetic_cache(n_pos=10, batch=1), 0, 0, n=2)
    assert not short.notes and len(_widgets(short)[0].props["tokens"]) == 10


def test_token_view_marks_the_sink_and_the_source_winner(cache):
    view = views.token_view(cache, 0, 3, query=9, n=3)
    props = _widgets(view)[0].props
    assert props["tokens"][0].startswith("⟦sink⟧") and len(props["values"]) == 10
    pattern, values = cache["blocks.0.attn.hook_pattern"][0, 3, 9, :10], cache["blocks.0.attn.hook_v"][0, :10, 1]
    contrib = pattern * values.norm(dim=-1)
    torch.testing.assert_close(torch.tensor(props["values"]), contrib, atol=1e-6, rtol=0)
    winner = int(contrib.argmax())
    vote = "current" if winner == 9 else "sink" if winner == 0 else "other"
    assert f"Source winner: position {winner}" in view.fragment() and f"<b>{vote}</b>" in view.fragment()


def test_taxonomy_and_sink_views_cover_every_head(result):
    grid = views.taxonomy_view(result).fragment()
    cells = re.findall(r'<td><div style="background:([^;]+);[^"]*" title="([^"]*)"', grid)
    assert len(cells) == N_LAYERS * N_HEADS
    for (color, title), label in zip(cells, [x for row in result.labels for x in row]):
        assert color == views.CLASS_COLORS[label] and f": {label}" in title and "votes current" in title
    assert "κ" in cells[0][1] and "F score of 2 keys: top" in cells[0][1]
    sink = views.sink_view(result).fragment()
    assert sink.count("<td><div") == 4 * N_LAYERS * N_HEADS
    # κ and c_sink are counted once per KV head (SPEC §4): 2 query heads share each here.
    assert f"Over the {N_LAYERS * N_KV} KV heads" in sink and "of KV heads have a smaller" in sink


def test_views_leave_the_cache_untouched(cache, result):
    before = {k: (v.clone(), v.data_ptr()) for k, v in cache.items()}
    views.attention_view(cache, 0, None, n=3)
    views.contribution_view(cache, 0, [0, 1, 2, 3])
    views.token_view(cache, 1, 0)
    for k, (value, ptr) in before.items():
        assert cache[k].data_ptr() == ptr and torch.equal(cache[k], value)


def test_script_breaking_tokens_are_escaped(cache):
    tokens = ["</script><b>"] + [f"t{i}" for i in range(11)]
    html = views.page_html([views.token_view(cache, 0, 0, tokens=tokens),
                            views.attention_view(cache, 0, 0, tokens=tokens, n=1)])
    rest = html.replace(views.circuitsvis_bundle(), "")
    assert rest.count("</script>") == rest.count("<script>") == 3
    assert "&lt;/script&gt;&lt;b&gt;" in html  # our own HTML escapes it


def test_html_comment_tokens_cannot_swallow_the_closing_script_tag(cache):
    # "<!--<script>" inside a script puts the HTML parser in the double-escaped state, where the
    # widget's own </script> would no longer end it: no raw "<" may reach the widget's JSON.
    tokens = ["<!--<script>"] + [f"t{i}" for i in range(11)]
    page = views.page_html([views.token_view(cache, 0, 0, tokens=tokens)])
    rest = page.replace(views.circuitsvis_bundle(), "")
    assert "<!--" not in rest and "\\u003c!--\\u003cscript>" in rest
    props = re.search(r"CircuitsVis\.ColoredTokens, (.*)\);</script>", rest).group(1)
    assert json.loads(props)["tokens"][0] == "⟦sink⟧<!--<script>"


def test_nan_kappa_is_grey_not_a_compressed_sink():
    from tl_geometry.views.sink import _log_ratio

    assert _log_ratio(float("nan"), 1.0) == "#ddd" and _log_ratio(0.25, 1.0) != "#ddd"


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda c: views.attention_view(c, 7, 0), CacheError, "missing"),
        (lambda c: views.attention_view(c, 0, 9), CacheError, "heads must be indices"),
        (lambda c: views.attention_view(c, 0, 0, batch=5), CacheError, "batch=5"),
        (lambda c: views.attention_view(c, 0, 0, query=40), ValueError, "query must be"),
        (lambda c: views.attention_view(c, 0, 0, query=3, n=5), ValueError, "n must be in 1..4"),
        (lambda c: views.attention_view(c, 0, 0, max_tokens=1), ValueError, "max_tokens"),
        (lambda c: views.token_view(c, 0, 0, tokens=["a", "b"]), ValueError, "2 tokens"),
        (lambda c: views.token_view(c, 0, 0, tokens=torch.zeros(12, dtype=torch.long)), ValueError, "model="),
        (lambda c: views.taxonomy_view(c), TypeError, "HeadAnalysis"),
        (lambda c: views.sink_view(None), TypeError, "HeadAnalysis"),
        (lambda c: views.f_curves_plot(None, by="head"), ValueError, "by must be"),
    ],
)
def test_bad_input_gets_a_clear_error(cache, call, error, match):
    with pytest.raises(error, match=match):
        call(cache)


def test_plots_are_figures_and_save_as_png_and_svg(result, tmp_path):
    by_class = views.f_curves_plot(result, by="class")
    by_layer = views.f_curves_plot(result, by="layer")
    assert isinstance(by_class, Figure) and isinstance(by_layer, Figure)
    assert len([ax for ax in by_layer.axes if ax.get_visible()]) == N_LAYERS
    labels = {line.get_label() for line in by_class.axes[3].get_lines()}
    assert {"top N keys", "N random keys", "top N, sink removed", "top N with the sink",
            "top N without the sink", "predicted envelope"} <= labels
    for fig, name in [(by_class, "f"), (views.sink_plot(result), "s"), (views.class_counts_plot(result), "c")]:
        png, svg = views.save_figure(fig, tmp_path / name)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and svg.read_text().lstrip().startswith("<?xml")
    dotted = views.save_figure(by_class, tmp_path / "l5.h3", formats=("png",))
    assert [p.name for p in dotted] == ["l5.h3.png"]  # a dot in the stem is not a suffix
    bars = views.class_counts_plot(result).axes[0].patches
    assert sum(p.get_height() for p in bars) == N_LAYERS * N_HEADS


def test_ablation_plot_reads_the_sparsification_table():
    import pandas as pd

    frame = pd.DataFrame({
        "ordering": ["random"] * 4 + ["taxonomy"] * 2, "seed": [0, 0, 1, 1, 0, 0],
        "retention": [1.0, 0.5, 1.0, 0.5, 1.0, 0.5], "loss": [3.0, 4.0, 3.0, 5.0, 3.0, 3.5],
    })
    fig = views.ablation_plot(frame)
    lines = {line.get_label(): line.get_ydata().tolist() for line in fig.axes[0].get_lines()}
    assert lines["random"] == [4.5, 3.0] and lines["taxonomy"] == [3.5, 3.0]
    assert len(fig.axes[0].collections) == 1  # the random band only
    with pytest.raises(ValueError, match="lacks columns"):
        views.ablation_plot(frame.drop(columns="loss"))


def test_plots_display_as_png_and_views_repr_briefly(cache, result):
    fig = views.f_curves_plot(result, by="class")
    assert isinstance(fig, views.PlotFigure) and fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    view = views.attention_view(cache, 0, [0, 3], n=2)
    # A notebook stores text/plain beside the HTML: the widget data must not be in it twice.
    assert repr(view) == ("View('Attention of layer 0, heads 0 and 3: the top 2 keys of query 11', "
                          "blocks=['AttentionHeads', 'html', 'html'])")
    assert views.contribution_view(cache, 1, 2).title == "Contribution-weighted attention of layer 1, head 2"


class _Events:
    def __init__(self):
        self.callbacks = []

    def register(self, event, callback):
        assert event == "pre_run_cell"
        self.callbacks.append(callback)

    def run_cell(self, cell_id, source):
        for callback in self.callbacks:
            callback(type("Info", (), {"cell_id": cell_id, "raw_cell": source})())


class _Shell:
    """What the views read of an IPython kernel shell: the request's cell id, the history."""

    def __init__(self):
        self.events, self.cell_id, self.sources = _Events(), None, [""]
        self.kernel = type("Kernel", (), {"get_parent": lambda _: {"metadata": {"cellId": self.cell_id}}})()
        self.history_manager = type("History", (), {"input_hist_raw": self.sources})()

    def run(self, cell_id, source, view):
        self.events.run_cell(cell_id, source)
        self.cell_id = cell_id
        self.sources.append(source)
        return view._repr_html_()


@pytest.fixture
def kernel(monkeypatch):
    import types

    from tl_geometry.views import _notebook

    shell = _Shell()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    monkeypatch.setattr(_notebook, "_TRACKER", _notebook._Tracker())
    return shell


@pytest.mark.parametrize("cell_ids", [True, False], ids=["cell ids", "sources only"])
def test_a_kernel_gets_the_bundle_once_and_again_when_its_cell_reruns(cache, result, kernel, cell_ids):
    view = views.token_view(cache, 0, 0)
    ids = iter(["a", "b", "c", "d", "e"]) if cell_ids else iter([None] * 5)
    bundles = lambda html: html.count("window.CircuitsVis=window.CircuitsVis||")  # noqa: E731

    first = kernel.run(next(ids), "views.token_view(cache, 0, 0)", view)
    assert bundles(first) == 1 and "tlgPending" in first
    second = kernel.run(next(ids), "views.token_view(cache, 0, 1)", view)
    assert bundles(second) == 0 and len(second) < len(first) - 1_000_000
    assert "CircuitsVis.render(" in second and "trust the notebook" in second  # waits for the bundle
    assert "CircuitsVis" not in kernel.run(next(ids), "views.taxonomy_view(result)", views.taxonomy_view(result))
    # The first cell runs again: its output, the bundle with it, is replaced, so it carries it anew.
    again = kernel.run("a" if cell_ids else None, "views.token_view(cache, 0, 0)", view)
    assert bundles(again) == 1
    assert bundles(kernel.run(next(ids), "views.token_view(cache, 1, 1)", view)) == 0
    views.reset_notebook_bundle()  # after clearing that output by hand
    assert bundles(kernel.run(next(ids), "views.token_view(cache, 1, 2)", view)) == 1


def test_outside_a_kernel_and_in_colab_every_output_carries_the_bundle(cache, kernel, monkeypatch):
    view = views.token_view(cache, 0, 0)
    monkeypatch.setitem(sys.modules, "google.colab", object())  # Colab: one frame per output
    assert all(kernel.run(None, f"cell {i}", view).count("var CircuitsVis=") == 1 for i in range(2))
    monkeypatch.delitem(sys.modules, "google.colab")
    monkeypatch.delitem(sys.modules, "IPython")
    html = view._repr_html_()
    assert html.count("var CircuitsVis=") == 1 and "tlgPending" not in html and "trust" not in html
