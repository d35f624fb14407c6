"""The result and policy surfaces keep the bad-input promise: a clear error naming the problem and
the fix, or a documented NaN; never a raw traceback, a silent wrong answer or a changed argument.

One test (or group) per finding: ``top(k=...)``; the label stability with fewer than 8 sequences
("too few units", SPEC §5) and everything that shows it; head-score tables of another model or
with repeated heads; result files relabelled as an older format, nested meta tensors and folders;
policy sizes, nesting and counts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jaxtyping
import numpy as np
import pandas as pd
import pytest
import torch
from repo_paths import TESTS
from result_fakes import fake
from shared_checks import drop_format_6, drop_format_7, drop_format_8, drop_format_9

import tl_geometry
from tl_geometry.capacity.policy import MAX_HEADS, MAX_LAYERS, POLICY_FORMAT, TopNPolicy
from tl_geometry.functional.taxonomy import MIN_UNITS, bootstrap_stability
from tl_geometry.result import HeadAnalysis, ResultFileError
from tl_geometry.result import io as _result_io
from tl_geometry.result.labels import EXPORT_COLUMNS

#: A file of format 2 (tl_geometry 0.2 before the checksum), as the reproduction of 2026-12-03
#: saved it: kept here, since the page's own analyses are rewritten in today's format.
FORMAT_2_FILE = TESTS / "data" / "format_2_smollm2-135m__wikitext-2.pt"


@pytest.fixture(autouse=True)
def _as_users_call(monkeypatch):
    """The errors users get: without the test-time runtime type checks."""
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)


def _with_sequences(r: HeadAnalysis, times: int) -> HeadAnalysis:
    """``r`` with its per-sequence votes repeated ``times`` times: same labels, more units."""
    votes = r.sequence_votes.repeat(times, 1, 1, 1)
    return dataclasses.replace(r, sequence_votes=votes, vote_counts=votes.sum(0).double())


def _scores(r: HeadAnalysis) -> pd.DataFrame:
    """A head-score table of ``r``'s heads (as tl_geometry.head_scores gives, in form)."""
    table = r.heads_table()
    frame = pd.DataFrame({"layer": table["layer"], "head": table["head"], "previous_token": 0.1,
                          "duplicate_token": 0.2, "induction": table["vote_current"],
                          "sink_rate": table["vote_sink"], "retrieval": 0.0})
    frame.attrs.update(sink_epsilon=0.5)
    return frame


# --- 1. top(k) ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("k", "message"), [
    (-1, r"-1 is below 1; give the number of heads to return as an int ≥ 1"),
    (0, r"0 is below 1; give the number of heads"),
    (True, r"True is a bool; give the number of heads to return as an int ≥ 1"),
    (np.True_, r".*True_? is a bool"),
    (2.5, r"2\.5 \(float\) is not an int; give the number of heads to return as an int ≥ 1"),
    ("3", r"'3' \(str\) is not an int"),
    (None, r"None \(NoneType\) is not an int"),
])
def test_top_needs_a_positive_int_k(k, message):
    r = fake((0, 1, 2), n_heads=6)
    with pytest.raises(ValueError, match=rf"^top\(k=\.\.\.\): {message}"):
        r.top(k)


def test_top_takes_numpy_ints_and_refuses_a_non_bool_largest():
    r = fake((0, 1, 2), n_heads=6)
    assert len(r.top(np.int64(3))) == 3 and len(r.top(torch.tensor(2))) == 2
    assert len(r.top(100)) == 18  # more than there are: every head
    assert r.top(3, largest=np.False_).equals(r.top(3, largest=False))
    with pytest.raises(ValueError, match=r"top\(largest='no'\): give True .* or False"):
        r.top(3, largest="no")


# --- 2. stability with too few units (SPEC §5) ---------------------------------------------------
def test_fewer_than_8_sequences_give_no_stability():
    votes = torch.tensor([[[5, 0, 0], [0, 4, 1]]])  # one sequence, two heads: used to read 1.0
    assert bootstrap_stability(votes).isnan().all()
    many = votes.repeat(MIN_UNITS, 1, 1)
    assert bootstrap_stability(many[: MIN_UNITS - 1]).isnan().all()
    assert bootstrap_stability(many).tolist() == [1.0, 1.0]  # 8 units: a stability
    r = fake()  # 3 sequences
    assert r.label_stability.isnan().all() and not r.unstable.any()
    assert r.label_margin.isfinite().all()  # the margin needs no resampling
    assert _with_sequences(r, 3).label_stability.isfinite().all()  # 9 sequences


def test_too_few_units_is_shown_and_never_counted_unstable(tmp_path):
    r = fake()
    text = r.summary(top=None)
    flat = " ".join(text.split())  # the summary wraps at 100 columns
    assert "label stability not given: too few units (3 sequences; the bootstrap needs at least 8" in flat
    assert "unstable (stability < 0.8)" not in flat and "?" not in text.split("Legend")[0].split("in layer order")[1]
    assert "stab nan = no stability: too few units" in flat
    table = r.heads_table()
    assert table["label_stability"].isna().all() and not table["unstable"].any()
    rows = pd.read_csv(r.export_labels(tmp_path / "labels.csv"))
    assert list(rows.columns) == list(EXPORT_COLUMNS) and rows["stability"].isna().all()
    heads = json.loads(r.export_labels(tmp_path / "labels.json").read_text())["heads"]
    assert all(h["stability"] is None for h in heads)
    from tl_geometry.views.report import label_confidence_section
    from tl_geometry.views.taxonomy import head_tooltip, taxonomy_view

    section = "".join(label_confidence_section(r))
    assert "Label stability not given: too few units (3 sequences" in section
    assert "unstable heads (" not in section and "median stability" not in section
    assert "stability too few units (3 < 8 sequences)" in head_tooltip(r, 0, 1, 2)
    assert "label stability not given: too few units" in str(taxonomy_view(r).__dict__)
    # with 8 or more sequences the stability is back, and unstable heads are counted again
    many = _with_sequences(r, 3)
    flat = " ".join(many.summary().split())
    assert "label stability not given" not in flat and "; unstable (stability < 0.8): " in flat
    assert "median stability" in "".join(label_confidence_section(many))


# --- 3. head-score tables of another model --------------------------------------------------------
def test_scores_missing_heads_are_refused_naming_them(tmp_path):
    r = fake((0, 1, 2), n_heads=6)
    other = _scores(fake((0, 1), n_heads=4))  # another model's table: most heads missing
    before = other.copy()
    from tl_geometry.views.report import write_report

    for call in (lambda: r.export_labels(tmp_path / "l.csv", scores=other),
                 lambda: tl_geometry.label_agreement(r, other),
                 lambda: r.heads_table(scores=other),
                 lambda: write_report(r, tmp_path / "report", scores=other)):
        with pytest.raises(ValueError, match=r"scores lacks 10 of the 18 analysed heads: \(layer 0, head 4\), "
                           r".* and 5 more; .*Compute head_scores on the same model"):
            call()
    pd.testing.assert_frame_equal(other, before)  # the caller's table is not changed
    assert list(tmp_path.iterdir()) == []  # refused before anything is written


def test_scores_with_repeated_heads_are_refused(tmp_path):
    r = fake()
    twice = pd.concat([_scores(r), _scores(r)], ignore_index=True)
    with pytest.raises(ValueError, match=r"scores lists 8 heads more than once: \(layer 3, head 0\).*"
                       r"compute head_scores on the same model.*drop_duplicates"):
        r.export_labels(tmp_path / "l.csv", scores=twice)
    with pytest.raises(ValueError, match="more than once"):
        tl_geometry.label_agreement(r, twice)
    assert list(tmp_path.iterdir()) == []
    # a table with more heads than analysed (every layer of the model) is fine
    extra = pd.concat([_scores(r), _scores(r).assign(layer=lambda t: t["layer"] + 100)], ignore_index=True)
    assert len(pd.read_csv(r.export_labels(tmp_path / "l.csv", scores=extra))) == r.n_layers * r.n_heads


@pytest.mark.parametrize(("column", "values"), [("layer", "strings"), ("head", "floats")])
def test_scores_whose_layer_or_head_is_not_int_are_refused(tmp_path, column, values):
    r = fake()
    scores = _scores(r)
    scores[column] = scores[column].astype(str if values == "strings" else float)
    with pytest.raises(ValueError, match=rf"scores' {column} column holds (object|float64|str) values .*"
                       r"compute head_scores on the same model .*astype"):
        r.export_labels(tmp_path / "l.csv", scores=scores)
    with pytest.raises(ValueError, match=rf"scores' {column} column"):
        tl_geometry.label_agreement(r, scores)


# --- 4. result files ----------------------------------------------------------------------------------
def _payload(tmp_path: Path) -> tuple[HeadAnalysis, dict]:
    r = fake()
    return r, torch.load(r.save(tmp_path / "r.pt"), weights_only=True)


@pytest.mark.parametrize("version", [1, 2])
def test_a_newer_file_relabelled_as_older_is_refused(tmp_path, version):
    _, payload = _payload(tmp_path)
    payload["scores"] = payload["scores"] * 0 + 0.25  # edited numbers
    del payload["checksum"]
    payload["format"] = f"tl_geometry.HeadAnalysis/{version}"
    torch.save(payload, tmp_path / "old.pt")
    with pytest.raises(ResultFileError, match=rf"says format {version} but holds what later formats "
                       r"added: .*sequence_votes \(format 4\).*truncation_p90 \(format 5\).*"
                       r"relabelled or damaged\. Restore a good copy or run the analysis again"):
        HeadAnalysis.load(tmp_path / "old.pt")


@pytest.mark.parametrize("version", [3, 4, 5, 6, 7, 8])
def test_every_format_since_3_must_carry_its_checksum(tmp_path, version):
    _, payload = _payload(tmp_path)
    del payload["checksum"]
    if version < 9:  # no local sink, no per-window sink-in / sink-out groups
        drop_format_9(payload)
    if version < 8:  # no baseline standard errors
        drop_format_8(payload)
    if version < 7:  # no per-window bounds
        drop_format_7(payload)
    if version < 6:  # no votes apart or per block, no per-window arrays
        drop_format_6(payload)
    if version < 5:  # what that format could hold: no truncation figures
        del payload["truncation_p90"], payload["axes"]["truncation_p90"], payload["names"]["truncation_metric"]
        keep = [i for i, m in enumerate(payload["names"]["metric"]) if m not in ("tail_mass", "truncation_error")]
        payload["scores"] = payload["scores"][:, keep]
        payload["names"]["metric"] = [payload["names"]["metric"][i] for i in keep]
    if version < 4:
        del payload["sequence_votes"], payload["axes"]["sequence_votes"]
    payload["format"] = f"tl_geometry.HeadAnalysis/{version}"
    torch.save(payload, tmp_path / "old.pt")
    with pytest.raises(ResultFileError, match=r"has no checksum: .*Restore a good copy or run the analysis"):
        HeadAnalysis.load(tmp_path / "old.pt")


def test_a_real_format_2_file_still_loads_and_a_later_field_in_it_is_refused(tmp_path):
    loaded = HeadAnalysis.load(FORMAT_2_FILE)
    assert loaded.sequence_votes is None and loaded.label_stability.isnan().all()
    payload = torch.load(FORMAT_2_FILE, weights_only=True)
    payload["sequence_votes"] = torch.zeros(1, *loaded.vote_counts.shape, dtype=torch.int32)
    torch.save(payload, tmp_path / "v2.pt")
    with pytest.raises(ResultFileError, match=r"says format 2 but holds .*sequence_votes \(format 4\)"):
        HeadAnalysis.load(tmp_path / "v2.pt")


@pytest.mark.parametrize("where", ["names", "layers", "metadata key"])
def test_a_nested_meta_tensor_is_refused_with_its_place(tmp_path, where):
    _, payload = _payload(tmp_path)
    meta = torch.zeros(2, device="meta")
    if where == "names":
        payload["names"]["group"] = meta
    elif where == "layers":
        payload["layers"] = [meta, 5]
    else:
        payload[meta] = 1
    torch.save(payload, tmp_path / "meta.pt")
    with pytest.raises(ResultFileError, match=r"is a meta tensor with no readable data; save the analysis again"):
        HeadAnalysis.load(tmp_path / "meta.pt")


def test_repeated_axis_labels_are_refused_not_misread(tmp_path):
    _, payload = _payload(tmp_path)
    payload["names"]["metric"] = ["f_score"] * len(payload["names"]["metric"])
    payload["checksum"] = _result_io.checksum(payload)
    torch.save(payload, tmp_path / "dup.pt")
    with pytest.raises(ResultFileError, match=r"metric labels .* are not distinct names"):
        HeadAnalysis.load(tmp_path / "dup.pt")


def test_folders_are_named_as_folders(tmp_path):
    r = fake()
    r.save(tmp_path / "run" / "analysis.pt")
    with pytest.raises(ResultFileError, match=r"run: is a folder, not a result file; it holds analysis\.pt\. "
                       r"Give the result file inside it"):
        HeadAnalysis.load(tmp_path / "run")
    (tmp_path / "labels.csv").mkdir()
    with pytest.raises(ValueError, match=r"export_labels: cannot save to .*labels\.csv: it is a folder\. "
                       r"Give a file path, e.g\. .*labels\.csv/labels\.csv"):
        r.export_labels(tmp_path / "labels.csv")
    (tmp_path / "policy.json").mkdir()
    policy = TopNPolicy.uniform(2, 2, 4)
    with pytest.raises(ValueError, match=r"policy\.json: it is a folder\. Give a file path"):
        policy.save(tmp_path / "policy.json")
    with pytest.raises(ValueError, match=r"policy\.json: is a folder, not a policy file; give the policy file"):
        TopNPolicy.load(tmp_path / "policy.json")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["analysis.pt", "labels.csv", "policy.json", "run"]


# --- 5. policies -----------------------------------------------------------------------------------
def _policy_json(**changes) -> str:
    data = {"format": POLICY_FORMAT, "n_layers": 2, "n_heads": 3, "heads": [[0, 1, 4]], "metadata": {}}
    return json.dumps({**data, **changes})


@pytest.mark.parametrize(("changes", "message"), [
    ({"n_layers": 10**12}, rf"n_layers = 1000000000000: a policy needs n_layers, n_heads ≥ 1 and at most {MAX_LAYERS}"),
    ({"n_layers": 10**4, "n_heads": 10**4}, rf"n_layers = 10000: .*at most {MAX_LAYERS} layers and {MAX_HEADS} heads"),
    ({"n_heads": MAX_HEADS + 1}, rf"n_heads = {MAX_HEADS + 1}: .*give the model's counts"),
    ({"n_heads": -3}, r"n_heads = -3: a policy needs n_layers, n_heads ≥ 1"),
    ({"n_heads": 2.5}, r"n_heads must be an int, got 2\.5"),
    ({"n_layers": True}, r"n_layers must be an int, got True"),
])
def test_policy_sizes_are_bounded_before_anything_is_allocated(changes, message):
    with pytest.raises(ValueError, match=message):
        TopNPolicy.from_json(_policy_json(**changes))


def test_deeply_nested_policy_json_is_a_value_error_naming_the_file(tmp_path):
    depth = 100_000
    with pytest.raises(ValueError, match="not a policy: its JSON nests too deeply to read"):
        TopNPolicy.from_json("[" * depth + "]" * depth)
    path = tmp_path / "deep.json"
    path.write_text('{"format": "tl_geometry.TopNPolicy/1", "metadata": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ValueError, match=rf"^{path}: not a policy: its JSON nests too deeply.*TopNPolicy\.save"):
        TopNPolicy.load(path)
    path.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ValueError, match=rf"^{path}: "):
        TopNPolicy.load(path)


@pytest.mark.parametrize(("args", "message"), [
    ((2, -1, 9), r"n_layers = -1: a policy needs n_layers, n_heads ≥ 1"),
    ((2, 1.5, 9), r"n_layers must be an int, got 1\.5 \(float\)"),
    ((2, 0, 9), r"n_layers = 0: a policy needs n_layers, n_heads ≥ 1 .*TopNPolicy\.uniform\(n, model\.cfg\.n_layers"),
    ((2, 3, 0), r"n_heads = 0"),
    ((2, 3, MAX_HEADS + 1), rf"at most {MAX_LAYERS} layers and {MAX_HEADS} heads"),
    ((2.5, 3, 4), r"n must be an int"),
    ((-2, 3, 4), r"n = -2 is not a number of keys"),
])
def test_uniform_refuses_counts_that_are_not_positive_ints(args, message):
    with pytest.raises(ValueError, match=message):
        TopNPolicy.uniform(*args)


def test_every_constructor_refuses_an_empty_or_oversized_policy():
    with pytest.raises(ValueError, match="n_layers = 0"):
        TopNPolicy(torch.zeros(0, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match="n_heads = 0"):
        TopNPolicy.from_dict({}, 2, 0)
    with pytest.raises(ValueError, match=rf"n_layers = {MAX_LAYERS + 1}"):
        TopNPolicy.from_budgets(torch.ones(1, 4, dtype=torch.int64), [0], MAX_LAYERS + 1)
    policy = TopNPolicy.uniform(np.int64(2), np.int64(3), 4)  # NumPy ints are ints
    assert (policy.n_layers, policy.n_heads) == (3, 4) and TopNPolicy.from_json(policy.to_json()) == policy
    assert math.isfinite(policy.kept_keys(8))
