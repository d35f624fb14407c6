"""Inputs the uncertainty statistics must refuse, and the study's per-window side files.

* SPEC §7's critical rule: a NaN, negative or infinite threshold is refused the same way by every
  entry point (the functional ``criticality`` / ``critical_mask``, ``HeadSensitivity``'s methods
  and ``critical_heads``).
* ``window_mean``, ``paired_window_se`` and ``CapacityCorrelation.rho_over``: weights that are
  not prediction counts, and resamples that are not 1-D integer indices in range, give a
  ``ValueError`` naming the fix, never a number or an error from inside torch.
* ``*.windows.pt``: every side file is tied to its result by a checksum; a changed byte, a
  truncated file, another run's file or a file of another kind is refused with a message that
  says how to regenerate it, and a side file written before checksums loads with a warning.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from repo_paths import REPO

sys.path.insert(0, str(REPO / "demos"))

from _reproduce import ablation, capacity, saved

from tl_geometry.ablation import HeadSensitivity, critical_heads
from tl_geometry.capacity.geometry import CapacityCorrelation
from tl_geometry.functional.uncertainty import (
    critical_mask,
    criticality,
    paired_window_se,
    window_mean,
)

DOCS = REPO / "docs" / "results"
REGENERATE = r"Delete .* re-run demos/reproduce\.py with the same options and --reuse"


# --- SPEC §7's thresholds -------------------------------------------------------------------


def _sensitivity() -> HeadSensitivity:
    """A 1 × 2 sweep on 4 windows: head 0 raises every window's loss by about 1 nat."""
    base = torch.full((4,), 3.0, dtype=torch.float64)
    window_loss = torch.stack([base + torch.tensor([0.9, 1.1, 1.0, 1.0], dtype=torch.float64),
                               base + torch.tensor([0.01, -0.01, 0.0, 0.0], dtype=torch.float64)])[None]
    return HeadSensitivity(3.0, window_loss.mean(-1), "zero", {}, window_loss, base,
                           torch.full((4,), 10.0, dtype=torch.float64))


def _entry_points(name: str, value: float) -> dict[str, object]:
    """Each critical-rule entry point called with threshold ``name`` = ``value``."""
    sens, low, high = _sensitivity(), torch.tensor([0.3, 0.0]), torch.tensor([0.5, 0.05])
    return {
        "criticality": lambda: criticality(low, high, 4.0, **{name: value}),
        "critical_mask": lambda: critical_mask(low, 4.0, **{name: value}),
        "HeadSensitivity.criticality": lambda: sens.criticality(**{name: value}),
        "HeadSensitivity.critical_mask": lambda: sens.critical_mask(**{name: value}),
        "critical_heads": lambda: critical_heads(sens, **{name: value}),
    }


@pytest.mark.parametrize("name", ["min_nats", "min_fraction"])
@pytest.mark.parametrize("value", [math.nan, -1.0, math.inf, -math.inf])
def test_every_critical_entry_point_refuses_a_threshold_that_is_not_finite_and_non_negative(name, value):
    messages = set()
    words = rf"{name} must be a number ≥ 0.*got {value!r}.*Pass e\.g\. {name}="
    for call in _entry_points(name, value).values():
        with pytest.raises(ValueError, match=words) as err:
            call()  # type: ignore[operator]
        messages.add(str(err.value))
    assert len(messages) == 1  # one shared check: the same words everywhere


def test_sensitivity_entry_points_refuse_an_integer_negative_threshold_too():
    sens = _sensitivity()
    for call in (lambda: sens.criticality(min_nats=-1), lambda: sens.critical_mask(min_fraction=-1),
                 lambda: critical_heads(sens, min_nats=-1)):
        with pytest.raises(ValueError, match=r"must be a number ≥ 0.*got -1\. Pass e\.g\."):
            call()


def test_valid_thresholds_still_decide():
    sens = _sensitivity()
    assert sens.critical_mask(min_nats=0.0, min_fraction=0.0).tolist() == [[True, False]]
    assert sens.criticality()[0][0] == "critical" and critical_heads(sens) == [(0, 0)]
    assert criticality(torch.tensor([0.3]), torch.tensor([0.5]), 4.0, min_nats=0.0).tolist() == [2.0]


# --- window_mean and paired_window_se -------------------------------------------------------

LOSS = torch.tensor([[2.0, 4.0, 6.0], [1.0, 1.0, 1.0]])
WEIGHT = torch.tensor([1.0, 3.0, 2.0])


@pytest.mark.parametrize("weight, words", [
    (torch.tensor([1.0, -1.0, 2.0]), r"finite and ≥ 0, got -1\.0 at window 1\. Pass the prediction counts"),
    (torch.tensor([1.0, math.nan, 2.0]), r"finite and ≥ 0, got nan at window 1\. Pass the prediction counts"),
    (torch.tensor([1.0, math.inf, 2.0]), r"finite and ≥ 0, got inf at window 1\. Pass the prediction counts"),
    (torch.zeros(3), r"sums to 0.*Pass windows with at least one next-token prediction"),
])
def test_weights_that_are_not_prediction_counts_are_refused(weight, words):
    with pytest.raises(ValueError, match=rf"weight .*{words}"):
        window_mean(LOSS, weight)
    with pytest.raises(ValueError, match=rf"weight .*{words}"):
        window_mean(LOSS, weight, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=rf"weight .*{words}"):
        paired_window_se(LOSS, weight)


@pytest.mark.parametrize("windows, words", [
    (torch.tensor([[0, 1], [2, 0]]), r"windows must be 1-D .* got shape \[2, 2\]: pass one resample at a time"),
    (torch.tensor([0.0, 1.0]), r"windows must hold integer window indices, got dtype torch\.float32: pass integer"),
    (torch.tensor([True, False, True]), r"integer window indices, got dtype torch\.bool: .*mask\.nonzero\(\)"),
    (torch.tensor([0, 3]), r"windows holds index 3, outside 0 … 2 \(there are 3 windows\): pass indices"),
    (torch.tensor([-1, 0]), r"windows holds index -1, outside 0 … 2 .*pass indices"),
    (torch.tensor([], dtype=torch.long), r"windows is empty: a resample needs at least one window"),
])
def test_resamples_that_are_not_1d_indices_in_range_are_refused(windows, words):
    with pytest.raises(ValueError, match=words):
        window_mean(LOSS, WEIGHT, windows)


def test_valid_resamples_still_give_the_weighted_mean():
    torch.testing.assert_close(window_mean(LOSS, WEIGHT), torch.tensor([26 / 6, 1.0], dtype=torch.float64))
    torch.testing.assert_close(window_mean(LOSS, WEIGHT, torch.tensor([1, 1, 2])),
                               torch.tensor([(12 + 12 + 12) / 8, 1.0], dtype=torch.float64))
    # A window without predictions (weight 0, loss NaN) adds nothing; drawing only it gives NaN.
    loss = torch.tensor([2.0, math.nan, 4.0])
    weight = torch.tensor([1.0, 0.0, 1.0])
    assert window_mean(loss, weight).item() == 3.0
    assert window_mean(loss, weight, torch.tensor([1, 1])).isnan()
    assert paired_window_se(torch.tensor([1.0, 2.0, 3.0]), torch.ones(3)).item() == pytest.approx(3 ** -0.5)


def test_a_sweep_whose_windows_have_no_prediction_has_no_standard_error():
    sens = _sensitivity()
    sens.window_weight = torch.zeros(4, dtype=torch.float64)
    assert sens.loss_increase_se.isnan().all() and sens.critical_mask().sum() == 0


# --- rho_over -------------------------------------------------------------------------------


def _correlation(n_windows: int = 5) -> CapacityCorrelation:
    g = torch.Generator().manual_seed(0)
    scores = {"f_score": torch.rand(n_windows, 2, 3, generator=g, dtype=torch.float64),
              "tail_mass": torch.rand(n_windows, 2, 3, generator=g, dtype=torch.float64)}
    increase = torch.rand(2, 3, n_windows, generator=g, dtype=torch.float64)
    return CapacityCorrelation(4, "renormalize", {k: v.mean(0) for k, v in scores.items()}, increase.mean(-1),
                               3.0, {}, scores, increase, torch.full((n_windows,), 7.0, dtype=torch.float64))


@pytest.mark.parametrize("windows, words", [
    ([[0, 1], [2, 3]], r"windows must be 1-D .* got shape \[2, 2\]: pass one resample at a time"),
    (torch.tensor([[0, 1], [2, 3]]), r"windows must be 1-D .*pass one resample at a time"),
    (torch.tensor([0.0, 1.0, 2.0]), r"integer window indices, got dtype torch\.float32: pass integer"),
    (torch.tensor([0, 5]), r"windows holds index 5, outside 0 … 4 \(there are 5 windows\): pass indices"),
    ("abc", r"windows must be a 1-D tensor of window indices, got str: pass e\.g\."),
])
def test_rho_over_refuses_what_is_not_one_resample(windows, words):
    with pytest.raises(ValueError, match=words):
        _correlation().rho_over(windows)


def test_rho_over_refuses_weights_and_arrays_that_do_not_fit():
    corr = _correlation()
    corr.window_weight = torch.tensor([1.0, -2.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"window_weight .*finite and ≥ 0, got -2\.0 at window 1\. Pass"):
        corr.rho_over(torch.arange(5))
    corr.window_weight = torch.zeros(5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"window_weight sums to 0.*Pass windows"):
        corr.rho_over(torch.arange(5))
    corr = _correlation()
    corr.window_weight = torch.ones(4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"window_loss_increase must be .*with 4 windows.*from the same run"):
        corr.rho_over(torch.arange(4))
    corr = _correlation()
    assert corr.window_scores is not None
    corr.window_scores["f_score"] = corr.window_scores["f_score"][:4]
    with pytest.raises(ValueError, match=r"window_scores\['f_score'\] .*5 windows.*from the same run"):
        corr.rho_over(torch.arange(5))


def test_rho_over_on_a_good_resample_matches_a_list_of_the_same_indices():
    corr = _correlation()
    every = corr.rho_over(torch.arange(5))
    assert every == pytest.approx(corr.rho)  # equal weights: the means of the per-window arrays
    assert corr.rho_over([0, 0, 2, 3, 4]) == pytest.approx(corr.rho_over(torch.tensor([0, 0, 2, 3, 4])))


# --- the study's side files: analyses ---------------------------------------------------------


def _analysis(seed: int = 0):
    """A saved-study analysis with per-window arrays on 3 windows (values from ``seed``)."""
    from result_fakes import fake

    from tl_geometry.result.schema import WINDOW_GROUPS

    g = torch.Generator().manual_seed(seed)
    r = fake(layers=(0, 1), n_heads=2, n_values=(2, 4), bounds=True, metadata={"n_sequences": 3})
    r.window_scores = torch.rand(3, len(WINDOW_GROUPS), *r.scores.shape[1:], generator=g, dtype=torch.float64)
    r.window_sink = torch.rand(3, *r.sink.shape, generator=g, dtype=torch.float64)
    assert r.bounds is not None
    r.window_bounds = torch.rand(3, *r.bounds.shape, generator=g, dtype=torch.float64)
    return r


def _make_legacy(path: Path) -> None:
    """Rewrite the analysis at ``path`` as an older study wrote it: no checksum of its side file."""
    import tl_geometry

    result = tl_geometry.HeadAnalysis.load(path)
    del result.metadata[saved.WINDOWS_SHA256]
    result.save(path)


def _flip_inside_tensor_data(side: Path, tensor: torch.Tensor) -> None:
    """Flip one byte of ``tensor``'s stored data in ``side`` (its zip entry inflated, changed and
    deflated again): torch.load still reads the file."""
    import io
    import zipfile

    want, found, out = tensor.contiguous().numpy().tobytes(), False, io.BytesIO()
    with zipfile.ZipFile(side) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            data = bytearray(source.read(info.filename))
            at = bytes(data).find(want)
            if at >= 0 and not found:
                data[at + 1] ^= 0xFF
                found = True
            target.writestr(info.filename, bytes(data))
    assert found
    side.write_bytes(out.getvalue())


def test_a_saved_analysis_and_its_side_file_round_trip_without_a_warning(tmp_path):
    from _reproduce.intervals import window_values

    r, path = _analysis(), tmp_path / "m__c.pt"
    saved.save(r, path, "values")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = saved.load(path, "values")
    assert back is not None
    torch.testing.assert_close(window_values(back, "recall"), window_values(r, "recall").float().double())


def test_a_flipped_byte_in_an_analysis_side_file_is_refused(tmp_path):
    r, path = _analysis(), tmp_path / "m__c.pt"
    saved.save(r, path, "values")
    side = saved.windows_path(path)
    stored = torch.load(side, weights_only=True)["window_sink"]["mass"]
    _flip_inside_tensor_data(side, stored)
    assert not torch.equal(torch.load(side, weights_only=True)["window_sink"]["mass"], stored)  # silent before
    words = rf"{side.name} does not match the checksum .*{path.name}.*{REGENERATE}"
    with pytest.raises(saved.SideFileError, match=words):
        saved.load(path, "values")


def test_a_truncated_analysis_side_file_is_refused(tmp_path):
    r, path = _analysis(), tmp_path / "m__c.pt"
    saved.save(r, path, "values")
    side = saved.windows_path(path)
    side.write_bytes(side.read_bytes()[: side.stat().st_size // 2])
    with pytest.raises(saved.SideFileError, match=rf"does not match the checksum.*cut short.*{REGENERATE}"):
        saved.load(path, "values")
    # A side file written before checksums, cut short: torch's own error becomes one clear error.
    saved.save(r, path, "values")
    _make_legacy(path)
    side.write_bytes(side.read_bytes()[:100])
    with pytest.warns(UserWarning, match="without a checksum"), \
            pytest.raises(saved.SideFileError, match=rf"{side.name} is not a readable per-window file .*{REGENERATE}"):
        saved.load(path, "values")


def test_another_runs_analysis_side_file_is_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    mine, theirs = tmp_path / "a" / "m__c.pt", tmp_path / "b" / "m__c.pt"
    saved.save(_analysis(0), mine, "values")
    saved.save(_analysis(1), theirs, "values")
    shutil.copy(saved.windows_path(theirs), saved.windows_path(mine))
    with pytest.raises(saved.SideFileError, match=rf"written by another run\. {REGENERATE}"):
        saved.load(mine, "values")


def test_a_file_of_another_kind_beside_an_analysis_is_refused(tmp_path):
    r, path = _analysis(), tmp_path / "m__c.pt"
    saved.save(r, path, "values")
    side = saved.windows_path(path)
    shutil.copy(path, side)  # the analysis itself where its slices belong
    with pytest.raises(saved.SideFileError, match=rf"does not match the checksum.*{REGENERATE}"):
        saved.load(path, "values")
    # Without a checksum to compare, the contents are checked.
    _make_legacy(path)
    for other, words in ((torch.zeros(3), r"it holds a Tensor, not a dict of window_scores"),
                         ({"dense": torch.zeros(3)}, r"it holds \['dense'\], not only window_scores"),
                         ({"window_sink": {"shape": [3, 5], "mass": torch.zeros(3)}},
                          r"window_sink has no shape of 4 sizes")):
        torch.save(other, side)
        refused = rf"{side.name} is not an analysis's per-window slices: {words}.*{REGENERATE}"
        with pytest.warns(UserWarning, match="without a checksum"), \
                pytest.raises(saved.SideFileError, match=refused):
            saved.load(path, "values")


def test_an_analysis_side_file_whose_slice_has_another_shape_is_refused(tmp_path):
    r, path = _analysis(), tmp_path / "m__c.pt"
    saved.save(r, path, "values")
    _make_legacy(path)
    side = saved.windows_path(path)
    slices = torch.load(side, weights_only=True)
    slices["window_sink"]["mass"] = slices["window_sink"]["mass"][:1]  # would broadcast silently
    torch.save(slices, side)
    with pytest.warns(UserWarning, match="without a checksum"), \
            pytest.raises(saved.SideFileError, match=r"slice window_sink\[mass\] is \[1, 2, 2\], not \[3, 2, 2\]"):
        saved.load(path, "values")


def test_an_analysis_side_file_written_before_checksums_loads_with_a_warning(tmp_path):
    r, path = _analysis(), tmp_path / "m__c.pt"
    saved.save(r, path, "values")
    _make_legacy(path)
    with pytest.warns(UserWarning, match=rf"without a checksum.*read unchecked.*{REGENERATE}"):
        back = saved.load(path, "values")
    assert back is not None and back.window_sink is not None


class _NotATensor:
    pass


def test_side_files_are_read_with_weights_only(tmp_path):
    r, path = _analysis(), tmp_path / "m__c.pt"
    saved.save(r, path, "values")
    _make_legacy(path)
    torch.save({"window_sink": _NotATensor()}, saved.windows_path(path))
    with pytest.warns(UserWarning), pytest.raises(saved.SideFileError, match="is not a readable per-window file"):
        saved.load(path, "values")


# --- the study's side files: ablation and capacity tables ----------------------------------------


def _tables(study, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    if study is ablation:
        return {"sensitivity": pd.DataFrame({"layer": [0], "loss_increase": [0.5]}),
                "curve": pd.DataFrame({"ordering": ["taxonomy"], "loss": [3.0]}), "base_loss": 3.0,
                "options": "a", "windows": {"curve": torch.rand(1, 8, generator=g, dtype=torch.float64),
                                            "weight": torch.full((8,), 5.0)}}
    return {"curve": pd.DataFrame({"n": [4], "mode": ["renormalize"]}),
            "heads": pd.DataFrame({"layer": [0], "f_score": [0.9]}), "rho": {"f_score": -0.1},
            "seq_len": 128, "options": "c",
            "windows": {"dense": torch.rand(8, generator=g, dtype=torch.float64), "weight": torch.full((8,), 5.0)}}


def _legacy_record(stem: Path) -> None:
    """Rewrite the tables' JSON as an older study wrote it: no checksum of the side file."""
    record = json.loads(Path(f"{stem}.json").read_text())
    del record[saved.TABLES_SHA256]
    Path(f"{stem}.json").write_text(json.dumps(record))


STUDIES = pytest.mark.parametrize("study", [ablation, capacity], ids=["ablation", "capacity"])


@STUDIES
def test_tables_and_their_side_file_round_trip_without_a_warning(study, tmp_path):
    tables, stem = _tables(study), tmp_path / "m__tables"
    study.save(tables, stem)
    assert json.loads(Path(f"{stem}.json").read_text())[saved.TABLES_SHA256]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = study.load(stem)
    assert back is not None and saved.TABLES_SHA256 not in back
    assert back["windows"].keys() == tables["windows"].keys()
    assert all(torch.equal(back["windows"][k], v) for k, v in tables["windows"].items())


@STUDIES
def test_a_flipped_byte_in_a_tables_side_file_is_refused(study, tmp_path):
    tables, stem = _tables(study), tmp_path / "m__tables"
    study.save(tables, stem)
    side = Path(f"{stem}.windows.pt")
    _flip_inside_tensor_data(side, tables["windows"]["weight"])
    assert torch.load(side, weights_only=True)["weight"][0] != 5.0  # torch alone reads it silently
    words = rf"{side.name} does not match the checksum that .*m__tables\.json.*{REGENERATE}"
    with pytest.raises(saved.SideFileError, match=words):
        study.load(stem)


@STUDIES
def test_a_truncated_tables_side_file_is_refused(study, tmp_path):
    stem = tmp_path / "m__tables"
    study.save(_tables(study), stem)
    side = Path(f"{stem}.windows.pt")
    side.write_bytes(side.read_bytes()[:-40])
    with pytest.raises(saved.SideFileError, match=rf"does not match the checksum.*{REGENERATE}"):
        study.load(stem)
    _legacy_record(stem)
    with pytest.warns(UserWarning, match="without a checksum"), \
            pytest.raises(saved.SideFileError, match=rf"is not a readable per-window file .*{REGENERATE}"):
        study.load(stem)


@STUDIES
def test_another_runs_tables_side_file_is_refused(study, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    study.save(_tables(study, 0), tmp_path / "a" / "m__tables")
    study.save(_tables(study, 1), tmp_path / "b" / "m__tables")
    shutil.copy(tmp_path / "b" / "m__tables.windows.pt", tmp_path / "a" / "m__tables.windows.pt")
    with pytest.raises(saved.SideFileError, match=rf"written by another run\. {REGENERATE}"):
        study.load(tmp_path / "a" / "m__tables")


@STUDIES
def test_a_file_of_another_kind_beside_tables_is_refused(study, tmp_path):
    stem = tmp_path / "m__tables"
    study.save(_tables(study), stem)
    side = Path(f"{stem}.windows.pt")
    saved.save(_analysis(), tmp_path / "m__c.pt", "values")
    shutil.copy(saved.windows_path(tmp_path / "m__c.pt"), side)  # an analysis's slices
    with pytest.raises(saved.SideFileError, match=rf"does not match the checksum.*{REGENERATE}"):
        study.load(stem)
    _legacy_record(stem)
    for other, words in ((torch.zeros(3), "it holds a Tensor, not a dict"),
                         ({"window_sink": {"shape": [3]}}, "its entry 'window_sink' is a dict, not a tensor")):
        torch.save(other, side)
        refused = rf"{side.name} is not a table's per-window values: {words}.*{REGENERATE}"
        with pytest.warns(UserWarning, match="without a checksum"), \
                pytest.raises(saved.SideFileError, match=refused):
            study.load(stem)


@STUDIES
def test_tables_without_per_window_values_leave_no_side_file_to_mistake(study, tmp_path):
    stem = tmp_path / "m__tables"
    study.save(_tables(study), stem)
    study.save({**_tables(study), "windows": None}, stem)
    assert not Path(f"{stem}.windows.pt").exists()  # the earlier run's is gone
    back = study.load(stem)
    assert back is not None and back["windows"] is None
    torch.save({"weight": torch.ones(8)}, Path(f"{stem}.windows.pt"))  # any file there is not theirs
    assert study.load(stem)["windows"] is None
    words = r"tables\['windows'\] must map names to per-window tensors.*pass the 'windows' that run\(\) returns"
    with pytest.raises(ValueError, match=words):
        study.save({**_tables(study), "windows": {"weight": [1.0, 2.0]}}, stem)


@STUDIES
def test_tables_side_file_written_before_checksums_loads_with_a_warning(study, tmp_path):
    tables, stem = _tables(study), tmp_path / "m__tables"
    study.save(tables, stem)
    _legacy_record(stem)
    with pytest.warns(UserWarning, match=rf"without a checksum.*{REGENERATE}"):
        back = study.load(stem)
    assert back is not None and torch.equal(back["windows"]["weight"], tables["windows"]["weight"])


@pytest.mark.skipif(not DOCS.is_dir(), reason="no published results in this checkout")
def test_the_published_side_files_load_checked_or_with_a_warning():
    """docs/results holds tables whose side files were written before checksums: they load (with
    a warning), so ``--reuse`` keeps re-rendering the published page; the analyses, saved again
    deflated, carry their checksums and load without one."""
    for study, suffix in ((ablation, "ablation"), (capacity, "capacity")):
        stems = sorted(p.with_name(p.name.removesuffix(".json")) for p in DOCS.glob(f"*__{suffix}.json"))
        assert stems
        for stem in stems:
            with pytest.warns(UserWarning, match="without a checksum"):
                back = study.load(stem)
            assert back is not None and isinstance(back["windows"], dict)
    import tl_geometry

    smallest = min((p for p in DOCS.glob("*__*.pt") if not p.name.endswith(".windows.pt")),
                   key=lambda p: p.stat().st_size)
    kind = smallest.stem.split("__")[-1] if smallest.stem.count("__") == 2 else "values"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert saved.load(smallest, kind) is not None
    assert saved.WINDOWS_SHA256 in tl_geometry.HeadAnalysis.load(smallest).metadata
