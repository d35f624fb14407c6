"""HeadAnalysis files: versioned, labelled, checked on load; metadata that round-trips or is
refused at save time (issue 14, item 6)."""

from __future__ import annotations

import math
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from result_fakes import fake
from shared_checks import drop_format_6

from tl_geometry.result import HeadAnalysis, ResultFileError
from tl_geometry.result import io as _result_io


def _same(a: HeadAnalysis, b: HeadAnalysis) -> None:
    assert a.layers == b.layers and torch.equal(a.n_values, b.n_values)
    for key in ("scores", "group_counts", "sink", "vote_counts", "bounds", "regime", "paired", "sequence_votes"):
        x, y = getattr(a, key), getattr(b, key)
        if x is None or y is None:
            assert x is None and y is None, key
            continue
        assert x.dtype == y.dtype, key
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=key)


def _rewrite(path: Path, **changes) -> Path:
    """Edit a saved file and seal it with a fresh checksum, so its contents are what is checked."""
    payload = torch.load(path, weights_only=True)
    payload.update(changes)
    payload["checksum"] = _result_io.checksum(payload)
    torch.save(payload, path)
    return path


def test_round_trip_is_exact_by_name_and_the_file_is_labelled(tmp_path):
    r = fake(bounds=True)
    r.scores[0, 0, 0, 0, 0] = math.nan
    path = r.save(tmp_path / "sub" / "run.pt")
    _same(HeadAnalysis.load(path), r)
    payload = torch.load(path, weights_only=True)
    assert payload["format"] == "tl_geometry.HeadAnalysis/9"
    assert payload["checksum"] == _result_io.checksum(payload)
    assert payload["axes"]["scores"] == ["group", "metric", "layer", "head", "n"]
    assert payload["names"]["metric"][:3] == ["precision", "recall", "f_score"]
    assert payload["names"]["group"][:2] == ["top", "random"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["run.pt"]  # no temporary file left
    plain = tmp_path / "plain"
    plain.write_bytes(b"")  # the atomic write keeps the usual permissions (not mkstemp's 0600)
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    r.save(path)  # overwriting is fine
    _same(HeadAnalysis.load(path), r)


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    good = fake().save(tmp_path / "good.pt")
    data = good.read_bytes()
    files = {
        "truncated": data[: len(data) // 2], "empty": b"", "text": b"layer,head,f_score\n3,0,0.5\n",
        "half a header": data[:40],
    }
    out = {}
    for name, content in files.items():
        out[name] = tmp_path / f"{name.replace(' ', '_')}.pt"
        out[name].write_bytes(content)
    torch.save(torch.zeros(3), out.setdefault("plain tensor", tmp_path / "tensor.pt"))
    torch.save({"scores": torch.zeros(2)}, out.setdefault("dict without format", tmp_path / "dict.pt"))
    torch.save([1, 2], out.setdefault("list", tmp_path / "list.pt"))
    torch.save({"format": "other/1"}, out.setdefault("foreign format", tmp_path / "foreign.pt"))
    return out


def test_unreadable_files_raise_one_clear_error_naming_the_file(tmp_path):
    for what, path in _bad_files(tmp_path).items():
        with pytest.raises(ResultFileError, match=rf"^{path}: (not a readable|holds)") as info:
            HeadAnalysis.load(path)
        assert isinstance(info.value, ValueError), what
        # one clear error: no torch / pickle traceback chained to it
        assert info.value.__cause__ is None, what
        assert info.value.__context__ is None or info.value.__suppress_context__, what
    with pytest.raises(FileNotFoundError, match="no such result file"):
        HeadAnalysis.load(tmp_path / "missing.pt")
    with pytest.raises(ResultFileError, match=r"is a folder, not a result file.*Give the result file inside it"):
        HeadAnalysis.load(tmp_path)  # a folder


class _Payload:
    def __reduce__(self):
        return (Path.touch, (Path(_Payload.target),))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_crafted_pickle_is_refused_not_run(tmp_path):
    _Payload.target = str(tmp_path / "pwned")
    path = tmp_path / "evil.pt"
    torch.save({"format": "tl_geometry.HeadAnalysis/2", "x": _Payload()}, path)
    with pytest.raises(ResultFileError, match="not a readable"):
        HeadAnalysis.load(path)
    assert not (tmp_path / "pwned").exists()
    path.write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(ResultFileError):
        HeadAnalysis.load(path)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(("change", "message"), [
    (lambda p: {"scores": p["scores"][:, :, :, :3]},
     r"group_counts has shape \[6, 2, 4, 3\]; expected \[group=6, layer=2, head=3"),
    (lambda p: {"layers": [3, 5, 7]}, r"scores has shape .*layer=3"),
    (lambda p: {"layers": "35"}, "layers must be model layer indices"),
    (lambda p: {"n_values": torch.tensor([2.0, 4.0, 8.0])}, "n_values must be a 1-D tensor of distinct ints"),
    (lambda p: {"n_values": torch.tensor([2, 2, 8])}, "distinct ints"),
    (lambda p: {"sink": p["sink"][:3]}, r"sink has 3 entries on its sink_field axis"),
    (lambda p: {"vote_counts": -p["vote_counts"], "sequence_votes": None}, "vote_counts must hold counts"),
    (lambda p: {"vote_counts": p["vote_counts"] + 1}, "sequence_votes do not add up"),
    (lambda p: {"vote_counts": p["vote_counts"].flatten()}, "expected axes"),
    (lambda p: {"group_counts": None}, "group_counts is a NoneType, not a tensor"),
    (lambda p: {"bounds": torch.zeros(len(p["names"]["bound_kind"]), len(p["names"]["bound_metric"]), 2, 4, 3)},
     "bounds and regime come together"),
    (lambda p: {"metadata": "{not json"}, "metadata is not valid JSON"),
    (lambda p: {"metadata": "[1, 2]"}, "metadata is a list, not a dict"),
    (lambda p: {"format": "tl_geometry.HeadAnalysis/10"}, "newer than this tl_geometry reads"),
    (lambda p: {"format": "tl_geometry.HeadAnalysis/0"}, "not a valid version"),
    (lambda p: {"format": "tl_geometry.HeadAnalysis/-1"}, "not a valid version"),
    (lambda p: {"axes": {**p["axes"], "sink": ["layer", "head", "sink_field"]}}, "axis labels"),
    (lambda p: {"names": {**p["names"], "group": p["names"]["group"][:4]}}, "group axis but the file"),
])
def test_well_formed_files_with_inconsistent_contents_are_refused(tmp_path, change, message):
    path = fake().save(tmp_path / "r.pt")
    _rewrite(path, **change(torch.load(path, weights_only=True)))
    with pytest.raises(ResultFileError, match=message) as info:
        HeadAnalysis.load(path)
    assert str(info.value).startswith(f"{path}: ")


def test_missing_entries_are_named(tmp_path):
    path = fake().save(tmp_path / "r.pt")
    payload = torch.load(path, weights_only=True)
    del payload["sink"], payload["layers"]
    payload["checksum"] = _result_io.checksum(payload)
    torch.save(payload, path)
    with pytest.raises(ResultFileError, match=r"incomplete: missing \['layers', 'sink'\]"):
        HeadAnalysis.load(path)


def test_axes_are_read_by_name_so_a_reordered_or_renamed_metric_is_never_misread(tmp_path):
    r = fake()
    path = r.save(tmp_path / "r.pt")
    payload = torch.load(path, weights_only=True)
    names = payload["names"]["metric"]
    order = [names.index(m) for m in ("recall", "precision", "f_score", "margin", "inversions",
                                      "f_score_cc", "precision_cc", "truncation_error", "tail_mass")]
    _rewrite(path, scores=payload["scores"][:, order],
             names={**payload["names"], "metric": [names[i] for i in order]})
    _same(HeadAnalysis.load(path), r)  # a file listing its metrics in another order reads the same
    renamed = [("f1" if m == "f_score" else m) for m in names]
    _rewrite(path, scores=payload["scores"], names={**payload["names"], "metric": renamed})
    with pytest.warns(UserWarning, match=r"filled \['f_score'\], dropped \['f1'\]"):
        loaded = HeadAnalysis.load(path)
    assert loaded.f_score.isnan().all()  # unknown, not another metric's numbers
    assert torch.equal(loaded.recall, r.recall)


def _labelled_as(r: HeadAnalysis, labels: dict) -> dict:
    """r's tensors restricted to ``labels`` (an older version's names) on every named axis."""
    out = {}
    for key, axes in _result_io.AXES.items():
        value = getattr(r, key)
        for dim, axis in enumerate(axes):
            if value is not None and axis in labels:
                index = [_result_io.names()[axis].index(x) for x in labels[axis]]
                value = value.index_select(dim, torch.tensor(index))
        out[key] = value
    return out


def _check_filled(loaded: HeadAnalysis, r: HeadAnalysis, labels: dict) -> None:
    """What the old file had reads the same; what it lacks (new groups, bound kinds) is NaN."""
    assert loaded.layers == r.layers and torch.equal(loaded.n_values, r.n_values)
    old, new = _labelled_as(r, labels), _labelled_as(loaded, labels)
    for key in old:
        if key == "paired" and loaded.paired is None:  # a file from before the paired sink effect
            assert loaded.paired_sink_ratio.isnan().all()
            continue
        if key == "sequence_votes" and loaded.sequence_votes is None:  # a file from before format 3
            assert loaded.label_stability.isnan().all()
            continue
        if key == "truncation_p90" and loaded.truncation_p90 is None:  # a file from before format 5
            assert loaded.p90_tail_mass.isnan().all()
            continue
        torch.testing.assert_close(new[key], old[key], rtol=0, atol=0, equal_nan=True, msg=key)
    for kind in set(_result_io.names()["bound_kind"]) - set(labels["bound_kind"]):
        assert loaded.bound(kind).isnan().all(), kind
    for metric in set(_result_io.names()["bound_metric"]) - set(labels["bound_metric"]):
        assert loaded.bound("inversion", metric).isnan().all(), metric


@pytest.mark.filterwarnings("ignore:bounds. the file.s bound_:UserWarning")  # format 1 predates the shell
def test_format_1_files_load_with_a_warning(tmp_path):
    r = fake(bounds=True, metadata={"model_name": "m", "n_values": [2, 4, 8]})
    path = tmp_path / "old.pt"
    old = _labelled_as(r, _result_io._FORMAT1_NAMES)
    del old["paired"], old["sequence_votes"], old["truncation_p90"]  # added in 0.2, in formats 3 and 5
    drop_format_6(old)
    torch.save({  # what tl_geometry 0.1 wrote
        "format": "tl_geometry.HeadAnalysis/1", "layers": list(r.layers), **old,
        "metadata": '{"model_name": "m", "n_values": [2, 4, 8]}',
    }, path)
    with pytest.warns(UserWarning, match="format 1 .* Save it again to upgrade"):
        loaded = HeadAnalysis.load(path)
    _check_filled(loaded, r, _result_io._FORMAT1_NAMES)
    assert loaded.metadata == r.metadata
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HeadAnalysis.load(loaded.save(path))  # upgraded: no warning


def test_files_without_the_shell_bounds_load_with_nan(tmp_path):
    """A format-2 file written before the shell certificate (bound kinds inversion, certified,
    predicted; metrics P, R, F) loads; the shell kinds and ``separated`` are NaN."""
    r = fake(bounds=True)
    path = r.save(tmp_path / "r.pt")
    labels = {"bound_kind": ("inversion", "certified", "predicted"),
              "bound_metric": ("precision", "recall", "f_score")}
    payload = torch.load(path, weights_only=True)
    _rewrite(path, bounds=_labelled_as(r, labels)["bounds"],
             names={**payload["names"], **{k: list(v) for k, v in labels.items()}})
    with pytest.warns(UserWarning) as record:
        loaded = HeadAnalysis.load(path)
    messages = [str(w.message) for w in record]
    assert any("bound_kind labels differ" in m and "filled ['shell', 'shell_n']" in m for m in messages)
    assert any("bound_metric labels differ" in m and "filled ['separated']" in m for m in messages)
    _check_filled(loaded, r, labels)
    assert loaded.shell_f_score.isnan().all() and loaded.shell_n_separated.isnan().all()
    assert torch.equal(loaded.certified_f_score, r.certified_f_score)
    assert loaded.best_n()["shell_best_n"].isna().all()


def test_metadata_round_trips_tuples_int_keys_and_special_floats(tmp_path):
    meta = {
        "n_values": (1, 2, 4), "layers": [0, (1, 2)], "by_layer": {3: "a", 5: (0.5, None)},
        "pairs": {(3, 1): 1.0}, "nan": math.nan, "inf": -math.inf, "flag": True, "none": None,
        "nested": {"loading": {"fold_ln": False, "ids": {0: [1, 2]}}},
        "__tuple__": "a user key that looks like a tag", "tagged": {"__items__": 1},
    }
    loaded = HeadAnalysis.load(fake(metadata=meta).save(tmp_path / "r.pt")).metadata
    assert math.isnan(loaded.pop("nan")) and loaded.pop("inf") == -math.inf
    del meta["nan"], meta["inf"]
    assert loaded == meta
    assert isinstance(loaded["n_values"], tuple) and isinstance(loaded["layers"][1], tuple)
    assert list(loaded["by_layer"]) == [3, 5] and list(loaded["pairs"]) == [(3, 1)]


def test_metadata_is_converted_to_documented_plain_forms(tmp_path):
    meta = {"path": Path("/data/wiki.txt"), "heads": {3, 1, 2}, "dtype": torch.bfloat16,
            "device": torch.device("cpu"), "t0": torch.tensor(2.5), "ids": torch.tensor([[1, 2], [3, 4]])}
    r = fake(metadata=meta)
    loaded = HeadAnalysis.load(r.save(tmp_path / "r.pt")).metadata
    assert loaded == {"path": "/data/wiki.txt", "heads": [1, 2, 3], "dtype": "torch.bfloat16",
                      "device": "cpu", "t0": 2.5, "ids": [[1, 2], [3, 4]]}
    assert r.metadata["path"] == Path("/data/wiki.txt")  # the caller's metadata is not changed


@pytest.mark.parametrize(("meta", "message"), [
    ({"loading": {"model": object()}}, r"metadata\['loading'\]\['model'\]: a object cannot be saved"),
    ({"big": torch.zeros(200, 200)}, r"metadata\['big'\]: an array of 40000 elements is too large"),
    ({"k": {object(): 1}}, r"metadata\['k'\]: key .* cannot be saved"),
    ({"f": len}, "builtin_function_or_method cannot be saved"),
])
def test_metadata_that_cannot_be_stored_is_refused_at_save_time(tmp_path, meta, message):
    with pytest.raises(ValueError, match=message):
        fake(metadata=meta).save(tmp_path / "r.pt")
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary file


def test_encode_decode_are_inverse_on_plain_data():
    value = {"a": [1, (2, 3)], 4: {"b": None}, (5, "c"): 1.5}
    assert _result_io.decode_metadata(_result_io.encode_metadata(value)) == value
