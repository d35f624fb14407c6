"""HeadAnalysis: selection by coordinate (``sel`` / ``label``), explicit accessors, ``top`` and
the text forms (issue 15, items 3, 4, 6)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from cases import make_case
from repo_paths import REPO
from result_fakes import fake

import tl_geometry
from tl_geometry.functional.regime import REGIME_FIELDS
from tl_geometry.functional.sink import SINK_FIELDS
from tl_geometry.functional.taxonomy import CLASSES
from tl_geometry.result import GROUPS, TRUNCATION_NAMES, HeadAnalysis, NoBoundsError
from tl_geometry.result import schema as _result_schema
from tl_geometry.result import select as _result_select


# --- sel / label ------------------------------------------------------------------------------
def test_sel_reads_by_layer_index_head_and_n_value_not_position():
    r = fake(layers=(3, 5), n_values=(2, 4, 8), bounds=True)
    quantities = r.quantities()
    assert "certified_f_score" in quantities and "regime_decay" in quantities
    for li, layer in enumerate(r.layers):
        for h in range(r.n_heads):
            for ni, n in enumerate(r.n_values.tolist()):
                s = r.sel(layer=layer, head=h, n=n)
                for key, (values, has_n) in quantities.items():
                    want = values[li, h, ni] if has_n else values[li, h]
                    # NaN == NaN here: the fake's 3 sequences give no label stability (SPEC §5)
                    same = torch.equal(s[key], want) or bool(s[key].isnan() & want.isnan())
                    assert s[key].ndim == 0 and same, (key, layer, h, n)
                assert s["label"] == r.labels[li][h] == r.label(layer, h)
    # the coded values make the position visible: layer 5 is position 1, N=4 is position 1
    assert float(r.sel(layer=5, head=3, n=4)["f_score"]) == 2 * 1e3 + 1 * 100 + 3 * 10 + 1 + 0.5


def test_sel_scalars_drop_their_axis_lists_keep_it_in_the_given_order():
    r = fake(layers=(3, 5, 7), n_heads=4, n_values=(2, 4, 8))
    f = r.f_score
    assert torch.equal(r.sel(n=4)["f_score"], f[:, :, 1])
    assert r.sel(n=4).dims == ("layer", "head")
    assert torch.equal(r.sel(layer=[7, 3], n=[8, 2])["f_score"], f[[2, 0]][:, :, [2, 0]])
    assert r.sel(layer=[7, 3], n=[8, 2]).dims == ("layer", "head", "n")
    assert torch.equal(r.sel(layer=5, head=[0, 3])["random_f_score"], r.random_f_score[1, [0, 3]])
    assert torch.equal(r.sel(head=(2,), n=8)["sink_in_recall"], r.metric("recall", "sink_in")[:, [2], 2])
    # quantities without an N axis ignore n; labels follow the same rules
    assert torch.equal(r.sel(n=2)["sink_norm_ratio"], r.sink_norm_ratio)
    assert r.sel(layer=[5], head=1)["label"] == [r.labels[1][1]]
    assert r.sel(layer=5)["label"] == r.labels[1]
    assert r.sel(head=2)["label"] == [row[2] for row in r.labels]
    assert r.sel(layer=torch.tensor(7), head=0, n=2).dims == ()
    assert r.sel(layer=5, head=[0, 3]).coords == {"layer": 5, "head": [0, 3], "n": [2, 4, 8]}


def test_sel_covers_every_per_head_quantity_and_only_existing_bounds():
    plain, bounded = fake(), fake(bounds=True)
    keys = set(plain.sel(layer=3, head=0, n=2))
    assert {"f_score", "random_f_score", "sink_removed_f_score", "sink_in_count", "f_gain",
            "sink_cosine", "vote_sink", "label"} <= keys
    assert not any(k.startswith(("certified", "regime")) for k in keys)
    more = set(bounded.sel(layer=3, head=0, n=2)) - keys
    assert more == {f"{k}_{m}" for k in ("inversion", "certified", "predicted", "shell", "shell_n")
                    for m in ("precision", "recall", "f_score", "separated")} | {
        "regime_norm_cv", "regime_kappa", "regime_a", "regime_decay", "regime_b", "regime_fit_mae"}
    s = plain.sel(layer=3, head=0, n=2)
    assert s.to_dict()["label"] == s["label"] and isinstance(s.to_dict()["f_score"], float)
    assert "layer=3" in repr(s) and "f_score" in repr(s)
    with pytest.raises(KeyError, match="f_score"):
        s["fscore"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"layer": 4}, r"layer=4 was not analysed; valid layer values: \[3, 5\]"),
    ({"layer": [3, 4]}, r"valid layer values: \[3, 5\]"),
    ({"head": 4}, r"valid head values: \[0, 1, 2, 3\]"),
    ({"n": 3}, r"N=3 was not analysed; valid n values: \[2, 4, 8\]"),
    ({"layer": True}, "not analysed"),
])
def test_sel_rejects_unknown_coordinates_listing_the_valid_ones(kwargs, message):
    r = fake()
    with pytest.raises(ValueError, match=message):
        r.sel(**kwargs)
    with pytest.raises(KeyError):  # also a KeyError, like a missing label in xarray / pandas
        r.sel(**kwargs)


def test_coordinates_must_be_ints():
    # (sel's annotations reject a float under the test suite's type checker; without it, this
    # is the message a user gets)
    with pytest.raises(ValueError, match=r"n=2\.0: give an int or a list of ints"):
        _result_select.positions("n", 2.0, [2, 4])
    assert _result_select.positions("n", (4, 2), [2, 4]) == [1, 0]


def test_label_by_model_layer_index_where_positional_indexing_fails():
    # the README's old example: layers=[3, 5] made result.labels[5][3] an IndexError
    c1, c2 = make_case(1, sink=True), make_case(2)
    result = tl_geometry.analyze_heads({**c1.cache(3), **c2.cache(5)}, layers=[3, 5],
                                       n_values=(2, 4), random_samples=2)
    with pytest.raises(IndexError):
        result.labels[5][3]
    assert result.label(5, 3) == result.labels[1][3] in CLASSES
    # with n_values=(2, 4), position 1 is F_4, not F_2: sel reads the N value
    assert torch.equal(result.sel(n=2)["f_score"], result.f_score[:, :, 0])
    assert torch.equal(result.sel(n=4)["f_score"], result.f_score[:, :, 1])
    with pytest.raises(ValueError, match=r"valid layer values: \[3, 5\]"):
        result.label(0, 3)


# --- explicit fields and accessors ----------------------------------------------------------------
#: The bound figures kept as shortcuts, per kind; every other one is read with ``bound()``.
_BOUND_SHORTCUTS = {"inversion": ("separated",), "certified": ("f_score",), "predicted": ("f_score",),
                    "shell": ("f_score", "separated"), "shell_n": ("f_score", "separated")}


def _schema_shortcuts() -> dict[str, tuple[str, ...]]:
    """The shortcuts the schema's names imply, each ``name → (accessor, *key)``: every top-N
    metric, every other group's F-score, the paired ratio and halved fraction, the 90th
    percentiles, every sink field and the bounds of ``_BOUND_SHORTCUTS``."""
    out: dict[str, tuple[str, ...]] = {m: ("metric", m) for m in _result_schema.METRIC_NAMES}
    out |= {f"{g}_f_score": ("metric", "f_score", g) for g in GROUPS if g != "top"}
    out |= {f"paired_sink_{f}": ("paired_sink", f) for f in _result_schema.PAIRED_FIELDS if f != "count"}
    out |= {f"p90_{m}": ("truncation_percentile", m) for m in TRUNCATION_NAMES}
    out |= {f"sink_{f}": ("sink_diagnostic", f) for f in SINK_FIELDS}
    out |= {f"{k}_{m}": ("bound", k, m) for k, metrics in _BOUND_SHORTCUTS.items() for m in metrics}
    return out


def _schema_slice_names() -> set[str]:
    """Every ``<group>_<metric>``, ``<kind>_<metric>``, ``regime_<field>``, ... name a slice
    could be given: the ones that are not shortcuts must not be attributes."""
    names = {m if g == "top" else f"{g}_{m}" for g in GROUPS for m in _result_schema.METRIC_NAMES}
    names |= {f"{k}_{m}" for k in _result_schema.BOUND_KINDS for m in _result_schema.BOUND_METRICS}
    names |= {f"regime_{f}" for f in REGIME_FIELDS} | {f"paired_sink_{f}" for f in _result_schema.PAIRED_FIELDS}
    return names | {f"sink_{f}" for f in SINK_FIELDS} | {f"p90_{m}" for m in TRUNCATION_NAMES}


def test_shortcuts_are_the_declared_class_attributes_the_schema_implies():
    from tl_geometry.result.shortcuts import DOCUMENTED, Shortcuts, _Slice

    # Declared one by one (type checkers see them), with no fallback lookup behind them.
    assert not hasattr(Shortcuts, "__getattr__") and not hasattr(HeadAnalysis, "__getattr__")
    assert "__dir__" not in vars(HeadAnalysis)
    assert set(_BOUND_SHORTCUTS) == set(_result_schema.BOUND_KINDS)  # a new kind decides its shortcuts
    declared = {name: value for name, value in vars(Shortcuts).items() if isinstance(value, _Slice)}
    assert tuple(declared) == DOCUMENTED
    assert {name: (s.accessor, *s.key) for name, s in declared.items()} == _schema_shortcuts()
    assert all(name in dir(fake()) for name in DOCUMENTED)


def test_each_shortcut_reads_the_same_tensor_as_its_accessor_call():
    r = fake(bounds=True)
    quantities = r.quantities()
    for name, (accessor, *key) in _schema_shortcuts().items():
        value = getattr(r, name)
        torch.testing.assert_close(value, getattr(r, accessor)(*key), equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(value, quantities[name][0], equal_nan=True, rtol=0, atol=0)  # sel()'s key
    assert torch.equal(r.count("sink_in"), r.group_counts[GROUPS.index("sink_in")])


def test_other_slice_names_are_plain_attribute_errors():
    """The slices without a shortcut (``sink_in_recall``, ``regime_kappa``, ...) are read with
    their accessor; as attributes they do not exist, without a warning."""
    r = fake(bounds=True)
    others = _schema_slice_names() - set(_schema_shortcuts())
    assert {"sink_in_recall", "sink_in_margin", "regime_kappa", "certified_precision"} <= others
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in sorted(others):
            assert not hasattr(HeadAnalysis, name), name
            with pytest.raises(AttributeError, match=rf"'HeadAnalysis' object has no attribute '{name}'"):
                getattr(r, name)
        with pytest.raises(AttributeError, match="no attribute 'f_scor'"):
            r.f_scor  # noqa: B018 - a typo is a plain AttributeError
    assert torch.equal(r.metric("recall", "sink_in"), r.scores[GROUPS.index("sink_in"), 1])
    assert torch.equal(r.regime_diagnostic("kappa"), r.regime[REGIME_FIELDS.index("kappa")])


@pytest.mark.parametrize(("call", "message"), [
    (lambda r: r.metric("f1"), "unknown metric 'f1'; valid: 'precision', 'recall', 'f_score'"),
    (lambda r: r.metric("f_score", group="permuted"), "valid: 'top', 'random', 'shuffled', 'sink_removed'"),
    (lambda r: r.count("all"), "unknown group 'all'"),
    (lambda r: r.sink_diagnostic("kappa"), "valid: 'mass', 'norm_ratio'"),
    (lambda r: r.bound("upper"), "valid: 'inversion', 'certified', 'predicted'"),
])
def test_accessors_name_the_valid_choices(call, message):
    with pytest.raises(ValueError, match=message):
        call(fake(bounds=True))


def test_missing_bounds_raise_one_error_that_is_both_attribute_and_value_error():
    r = fake()
    for call in (lambda: r.certified_f_score, lambda: r.bound("certified"), lambda: r.certified_fraction,
                 lambda: r.regime_diagnostic("decay"), lambda: r.best_n_agreement(), lambda: r.shell_n_f_score,
                 lambda: r.top(by="predicted_f_score")):
        with pytest.raises(NoBoundsError, match=r"bounds=True"):
            call()
    assert issubclass(NoBoundsError, AttributeError) and issubclass(NoBoundsError, ValueError)
    assert not hasattr(r, "certified_f_score")
    # A bound shortcut's own error reaches the caller, message and all (not "no attribute").
    for name in (n for n, (accessor, *_) in _schema_shortcuts().items() if accessor == "bound"):
        with pytest.raises(NoBoundsError, match=f"^{re.escape(_result_schema.NO_BOUNDS)}$"):
            getattr(r, name)
    assert list(r.best_n().columns) == ["layer", "head", "measured_best_n"]  # measured needs no bounds


def test_top_ranks_by_any_quantity_and_lists_the_valid_keys_on_a_wrong_one():
    r = fake(layers=(3, 5), n_values=(2, 4))
    best = r.top(3, by="sink_mass")
    assert list(zip(best["layer"], best["head"])) == [(5, 3), (5, 2), (5, 1)]  # coded: larger l, h first
    low = r.top(2, by="f_score", n=4, largest=False)
    assert list(zip(low["layer"], low["head"])) == [(3, 0), (3, 1)]
    assert low.f_score.tolist() == [r.f_score[0, 0, 1].item(), r.f_score[0, 1, 1].item()]
    assert r.top(1, by="vote_sink").vote_sink.item() == r.vote_fractions[..., 1].max().item()
    with pytest.raises(ValueError, match=r"top\(by='fscore'\): unknown key; valid: .*f_gain.*sink_norm_ratio"):
        r.top(by="fscore")
    with pytest.raises(ValueError, match=r"N=8 was not analysed; valid n values: \[2, 4\]"):
        r.top(by="f_gain", n=8)


def test_a_new_group_or_metric_is_one_tuple_entry(monkeypatch, tmp_path):
    from tl_geometry.result import head_analysis as result_module

    old = fake(n_values=(2, 4))
    path = old.save(tmp_path / "old.pt")
    groups = (*GROUPS, "permuted")
    metrics = (*_result_schema.METRIC_NAMES, "margin_cc")
    for module in (result_module, _result_schema):
        monkeypatch.setattr(module, "GROUPS", groups)
        monkeypatch.setattr(module, "METRIC_NAMES", metrics)
    new = fake(n_values=(2, 4))
    assert new.scores.shape[:2] == (len(groups), len(metrics))
    assert torch.equal(new.metric("margin_cc", group="permuted"), new.scores[-1, -1])
    assert "permuted_margin_cc" in new.sel(layer=3, head=0, n=2)
    assert set(new.to_pandas().group) >= {"permuted"} and "margin_cc" in new.to_pandas()
    assert torch.equal(HeadAnalysis.load(new.save(tmp_path / "new.pt")).scores, new.scores)
    with pytest.warns(UserWarning, match="filled"):  # a file from before: the new names are NaN
        loaded = HeadAnalysis.load(path)
    assert loaded.metric("f_score", group="permuted").isnan().all()
    assert loaded.metric("margin_cc").isnan().all() and (loaded.count("permuted") == 0).all()
    assert torch.equal(loaded.metric("recall", group="sink_in"), old.metric("recall", group="sink_in"))


def test_constructor_checks_shapes_against_the_names():
    r = fake()
    fields = dict(vars(r))
    fields["scores"] = r.scores[:4]  # one group short, and group_counts agrees: a shape mismatch
    fields["group_counts"] = r.group_counts[:4]
    with pytest.raises(ValueError, match=r"scores has shape \[4, 9, 2, 4, 3\]; expected \[group=6"):
        HeadAnalysis(**fields)
    with pytest.raises(ValueError, match="distinct"):
        HeadAnalysis(**{**vars(r), "layers": (3, 3)})


# --- text --------------------------------------------------------------------------------------------
def _head_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:5].strip().isdigit()]


def test_summary_top_k_legend_and_unknown_model():
    r = fake(layers=(3, 5), n_heads=4, n_values=(2, 4))
    text = r.summary(top=3)
    rows = _head_rows(text)
    assert len(rows) == 3 and "Top 3 of 8 heads by F_2 gain" in text
    gain = r.f_gain[..., 0]
    ranked = [tuple(map(int, row.split()[:2])) for row in rows]
    values = [float(gain[r.layers.index(layer), h]) for layer, h in ranked]
    assert values == sorted(values, reverse=True)
    assert len(_head_rows(r.summary(top=None))) == 8
    assert "Legend: Classes" in text and "cur/sink/oth = fractions" in text
    assert "κ = ‖v_sink‖" in text and "cos = mean signed" in text
    assert "docs/reading.md" in text
    assert "model None" not in text and "model unknown (pass model=" in text
    assert "run settings not recorded" in text  # a hand-built result has no run metadata
    # Means of F in [0, 1] (the fake's coded values have five digits) fit in 100 columns.
    unit = HeadAnalysis(**{**vars(r), "scores": r.scores / 1e5}).summary(top=3)
    assert all(len(line) <= 100 for line in unit.splitlines() if line.startswith("Legend") or
               not line[:5].strip().isdigit())
    named = fake(metadata={"model_name": "SmolLM2-135M", "n_sequences": 8, "n_positions": 128,
                           "queries": "last", "distance": "euclidean", "space": "value"})
    text = named.summary(top=2)
    assert "model SmolLM2-135M" in text and "8 sequences × 128 positions, queries=last" in text


def test_repr_is_one_short_line():
    r = fake(layers=tuple(range(30)), n_heads=9, n_values=(1, 2, 4, 8),
             metadata={"model_name": "SmolLM2-135M"})
    text = repr(r)
    assert "\n" not in text and len(text) < 160
    assert text.startswith("HeadAnalysis(model='SmolLM2-135M', layers=30 (0..29), heads=9")
    counts = r.class_counts().sum()
    assert all(f"{c}={int(counts[c])}" in text for c in CLASSES) and "bounds=False" in text
    assert "layers=2 (3, 5)" in repr(fake())


@pytest.mark.filterwarnings("ignore:N = .* cannot be evaluated")
def test_readme_in_python_examples_run(tmp_path, monkeypatch):

    readme = (REPO / "README.md").read_text()
    section = readme.split("## In Python", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    lines = [line.split("  #")[0].strip() for line in code.splitlines()
             if line.startswith(("result", "head", "df =", "print(result", "bounded"))]
    assert any("result.label(5, 3)" in line for line in lines)
    assert not any("labels[" in line or "[:, :, 1]" in line for line in lines)  # positional
    cases = [make_case(seed, n_pos=20, n_heads=4) for seed in range(6)]
    cache = {k: v for layer, c in enumerate(cases) for k, v in c.cache(layer).items()}
    namespace = {"tl_geometry": tl_geometry, "cache": cache, "model": None,
                 "result": tl_geometry.analyze_heads(cache, random_samples=2)}
    monkeypatch.chdir(tmp_path)
    for line in lines:
        exec(line, namespace)  # the README's own lines, checked to run
    assert namespace["head"]["label"] == namespace["result"].label(5, 3)
    assert (tmp_path / "run.pt").is_file()


def test_notebooks_show_the_summary_as_a_table_with_coloured_labels():
    from tl_geometry.result.text import CLASS_COLORS

    r = fake()
    page = r._repr_html_()
    assert page.startswith("<div>") and "<table>" in page and "HeadAnalysis(" in page
    n_rows = page.count("<tr>") - 1  # minus the header row
    assert n_rows == min(10, r.n_layers * r.n_heads)
    shown = r.top(n_rows, by="f_gain", n=2)
    for label in set(shown["label"].dropna()):
        assert f'background:{CLASS_COLORS[label]}' in page


def test_top_says_when_a_tie_decides_who_is_listed():
    r = fake()
    tied = HeadAnalysis(**{**vars(r), "sink": r.sink.clone()})
    tied.sink[:] = 1.0  # every head the same κ: layer, head order alone decides
    with pytest.warns(UserWarning, match=r"top\(2, by='sink_norm_ratio'\): \d+ heads share the value 1"):
        tied.top(2, by="sink_norm_ratio")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every head listed: nothing left out by order
        tied.top(r.n_layers * r.n_heads, by="sink_norm_ratio")
