"""The demo notebooks execute top to bottom (small sizes), so they never rot."""

from __future__ import annotations

from pathlib import Path

import pytest

DEMOS = Path(__file__).resolve().parent.parent / "demos"
NOTEBOOKS = sorted(DEMOS.glob("*.ipynb"))


def test_the_three_demo_notebooks_exist_without_stored_outputs():
    import nbformat

    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "sink_study", "ablation_study"}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), path.name


@pytest.mark.real_model
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("TL_GEOMETRY_NB_SMALL", "1")  # read by the notebooks; the kernel inherits it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = [o for o in outputs if "text/html" in o.get("data", {})]
    assert any("tlg-widget" in o["data"]["text/html"] for o in html) or "ablation" in path.stem
