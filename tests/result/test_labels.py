"""Label confidence (vote margin, bootstrap stability; SPEC §5), the label export, ``top`` by
class, attribute access on selections, and the agreement with head scores (SPEC §9)."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from cases import make_case
from result_fakes import fake
from shared_checks import as_format_2

import tl_geometry
from tl_geometry.engine import Accumulator
from tl_geometry.functional.taxonomy import (
    CLASSES,
    bootstrap_resample_weights,
    bootstrap_stability,
    vote_margin,
)
from tl_geometry.result import HeadAnalysis, UnknownNameError
from tl_geometry.result import io as _result_io
from tl_geometry.result.labels import EXPORT_COLUMNS, LABELS_FORMAT


def _noisy_votes(seed: int, n_sequences: int = 9, heads: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    """Per-sequence vote counts ``[sequence, *heads, 3]`` whose labels sometimes move (9
    sequences: at least the 8 units a stability needs, SPEC §5)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 6, (n_sequences, *heads, 3), generator=g)


def _slow_label(counts: list[int]) -> int | None:
    """Plurality with ties Retriever > Mixer > Reset; no votes → None (SPEC §5)."""
    if sum(counts) == 0:
        return None
    best = max(counts)
    return counts.index(best)


def _slow_stability(votes: torch.Tensor, n_resamples: int = 200, seed: int = 0) -> torch.Tensor:
    """The bootstrap of SPEC §5 one resample and one head at a time, from the documented draws
    (``torch.randint`` of a generator seeded with ``seed``); none below 8 sequences."""
    n = votes.shape[0]
    if n < 8:  # too few units (SPEC §5)
        return torch.full(votes.shape[1:-1], math.nan, dtype=torch.float64)
    draws = torch.randint(n, (n_resamples, n), generator=torch.Generator().manual_seed(seed)).tolist()
    flat = votes.reshape(n, -1, 3).tolist()
    out = []
    for head in range(len(flat[0])):
        full = _slow_label([sum(flat[s][head][k] for s in range(n)) for k in range(3)])
        if full is None:
            out.append(math.nan)
            continue
        same = 0
        for rows in draws:
            total = [sum(flat[s][head][k] for s in rows) for k in range(3)]
            same += _slow_label(total) == full
        out.append(same / n_resamples)
    return torch.tensor(out, dtype=torch.float64).reshape(votes.shape[1:-1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stability_matches_a_slow_reference(seed):
    votes = _noisy_votes(seed)
    votes[:, 0, 0] = 0  # a head with no votes at all: NaN, not a Retriever
    got = bootstrap_stability(votes)
    torch.testing.assert_close(got, _slow_stability(votes), equal_nan=True, rtol=0, atol=0)
    assert math.isnan(float(got[0, 0]))
    finite = got[~got.isnan()]
    assert ((finite >= 0) & (finite <= 1)).all() and (finite < 1).any()  # some labels do move


def test_bootstrap_is_seeded_and_deterministic():
    votes = _noisy_votes(3)
    assert torch.equal(bootstrap_stability(votes, seed=0), bootstrap_stability(votes, seed=0))
    assert not torch.equal(bootstrap_stability(votes, seed=0), bootstrap_stability(votes, seed=5))
    w = bootstrap_resample_weights(7, 200, seed=0)
    assert w.shape == (200, 7) and (w.sum(-1) == 7).all()
    assert torch.equal(w, bootstrap_resample_weights(7, 200, seed=0))


def test_margin_matches_a_slow_reference():
    counts = _noisy_votes(4).sum(0).double()
    counts[0, 0] = 0
    got = vote_margin(counts)
    for index in [(i, j) for i in range(counts.shape[0]) for j in range(counts.shape[1])]:
        c = counts[index].tolist()
        if sum(c) == 0:
            assert math.isnan(float(got[index]))
            continue
        f = sorted((x / sum(c) for x in c), reverse=True)
        assert float(got[index]) == pytest.approx(f[0] - f[1], abs=1e-12)


def test_result_confidence_properties_and_unstable_mark():
    r = _many(fake())
    assert r.label_margin.shape == r.label_stability.shape == (2, 4)
    torch.testing.assert_close(r.label_stability, bootstrap_stability(r.sequence_votes))
    assert r.label_stability.isfinite().all()
    # lower the evidence for one head until its label is unstable
    votes = r.sequence_votes.clone()
    votes[:, 0, 1] = torch.tensor([[2, 2, 0], [0, 3, 0], [3, 0, 0]] * 3)  # Mixer 15 vs Retriever 15: tie → Retriever
    shaky = HeadAnalysis(**{**_fields(r), "sequence_votes": votes, "vote_counts": votes.sum(0).double()})
    assert bool(shaky.unstable[0, 1]) and float(shaky.label_stability[0, 1]) < 0.8
    table = shaky.heads_table()
    assert {"label_margin", "label_stability", "unstable"} <= set(table.columns)
    assert bool(table.loc[(table["layer"] == 3) & (table["head"] == 1), "unstable"].item())
    text = shaky.summary(top=None)
    assert "unstable (stability < 0.8): 1" in text and "?" in text
    assert "NOT a retrieval or induction head" in text and "whatever queries= says" in text


def test_old_results_have_unknown_stability_not_a_crash():
    r = fake(per_sequence=False)
    assert r.label_stability.isnan().all() and not r.unstable.any()
    assert r.label_margin.isfinite().all()
    assert "stability unknown" in r.summary()


def test_sequence_votes_must_add_up_to_the_vote_counts():
    r = fake()
    bad = r.sequence_votes.clone()
    bad[0, 0, 0, 0] += 1
    with pytest.raises(ValueError, match="do not add up to vote_counts"):
        HeadAnalysis(**{**_fields(r), "sequence_votes": bad})


def test_files_keep_the_sequence_votes_and_format_2_still_loads(tmp_path):
    r = _many(fake())
    path = r.save(tmp_path / "r.pt")
    assert torch.load(path, weights_only=True)["format"] == "tl_geometry.HeadAnalysis/9"
    back = HeadAnalysis.load(path)
    assert torch.equal(back.sequence_votes, r.sequence_votes)
    torch.testing.assert_close(back.label_stability, r.label_stability)
    payload = torch.load(path, weights_only=True)
    as_format_2(payload)
    old = tmp_path / "old.pt"
    torch.save(payload, old)
    loaded = HeadAnalysis.load(old)
    assert loaded.sequence_votes is None and loaded.labels == r.labels
    assert loaded.label_stability.isnan().all()
    assert _result_io.FORMAT.endswith("/9")


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_export_rows_match_the_result(tmp_path, suffix):
    r = _many(fake())
    path = r.export_labels(tmp_path / f"labels{suffix}")
    if suffix == ".csv":
        rows = pd.read_csv(path)
    else:
        payload = json.loads(path.read_text())
        assert payload["format"] == LABELS_FORMAT and payload["columns"] == list(EXPORT_COLUMNS)
        rows = pd.DataFrame(payload["heads"])
    assert list(rows.columns) == list(EXPORT_COLUMNS)
    assert len(rows) == r.n_layers * r.n_heads
    for row in rows.itertuples():
        li = r.layers.index(row.layer)
        assert row.label == r.label(row.layer, row.head)
        fractions = r.vote_fractions[li, row.head].tolist()
        assert [row.vote_current, row.vote_sink, row.vote_other] == pytest.approx(fractions, abs=1e-12)
        assert row.margin == pytest.approx(float(r.label_margin[li, row.head]), abs=1e-12)
        assert row.stability == pytest.approx(float(r.label_stability[li, row.head]), abs=1e-12)
        assert 0 <= row.stability <= 1 and 0 <= row.margin <= 1


def test_export_with_scores_and_bad_paths(tmp_path):
    r = fake()
    scores = _fake_scores(r)
    rows = pd.read_csv(r.export_labels(tmp_path / "l.csv", scores=scores))
    assert list(rows.columns) == [*EXPORT_COLUMNS, *tl_geometry.functional.head_scores.SCORE_NAMES]
    payload = json.loads(r.export_labels(tmp_path / "l.json", scores=scores).read_text())
    assert payload["sink_epsilon"] == pytest.approx(scores.attrs["sink_epsilon"])
    with pytest.raises(ValueError, match=r"\.csv or \.json"):
        r.export_labels(tmp_path / "labels.txt")
    with pytest.raises(ValueError, match="head_scores"):
        r.export_labels(tmp_path / "l.csv", scores=pd.DataFrame({"x": [1]}))


def test_unlabelled_heads_export_empty_label_and_no_stability(tmp_path):
    r = fake()
    votes = r.sequence_votes.clone()
    votes[:, 1, 2] = 0
    r2 = HeadAnalysis(**{**_fields(r), "sequence_votes": votes, "vote_counts": votes.sum(0).double()})
    rows = pd.read_csv(r2.export_labels(tmp_path / "l.csv"))
    row = rows[(rows["layer"] == 5) & (rows["head"] == 2)].iloc[0]
    assert pd.isna(row.label) and pd.isna(row.stability) and pd.isna(row.margin)
    payload = json.loads(r2.export_labels(tmp_path / "l.json").read_text())
    head = next(h for h in payload["heads"] if h["layer"] == 5 and h["head"] == 2)
    assert head["label"] is None and head["stability"] is None


def test_top_filters_by_class():
    r = fake()
    for label in CLASSES:
        chosen = r.top(10, by="vote_current", label=label)
        assert len(chosen) == sum(row.count(label) for row in r.labels)
        assert (chosen.label == label).all()
        assert chosen.vote_current.is_monotonic_decreasing
    assert len(r.top(1, by="f_gain", label="Mixer")) == 1
    with pytest.raises(UnknownNameError, match="Retriever"):
        r.top(3, label="retrieval")


def test_selection_attributes_read_like_keys():
    r = _many(fake())
    s = r.sel(layer=5, n=2)
    assert torch.equal(s.f_score, s["f_score"]) and s.label == s["label"]
    assert torch.equal(s.label_stability, s["label_stability"])
    assert "f_score" in dir(s)
    with pytest.raises(AttributeError, match="valid: "):
        _ = s.no_such_quantity
    assert s.coords["layer"] == 5 and s.dims == ("head",)


def test_label_agreement_cross_tab_and_spearman():
    r = fake()
    scores = _fake_scores(r)
    agreement = tl_geometry.label_agreement(r, scores)
    table = r.heads_table(scores=scores)
    mean = agreement["mean"]
    for c in CLASSES:
        assert mean.loc[c, "induction"] == pytest.approx(table[table.label == c].induction.mean())
    high = table[table.induction > 0.3]
    share = agreement["share_high"].loc["induction"]
    assert share["heads"] == len(high)
    for c in CLASSES:
        assert share[c] == pytest.approx((high.label == c).mean())
    # the fake's induction score is its current-token vote fraction: ρ = 1
    assert agreement["spearman"].loc["vote_current", "induction"] == pytest.approx(1.0)


def test_accumulator_keeps_per_sequence_votes_at_their_offsets_and_merges():
    case = make_case(0, batch=4, n_pos=10)
    whole = tl_geometry.analyze_heads(case.cache(), n_values=(2,), random_samples=2)
    assert whole.sequence_votes.shape == (4, 1, 4, 3) and whole.sequence_votes.dtype == torch.int32
    assert torch.equal(whole.sequence_votes.sum(0).double(), whole.vote_counts)
    # two halves analysed apart land in their own rows; merging adds them to the whole
    halves = []
    for lo, hi in ((0, 2), (2, 4)):
        part = make_case(0, batch=4, n_pos=10)
        cache = {k: v[lo:hi] for k, v in part.cache().items()}
        res = tl_geometry.analyze_heads(cache, n_values=(2,), random_samples=2)
        acc = Accumulator.zeros(1, 4, 1)
        acc.sequence_votes = torch.zeros(hi, 1, 4, 3, dtype=torch.int64)
        acc.sequence_votes[lo:hi] = res.sequence_votes.long()
        halves.append(acc)
    merged = halves[0].merge(halves[1])
    assert torch.equal(merged.sequence_votes.int(), whole.sequence_votes)


def test_report_has_confidence_and_agreement_sections(tmp_path):
    pytest.importorskip("matplotlib")
    from tl_geometry.views.report import write_report

    r = fake(metadata={"n_positions": 64})
    scores = _fake_scores(r)
    index = write_report(r, tmp_path / "rep", scores=scores)
    page = index.read_text()
    assert "Do the labels agree with other detectors?" in page and "Label confidence" in page
    assert "NOT a retrieval or induction head" in page and "scores: previous_token" in page
    assert (tmp_path / "rep" / "labels.csv").is_file()
    assert "induction" in pd.read_csv(tmp_path / "rep" / "heads.csv").columns
    without = write_report(r, tmp_path / "plain").read_text()
    assert "Do the labels agree" not in without and "Label confidence" in without


def _many(r: HeadAnalysis, times: int = 3) -> HeadAnalysis:
    """``r`` (the fake's 3 sequences) with its sequences repeated ``times`` times: the same labels
    from 9 sequences, enough units for a stability (SPEC §5: none below 8)."""
    votes = r.sequence_votes.repeat(times, 1, 1, 1)
    return HeadAnalysis(**{**_fields(r), "sequence_votes": votes, "vote_counts": votes.sum(0).double()})


def _fields(r: HeadAnalysis) -> dict:
    from dataclasses import fields

    return {f.name: getattr(r, f.name) for f in fields(r)}


def _fake_scores(r: HeadAnalysis) -> pd.DataFrame:
    """A head-score table whose induction score is the head's current-token vote fraction."""
    table = r.heads_table()
    frame = pd.DataFrame({"layer": table.layer, "head": table["head"],
                          "previous_token": 0.1, "duplicate_token": 0.2,
                          "induction": table.vote_current, "sink_rate": table.vote_sink,
                          "retrieval": 0.0})
    frame.attrs.update(sink_epsilon=0.5, epsilon=0.3, repeat=32)
    return frame
