"""The ablation plots display once in a notebook, and plain Hugging Face tensors become the
dict that analyze_heads reads (``tl_geometry.inputs.from_hf``)."""

from __future__ import annotations

import re

import pytest
import torch
from repo_paths import REPO, TESTS
from shared_checks import own_model_snippet

import tl_geometry
from tl_geometry import CacheError
from tl_geometry.ablation import HeadSensitivity, SparsificationCurve
from tl_geometry.ablation.sparsification import COLUMNS
from tl_geometry.inputs import from_hf
from tl_geometry.views import PlotFigure

DOCS = REPO / "docs"


# --- the ablation plots ---------------------------------------------------------------------------
SMALL_ABLATION = """
import math
import torch
from tl_geometry.ablation import HeadSensitivity, SparsificationCurve
from tl_geometry.ablation.sparsification import COLUMNS


def small_sensitivity():
    '''3 layers × 4 heads on 5 windows; head (1, 2) costs a nat on every window: critical.'''
    g = torch.Generator().manual_seed(0)
    window_loss = 3.0 + 0.1 * torch.rand(3, 4, 5, generator=g, dtype=torch.float64)
    window_loss[1, 2] += 1.0
    weight = torch.full((5,), 10.0, dtype=torch.float64)
    loss = (window_loss * weight).sum(-1) / weight.sum()
    return HeadSensitivity(3.0, loss, "zero", {}, window_loss, torch.full((5,), 3.0, dtype=torch.float64), weight)


def small_curve():
    '''One deterministic order and a random one with two seeds, at retention 1 and 0.5.'''
    rows = []
    for ordering, seed, loss in (("taxonomy", None, 3.4), ("random", 0, 3.9), ("random", 1, 4.3)):
        for retention, n_removed, value in ((1.0, 0, 3.0), (0.5, 6, loss)):
            row = {"ordering": ordering, "seed": seed, "retention": retention, "n_removed": n_removed,
                   "loss": value, "perplexity": math.exp(value), "loss_increase": value - 3.0,
                   "loss_increase_se": 0.1}
            rows.append({k: row[k] for k in COLUMNS})
    return SparsificationCurve(rows, 3.0, "zero")
"""


def _small() -> dict:
    namespace: dict = {}
    exec(SMALL_ABLATION, namespace)  # the objects the notebook below builds, here in-process
    return namespace


def test_the_small_objects_are_what_the_notebook_plots():
    small = _small()
    sens, curve = small["small_sensitivity"](), small["small_curve"]()
    assert isinstance(sens, HeadSensitivity) and isinstance(curve, SparsificationCurve)
    assert sens.critical() == [(1, 2)] and sens.n_windows == 5
    assert list(curve.to_pandas().columns) == list(COLUMNS)


def test_ablation_plots_are_plot_figures_pyplot_never_sees():
    import matplotlib.pyplot as plt

    small = _small()
    sens, curve = small["small_sensitivity"](), small["small_curve"]()
    before = plt.get_fignums()
    heat, lines = sens.plot(), curve.plot()
    assert plt.get_fignums() == before  # no pyplot figure manager: nothing for inline to show again
    for fig in (heat, lines):
        assert isinstance(fig, PlotFigure) and fig._repr_png_()[:4] == b"\x89PNG"
    ax = heat.axes[0]
    assert ax.get_xlabel() == "head" and [(p.get_x(), p.get_y()) for p in ax.patches] == [(1.5, 0.5)]
    assert {line.get_label() for line in lines.axes[0].get_lines()} >= {
        "taxonomy", "random (mean ± std, 2 seeds)", "unablated"}
    # Into the caller's axes: drawn there, those axes returned, no figure made.
    fig = PlotFigure()
    left, right = fig.subplots(1, 2)
    assert sens.plot(ax=left) is left and curve.plot(ax=right) is right
    assert plt.get_fignums() == before and fig.axes[:2] == [left, right]
    assert left.get_title().startswith("Δ loss") and right.get_xlabel().startswith("retention")


NOTEBOOK = [
    f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n" + SMALL_ABLATION
    + "\nsens, curve = small_sensitivity(), small_curve()",
    "sens.plot()",  # 1
    "curve.plot()",  # 2
    # 3, 4: pyplot's inline backend active (its figure formatter registered), its own figure closed
    "import matplotlib.pyplot as plt\nplt.close(plt.figure())\nsens.plot()",
    "curve.plot()",
    "from result_fakes import fake\nfake()",  # 5: a HeadAnalysis
    # 6-8: into the axes of a pyplot figure, the way matplotlib's own examples draw
    "fig, ax = plt.subplots()\nsens.plot(ax=ax)",
    "fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))\nsens.plot(ax=left)\ncurve.plot(ax=right)",
    "from tl_geometry.capacity import RetrievalCapacity\n"
    "cap = RetrievalCapacity((1, 2, 4), torch.tensor([4.0, 3.5, 3.05]), 3.0)\n"
    "fig, ax = plt.subplots()\ncap.plot(ax=ax)",
]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in NOTEBOOK])
    path = tmp_path_factory.mktemp("ablation-plots")
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path)}}).execute()
    return nb


def _shown(cell) -> list:
    return [o for o in cell.outputs if o.output_type in ("execute_result", "display_data")]


@pytest.mark.parametrize("index", [1, 2, 3, 4])
def test_an_ablation_plot_shows_one_image_in_a_notebook(executed, index):
    cell = executed.cells[index]
    assert not [o for o in cell.outputs if o.output_type == "error"], cell.outputs
    images = [o for o in _shown(cell) if "image/png" in o.get("data", {})]
    assert len(images) == 1 and len(_shown(cell)) == 1, [o.output_type for o in cell.outputs]
    assert not re.search(r"<\w*Figure size", "".join(o.get("text", "") for o in cell.outputs))


@pytest.mark.parametrize("index", [6, 7, 8])
def test_a_plot_into_a_pyplot_axes_shows_that_figure_once_in_a_notebook(executed, index):
    """``plot(ax=ax)`` draws into the caller's figure and returns ``ax``: pyplot's inline backend
    shows that figure once at the end of the cell; the returned value is no second image."""
    cell = executed.cells[index]
    assert not [o for o in cell.outputs if o.output_type == "error"], cell.outputs
    images = [o for o in _shown(cell) if "image/png" in o.get("data", {})]
    assert len(images) == 1, [(o.output_type, sorted(o.get("data", {}))) for o in cell.outputs]
    (result,) = [o for o in cell.outputs if o.output_type == "execute_result"]
    assert result["data"]["text/plain"].startswith("<Axes")


def test_a_head_analysis_shows_an_html_table_in_a_notebook(executed):
    (shown,) = _shown(executed.cells[5])
    assert "<table" in shown["data"]["text/html"]


# --- from_hf: Hugging Face attentions and value states --------------------------------------------
def _hf_like(n_layers=3, batch=2, n_heads=4, n_kv=2, n_pos=7, d_head=5, seed=0):
    """What a HF forward gives: attentions [batch, head, q, k], values [batch, kv_head, pos, d]."""
    g = torch.Generator().manual_seed(seed)
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    attentions = tuple(torch.randn(batch, n_heads, n_pos, n_pos, generator=g).masked_fill(~causal, -torch.inf)
                       .softmax(-1) for _ in range(n_layers))
    values = tuple(torch.randn(batch, n_kv, n_pos, d_head, generator=g) for _ in range(n_layers))
    return attentions, values


def test_from_hf_names_each_layer_and_only_views_the_values():
    attentions, values = _hf_like()
    cache = from_hf(attentions, values)
    assert list(cache) == [f"blocks.{l}.attn.hook_{k}" for l in range(3) for k in ("pattern", "v")]
    for layer in range(3):
        pattern, v = cache[f"blocks.{layer}.attn.hook_pattern"], cache[f"blocks.{layer}.attn.hook_v"]
        assert pattern is attentions[layer]
        assert v.shape == (2, 7, 2, 5) and torch.equal(v, values[layer].transpose(1, 2))
        assert v.data_ptr() == values[layer].data_ptr() and v._base is values[layer]  # a view, no copy
    copied = {k: v.contiguous() for k, v in cache.items()}
    a = tl_geometry.analyze_heads(cache, n_values=(2, 4), random_samples=2)
    b = tl_geometry.analyze_heads(copied, n_values=(2, 4), random_samples=2)
    assert torch.equal(a.scores.nan_to_num(-9), b.scores.nan_to_num(-9)) and a.labels == b.labels


def test_from_hf_layers_name_a_subset():
    attentions, values = _hf_like(n_layers=2)
    cache = from_hf(list(attentions), list(values), layers=[3, 5])
    assert sorted(cache) == ["blocks.3.attn.hook_pattern", "blocks.3.attn.hook_v",
                             "blocks.5.attn.hook_pattern", "blocks.5.attn.hook_v"]
    assert cache["blocks.5.attn.hook_pattern"] is attentions[1]
    assert tl_geometry.analyze_heads(cache, n_values=(2,), random_samples=2).layers == (3, 5)


def _replace(seq, i, value):
    return tuple(value if j == i else x for j, x in enumerate(seq))


class _CacheLike:
    layers = ()


@pytest.mark.parametrize("case, match", [
    ("fewer values", r"3 attention tensors and 2 value tensors"),
    ("layers length", r"layers lists 2 layer\(s\) for 3 attention tensors"),
    ("layers repeat", r"layers has duplicates"),
    ("empty", r"attentions is empty.*output_attentions=True"),
    ("one tensor", r"attentions is one tensor .*one tensor per layer"),
    ("cache object", r"values is a _CacheLike.*past_key_values\.layers"),
    ("sdpa", r"attentions\[1\] is None.*attn_implementation=\"eager\""),
    ("3-d pattern", r"attentions\[0\] has shape \(4, 7, 7\).*unsqueeze\(0\)"),
    ("with a kv cache", r"attentions\[0\] has 1 queries and 7 keys.*one forward"),
    ("merged heads", r"values\[2\] has shape \(2, 7, 10\), heads merged.*unflatten"),
    ("swapped", r"values\[0\] has shape \(2, 7, 2, 5\).*looks like \[batch, pos, kv_head, d_head\].*transpose"),
    ("short values", r"values\[0\] has shape \(2, 2, 4, 5\).*pos = 7.*sliding-window"),
    ("batch", r"values\[0\] has batch 1 and attentions\[0\] has batch 2"),
    ("kv heads", r"4 heads and values\[0\] has 3 KV heads"),
    ("legacy pairs", r"values\[0\] must be a torch tensor, got tuple.*tuple\(v for k, v in past_key_values\)"),
])
def test_from_hf_errors_name_the_fix(case, match):
    attentions, values = _hf_like()
    args: dict = {"attentions": attentions, "values": values}
    if case == "fewer values":
        args["values"] = values[:2]
    elif case == "layers length":
        args["layers"] = [0, 1]
    elif case == "layers repeat":
        args["layers"] = [0, 1, 1]
    elif case == "empty":
        args = {"attentions": (), "values": ()}
    elif case == "one tensor":
        args["attentions"] = attentions[0]
    elif case == "cache object":
        args["values"] = _CacheLike()
    elif case == "sdpa":
        args["attentions"] = _replace(attentions, 1, None)
    elif case == "3-d pattern":
        args["attentions"] = _replace(attentions, 0, attentions[0][0])
    elif case == "with a kv cache":
        args["attentions"] = _replace(attentions, 0, attentions[0][:, :, -1:])
    elif case == "merged heads":
        args["values"] = _replace(values, 2, values[2].transpose(1, 2).flatten(2))
    elif case == "swapped":
        args["values"] = _replace(values, 0, values[0].transpose(1, 2))
    elif case == "short values":
        args["values"] = _replace(values, 0, values[0][:, :, -4:])
    elif case == "batch":
        args["values"] = _replace(values, 0, values[0][:1])
    elif case == "kv heads":
        args["values"] = _replace(values, 0, torch.zeros(2, 3, 7, 5))
    elif case == "legacy pairs":
        args["values"] = tuple((v, v) for v in values)
    with pytest.raises(CacheError, match=match):
        from_hf(**args)


# --- from_hf on the real SmolLM2 ------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_hf():
    """SmolLM2 as a plain transformers model: the session's bridge replaces the attention modules
    of its own, whose Hugging Face forward then returns no attentions."""
    from tl_geometry.inputs.models import load_hf_model

    model, _ = load_hf_model("smollm2-135m")
    return model


@pytest.mark.real_model
@pytest.mark.filterwarnings("ignore:N = .* cannot be evaluated:UserWarning")  # the snippet's default N
def test_from_hf_on_smollm2_gives_the_bridge_cache(plain_hf, smollm2):
    """docs/own_model.md's snippet, run as written: the past_key_values values and the
    output_attentions patterns are the tensors the bridge caches, and the analyses agree."""
    namespace = {"hf": plain_hf, "tokens": smollm2.tokens}
    exec(own_model_snippet("Plain Hugging Face or nnsight tensors"), namespace)
    cache = namespace["cache"]
    assert len(cache) == 2 * 30
    for name, tensor in cache.items():
        want = smollm2.cache[name]
        assert tensor.shape == want.shape, name
        # Two forwards computed apart (Hugging Face's and the bridge's kernels) agree to round-off,
        # which grows over 30 layers and with the threads the kernels split over: 1.2e-5 seen in
        # layer 21's values. A head out of place would be off by O(1).
        torch.testing.assert_close(tensor, want, rtol=1e-4, atol=1e-4)
    assert not cache["blocks.0.attn.hook_v"].is_contiguous()  # the cache's own storage, permuted
    layers = [0, 15, 29]
    ours = tl_geometry.analyze_heads(cache, n_values=(2, 4), layers=layers, random_samples=2)
    bridge = tl_geometry.analyze_heads(smollm2.cache, n_values=(2, 4), layers=layers, random_samples=2)
    assert ours.f_score.shape == bridge.f_score.shape == (3, 9, 2)
    torch.testing.assert_close(ours.f_score, bridge.f_score, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert ours.labels == bridge.labels
    assert namespace["result"].layers == tuple(range(30))


@pytest.mark.real_model
def test_from_hf_with_v_proj_hooks_on_some_layers(plain_hf, smollm2):
    """The nnsight recipe's transform, with forward hooks: v_proj's output of layers 3 and 5
    split into heads, under their own indices."""
    n_kv = plain_hf.config.num_key_value_heads
    saved: dict[int, torch.Tensor] = {}
    handles = [plain_hf.model.layers[layer].self_attn.v_proj.register_forward_hook(
        lambda module, inputs, output, layer=layer: saved.__setitem__(layer, output)) for layer in (3, 5)]
    try:
        with torch.no_grad():
            out = plain_hf(smollm2.tokens, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    values = [saved[layer].unflatten(-1, (n_kv, -1)).transpose(1, 2) for layer in (3, 5)]
    cache = from_hf([out.attentions[3], out.attentions[5]], values, layers=[3, 5])
    for name in ("blocks.3.attn.hook_v", "blocks.5.attn.hook_v", "blocks.5.attn.hook_pattern"):
        torch.testing.assert_close(cache[name], smollm2.cache[name], rtol=1e-4, atol=1e-4)  # round-off
    assert tl_geometry.analyze_heads(cache, n_values=(2,), random_samples=2).layers == (3, 5)


@pytest.mark.real_model
def test_a_bridged_models_hf_forward_returns_no_attentions_and_from_hf_says_so(smollm2):
    with torch.no_grad():
        out = smollm2.model.original_model(smollm2.tokens[:1, :8], output_attentions=True, use_cache=True)
    if out.attentions:  # a TransformerLens release that keeps HF's attention modules
        pytest.skip("this bridge's HF forward returns attentions")
    with pytest.raises(CacheError, match=r"attentions is empty.*run_with_cache"):
        from_hf(out.attentions, ())
