"""Notebooks: the demos execute top to bottom (small sizes), so they never rot, and their outputs
stay clean; a tiny notebook executed by nbclient shows plots as images and loads circuitsvis's
script once, and its saved outputs render in a real browser in any order."""

from __future__ import annotations

import functools
import re
import tempfile
from pathlib import Path

import pytest
from repo_paths import REPO

DEMOS = REPO / "demos"
NOTEBOOKS = sorted(DEMOS.glob("*.ipynb"))
BUNDLE = "window.CircuitsVis=window.CircuitsVis||"  # the script's loader in a notebook output


def _outputs(nb) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def _html(output) -> str:
    return output.get("data", {}).get("text/html", "")


def _text_only_figures(outputs) -> list:
    """Outputs that show a figure as ``<Figure size ...>`` text instead of an image."""
    return [o for o in outputs if set(o.get("data", {})) == {"text/plain"}
            and re.match(r"<\w*Figure size", o["data"]["text/plain"])]


def test_the_three_demo_notebooks_exist_without_stored_outputs():
    import nbformat

    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "sink_study", "ablation_study"}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), path.name


@functools.cache
def _executed_demo(path: Path):
    """The demo notebook executed by nbclient at small sizes (once per session)."""
    import os

    import nbformat
    from nbclient import NotebookClient

    env = {"TL_GEOMETRY_NB_SMALL": "1", "HF_HUB_OFFLINE": "1"}  # the kernel inherits them
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        nb = nbformat.read(path, as_version=4)
        work = tempfile.mkdtemp(prefix=f"nb-{path.stem}-")
        client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": work}})
        client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return nb


@pytest.mark.real_model
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path):
    import nbformat

    nb = _executed_demo(path)
    outputs = _outputs(nb)
    assert not [o for o in outputs if o.output_type == "error"]
    widgets = [o for o in outputs if "tlg-widget" in _html(o)]
    assert widgets or "ablation" in path.stem
    # circuitsvis's 1.3 MB script: in the first output that needs it, and in no other.
    carriers = [i for i, o in enumerate(outputs) if "var CircuitsVis=" in _html(o)]
    needing = [i for i, o in enumerate(outputs) if "CircuitsVis.render(" in _html(o)]
    assert carriers == needing[:1] and all(BUNDLE in _html(outputs[i]) for i in carriers)
    assert not _text_only_figures(outputs)
    size = len(nbformat.writes(nb).encode())
    assert size < 2_500_000, f"{path.name} executed is {size} bytes"  # one bundle and small data


@pytest.mark.real_model
def test_notebook_outputs_have_no_progress_noise():
    stderr = "".join(o.get("text", "") for o in _outputs(_executed_demo(DEMOS / "quickstart.ipynb"))
                     if o.get("name") == "stderr")
    assert "IProgress" not in stderr and "de-quantizing" not in stderr


TINY = [
    """import torch
from tl_geometry import analyze_heads, views

g = torch.Generator().manual_seed(0)
causal = torch.ones(12, 12, dtype=torch.bool).tril()
cache = {}
for layer in range(2):
    scores = torch.randn(1, 4, 12, 12, generator=g).masked_fill(~causal, -torch.inf)
    cache[f"blocks.{layer}.attn.hook_pattern"] = scores.softmax(-1)
    cache[f"blocks.{layer}.attn.hook_v"] = torch.randn(1, 12, 2, 5, generator=g)
result = analyze_heads(cache, n_values=(1, 2, 4), random_samples=2)""",
    'views.f_curves_plot(result, by="class")',  # 1: no pyplot anywhere yet
    "views.token_view(cache, 0, 0)",  # 2: carries the script
    "views.attention_view(cache, 1, [0, 1], n=2)",  # 3: waits for it
    # 4: pyplot's inline backend on (its figure formatter registered), its own figure closed
    "import matplotlib.pyplot as plt\nplt.close(plt.figure())\nviews.sink_plot(result)",
    "views.contribution_view(cache, 0, 2)",  # 5: waits for it
]


@pytest.fixture(scope="module")
def tiny_notebook(tmp_path_factory):
    """``TINY`` executed by nbclient, then cell 2 (the script's carrier) run again; and cell 2
    as it was after the first run."""
    import copy

    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in TINY])
    path = tmp_path_factory.mktemp("tiny")
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path)}})
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        first = copy.deepcopy(nb.cells[2])
        client.execute_cell(nb.cells[2], 2)
    return nb, first


def test_a_returned_figure_displays_as_one_image_in_an_executed_notebook(tiny_notebook):
    nb, _ = tiny_notebook
    assert not [o for o in _outputs(nb) if o.output_type == "error"]
    for index in (1, 4):  # without pyplot, and with pyplot's inline backend active
        shown = [o for o in nb.cells[index].outputs if o.output_type in ("execute_result", "display_data")]
        assert [o.output_type for o in shown] == ["execute_result"], nb.cells[index].outputs
        assert "image/png" in shown[0]["data"] and not _text_only_figures(shown)


def test_an_executed_notebook_loads_the_script_once(tiny_notebook):
    nb, first = tiny_notebook
    html = {i: _html(o) for i, c in enumerate(nb.cells) for o in c.outputs if _html(o)}
    assert _html(first.outputs[0]).count(BUNDLE) == 1 and "var CircuitsVis=" in _html(first.outputs[0])
    assert all("CircuitsVis.render(" in html[i] and "var CircuitsVis=" not in html[i] for i in (3, 5))
    assert len(html[3]) < 200_000 and len(html[5]) < 200_000
    # Running the carrier's cell again replaces its output: the new one carries the script.
    assert html[2].count(BUNDLE) == 1 and "CircuitsVis.render(" in html[2]


@pytest.mark.parametrize("order", ["document", "reversed"])
def test_saved_notebook_outputs_render_offline_in_chromium(tiny_notebook, order, tmp_path):
    """The outputs as a frontend shows a reopened notebook: each output's HTML in turn, in
    document order or with the script's carrier drawn last. Every widget renders."""
    from test_browser import _browse, _Widgets

    nb, _ = tiny_notebook
    parts = [_html(o) for c in nb.cells for o in c.outputs if _html(o)]
    if order == "reversed":
        parts.reverse()
    page = tmp_path / "outputs.html"
    page.write_text('<!DOCTYPE html><html><head><meta charset="utf-8"></head><body>'
                    + "".join(parts) + "</body></html>", encoding="utf-8")
    dom = _browse(_chromium(), page, tmp_path, "--dump-dom").stdout
    widgets = _Widgets()
    widgets.feed(dom)
    assert sorted(widgets.kinds) == ["AttentionHeads", "AttentionHeads", "ColoredTokens", "TopKeys"]
    assert all(n > 0 for n in widgets.children), list(zip(widgets.kinds, widgets.children))
    assert "trust the notebook" not in dom  # circuitsvis replaced every waiting note


def _chromium() -> str:
    import os
    import shutil

    from test_browser import CHROMIUM

    if not Path(CHROMIUM).is_file():
        if os.environ.get("CI"):
            pytest.fail("chromium is missing on CI: scripts/dev.sh's system_deps should install it.")
        pytest.skip("chromium not installed (apt-get install chromium)")
    return shutil.which("chromium") or CHROMIUM
