"""Per-window sink-in / sink-out groups (result format 9) and claim 3 decided on its intervals.

* the engine's per-window ``sink_in`` / ``sink_out`` means against the loop reference, run on
  each sequence alone (its pooled sink groups are then that window's plain means);
* the per-window paired ratios against the engine's own paired figures;
* the file format: a round trip, a format-8 file loading with those groups NaN and no warning,
  and a file that says format 8 but holds them refused;
* the page's side files: an earlier one (4 window groups, without claim 3's slices) still loads;
* claim 3 held, undecided and without an interval (SPEC §8: never decided on a point value).
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from cases import make_case
from reference import METRICS, TRUNCATION, ref_analyze
from repo_paths import REPO
from result_fakes import fake

import tl_geometry
from tl_geometry.engine.paired import BINS_PER_OCTAVE
from tl_geometry.result import io as _result_io
from tl_geometry.result.io import ResultFileError
from tl_geometry.result.schema import GROUPS, PAIRED_FIELDS, WINDOW_GROUPS, names

ROOT = REPO
sys.path.insert(0, str(ROOT / "demos"))

from _reproduce import corpora, plots, saved, sink  # noqa: E402
from _reproduce.document import HELD, NOT_HELD  # noqa: E402
from _reproduce.intervals import NO_INTERVAL, TOO_FEW, UNDECIDED, window_values  # noqa: E402
from _reproduce.protocol import QUICK  # noqa: E402
from _reproduce.study import Study  # noqa: E402

N_VALUES = (1, 2, 3, 5, 8)
IN_OUT = ("sink_in", "sink_out")


def _analyze(case, backend: str, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # N beyond a short sequence or the window is NaN, as it says
        return tl_geometry.analyze_heads(case.cache(), n_values=N_VALUES, attention_mask=case.attention_mask,
                                         random_samples=0, shuffle_samples=0, backend=backend, per_window=True,
                                         **options)


CASES = [
    pytest.param({"sink": True, "ties": True}, {"queries": "last"}, id="last"),
    pytest.param({"sink": True}, {"queries": "all"}, id="all"),
    pytest.param({"padding": "left", "sink": True}, {"queries": "last"}, id="left-padding-last"),
    pytest.param({"padding": "right", "duplicates": True}, {"queries": "all"}, id="right-padding-all"),
    pytest.param({"window": 5, "sink": True}, {"queries": "last", "window": 5}, id="window-last"),
    pytest.param({"window": 5, "padding": "left"}, {"queries": "all", "window": 5}, id="window-all"),
]


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("case_options, options", CASES)
def test_window_sink_groups_equal_the_reference_window_by_window(backend, case_options, options):
    """Each window's sink_in / sink_out mean is the plain mean of the reference's top-N metrics
    over that window's instances with / without the sink in S_N (NaN where it has none); its top
    and sink-removed means are the reference's per-sequence means."""
    case = make_case(40, batch=4, n_pos=14, **case_options)
    result = _analyze(case, backend, **options)
    assert WINDOW_GROUPS == GROUPS and result.window_scores.shape[1] == len(WINDOW_GROUPS)
    metric_names = names()["metric"]
    mask = None if case.attention_mask is None else case.attention_mask.numpy()
    seen = dict.fromkeys(IN_OUT, 0)
    for b in range(case.pattern.shape[0]):  # the reference on one sequence: its pooled groups are the window's
        want = ref_analyze(case.pattern[b:b + 1].double().numpy(), case.v[b:b + 1].double().numpy(), N_VALUES,
                           queries=options["queries"], attention_mask=None if mask is None else mask[b:b + 1],
                           window=options.get("window"))
        for group in ("top", "sink_removed", *IN_OUT):
            for m in (*METRICS, *TRUNCATION):
                got = result.window_scores[b, WINDOW_GROUPS.index(group), metric_names.index(m), 0].double()
                np.testing.assert_allclose(got.numpy(), want[f"{group}_{m}"], rtol=2e-6, atol=2e-6,
                                           equal_nan=True, err_msg=f"window {b} {group} {m}")
        for group in IN_OUT:
            f = result.window_scores[b, WINDOW_GROUPS.index(group), metric_names.index("f_score"), 0]
            # NaN exactly where the window has no instance of the group
            assert torch.equal(torch.isfinite(f), torch.from_numpy(want[f"{group}_count"] > 0)), (b, group)
            seen[group] += int(torch.isfinite(f).sum())
    assert seen["sink_in"] > 0 and seen["sink_out"] > 0  # both groups occur


def test_the_window_groups_split_the_pooled_groups():
    """At the last query a window holds one instance: the pooled sink-in / sink-out mean is the
    mean of the windows' own, and every defined window is in exactly one of the two groups."""
    case = make_case(41, batch=6, n_pos=16, sink=True, padding="left")
    result = _analyze(case, "numba", queries="last")
    metric = names()["metric"].index("f_score")
    per_window = {g: result.window_scores[:, WINDOW_GROUPS.index(g), metric].double() for g in IN_OUT}
    for group in IN_OUT:
        values = per_window[group]
        count = torch.isfinite(values).sum(0)
        assert torch.equal(count.double(), result.count(group).double())
        mean = values.nan_to_num(0.0).sum(0) / count
        torch.testing.assert_close(mean, result.metric("f_score", group).double(), rtol=1e-6, atol=1e-6,
                                   equal_nan=True)
    top = result.window_scores[:, WINDOW_GROUPS.index("top"), metric]
    either = torch.isfinite(per_window["sink_in"]) ^ torch.isfinite(per_window["sink_out"])
    assert torch.equal(either, torch.isfinite(top))


def _sink_case_analysis(backend: str = "numba"):
    case = make_case(42, batch=24, n_pos=24, sink=True, ties=True)
    return _analyze(case, backend, queries="last")


def test_window_ratios_are_the_engines_paired_instances():
    """At the last query a window is one instance: its paired ratio, formed from the per-window
    sink-in and sink-removed F, gives each head's count and halved share exactly and its median
    within the engine's histogram bin (SPEC §3's ∞ / no-ratio rules alike)."""
    result = _sink_case_analysis()
    ratios = sink.window_ratios(result)
    assert ratios is not None and ratios.shape == result.window_scores[:, 0, 0].shape
    med, halved, count = sink._head_figures(ratios)
    assert torch.equal(count.double(), result.paired_sink("count").nan_to_num(0.0).double())
    defined = count > 0
    torch.testing.assert_close(halved[defined], result.paired_sink("halved")[defined].double(),
                               rtol=0, atol=1e-12)
    engine = result.paired_sink("ratio").double()
    both = defined & torch.isfinite(med) & (med > 0)
    assert both.any()
    assert (torch.log2(med[both] / engine[both]).abs() <= 0.5 / BINS_PER_OCTAVE + 1e-9).all()
    assert torch.equal(torch.isinf(med[defined]), torch.isinf(engine[defined]))
    # every head's windows are read: the ratio is defined exactly where the top-N set holds the sink
    f_in = window_values(result, "f_score", "sink_in")
    assert not (torch.isfinite(ratios) & ~torch.isfinite(f_in)).any()


def test_backends_agree_on_the_window_sink_groups():
    a, b = _sink_case_analysis("numba"), _sink_case_analysis("torch")
    torch.testing.assert_close(a.window_scores, b.window_scores, rtol=1e-6, atol=1e-6, equal_nan=True)


# --- the file format ---------------------------------------------------------------------------


def test_format_round_trip_keeps_the_window_sink_groups(tmp_path):
    result = _sink_case_analysis()
    path = result.save(tmp_path / "r.pt")
    payload = torch.load(path, weights_only=True)
    assert payload["format"] == _result_io.FORMAT and _result_io.FORMAT_VERSION >= 9
    assert payload["names"]["window_group"] == list(GROUPS)
    back = tl_geometry.HeadAnalysis.load(path)
    assert torch.equal(back.window_scores.nan_to_num(7.0), result.window_scores.nan_to_num(7.0))


def _as_format_8(payload: dict) -> dict:
    """``payload`` as format 8 wrote it: 4 window groups and nothing a later format added."""
    payload["format"] = "tl_geometry.HeadAnalysis/8"
    for key, since in _result_io._FIELD_SINCE.items():
        if since > 8:
            payload.pop(key, None)
            payload["axes"].pop(key, None)
            payload["names"].pop(key, None)
    payload["window_scores"] = payload["window_scores"][:, :4].clone()
    payload["names"]["window_group"] = payload["names"]["window_group"][:4]
    payload["checksum"] = _result_io.checksum(payload)
    return payload


def test_format_8_files_load_with_the_sink_groups_nan_and_no_warning(tmp_path):
    result = _sink_case_analysis()
    path = result.save(tmp_path / "r.pt")
    old = tmp_path / "old.pt"
    torch.save(_as_format_8(torch.load(path, weights_only=True)), old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = tl_geometry.HeadAnalysis.load(old)
    assert loaded.window_scores.shape == result.window_scores.shape
    assert loaded.window_scores[:, 4:].isnan().all()
    assert torch.equal(loaded.window_scores[:, :4].nan_to_num(7.0), result.window_scores[:, :4].nan_to_num(7.0))
    assert torch.equal(loaded.scores.nan_to_num(7.0), result.scores.nan_to_num(7.0))
    assert sink.window_ratios(loaded) is None  # claim 3: no interval from such a file
    assert "sink_in and sink_removed" not in sink.missing_windows(loaded)  # its sink_removed is there
    assert "no per-window sink_in F_N" in sink.missing_windows(loaded)


def test_a_file_that_says_format_8_but_holds_the_sink_groups_is_refused(tmp_path):
    result = _sink_case_analysis()
    path = result.save(tmp_path / "r.pt")
    payload = _as_format_8(torch.load(path, weights_only=True))
    payload["window_scores"] = torch.load(path, weights_only=True)["window_scores"]
    payload["names"]["window_group"] = list(GROUPS)
    payload["checksum"] = _result_io.checksum(payload)
    relabelled = tmp_path / "relabelled.pt"
    torch.save(payload, relabelled)
    with pytest.raises(ResultFileError, match=r"says format 8 but holds .*sink_in \(format 9\), sink_out \(format 9\)"):
        tl_geometry.HeadAnalysis.load(relabelled)


# --- the page's side files ---------------------------------------------------------------------


def _with_windows(r, n_windows: int):
    r.window_scores = torch.full((n_windows, len(WINDOW_GROUPS), *r.scores.shape[1:]), math.nan, dtype=torch.float64)
    r.window_sink = torch.rand(n_windows, *r.sink.shape, dtype=torch.float64)
    r.metadata.update(n_sequences=n_windows, n_positions=48, queries="last")
    return r


def test_an_earlier_side_file_is_read_without_claim_3s_slices(tmp_path):
    """A side file written before format 9 (4 window groups, no sink-in / sink-removed F slices)
    loads, claim 3's slices NaN: ``--reuse`` does not recompute the analysis for them."""
    r = _with_windows(fake(layers=(0, 1), n_values=(1, 2, 4), bounds=False, per_sequence=False), 12)
    r.window_scores = torch.rand(r.window_scores.shape, dtype=torch.float64)
    path = tmp_path / "m__c.pt"
    earlier = [k for k in saved.KEPT["values"]["window_scores"] if (("window_scores", k) not in saved.OPTIONAL_KEPT)]
    slices = {"window_scores": {"shape": [12, 4, *r.window_scores.shape[2:]],
                                **{"/".join(k): r.window_scores[saved._index("window_scores", k)].float()
                                   for k in earlier}},
              "window_sink": {"shape": list(r.window_sink.shape),
                              **{"/".join(k): r.window_sink[saved._index("window_sink", k)].float()
                                 for k in saved.KEPT["values"]["window_sink"]}}}
    data = saved._serialize(slices)
    import hashlib

    metadata = {**r.metadata, saved.WINDOWS_SHA256: hashlib.sha256(data).hexdigest()}
    tl_geometry.HeadAnalysis(**{**vars(r), "window_scores": None, "window_sink": None, "metadata": metadata}).save(path)
    saved._write_atomic(data, saved.windows_path(path))
    back = saved.load(path, "values")
    assert back is not None and back.window_scores.shape == r.window_scores.shape
    for group, metric in earlier:
        torch.testing.assert_close(window_values(back, metric, group), window_values(r, metric, group).float().double())
    assert window_values(back, "f_score", "sink_in").isnan().all()
    assert window_values(back, "f_score", "sink_removed").isnan().all()
    # Today's writer keeps claim 3's slices.
    saved.save(r, tmp_path / "today.pt", "values")
    today = saved.load(tmp_path / "today.pt", "values")
    torch.testing.assert_close(window_values(today, "f_score", "sink_in"),
                               window_values(r, "f_score", "sink_in").float().double())


# --- claim 3 on intervals ----------------------------------------------------------------------


def _study(ratios: torch.Tensor | None, layers=(0, 1, 2), n_heads: int = 4, n_windows: int = 16) -> Study:
    """A one-run study whose per-window paired ratio at every N is ``ratios`` ``[window, layer, head]``
    (NaN: the sink is not in S_N in that window); None: no per-window arrays."""
    r = fake(layers=layers, n_heads=n_heads, n_values=(1, 2, 4, 8, 16), per_sequence=False,
             metadata={"n_positions": 48, "n_sequences": n_windows})
    r.paired[PAIRED_FIELDS.index("ratio")] = 0.3  # the engine's point figures: not what decides
    r.paired[PAIRED_FIELDS.index("halved")] = 0.7
    r.paired[PAIRED_FIELDS.index("count")] = float(n_windows)
    if ratios is not None:
        r = _with_windows(r, n_windows)
        f = names()["metric"].index("f_score")
        removed = torch.full_like(ratios, 0.8)
        for group, values in (("sink_removed", removed), ("sink_in", 0.8 * ratios)):
            r.window_scores[:, WINDOW_GROUPS.index(group), f] = values[..., None]
    corpus = corpora.Corpus("c", "text", "a fake corpus")
    return Study(replace(QUICK, n_windows=n_windows, seq_len=48), {"c": corpus}, {("m", "c"): r})


@pytest.fixture(autouse=True)
def _no_figures(monkeypatch):
    monkeypatch.setattr(plots, "grid", lambda *a, **k: None)


def test_claim3_holds_where_the_whole_interval_is_below(tmp_path):
    g = torch.Generator().manual_seed(0)
    ratios = 0.2 + 0.25 * torch.rand(16, 3, 4, generator=g, dtype=torch.float64)  # every window halves
    ratios[torch.rand(16, 3, 4, generator=g) < 0.2] = math.nan  # some windows do not hold the sink
    ratios[:, 0, 0] = math.nan  # a head whose sink is never in S_N: not in the median
    study = _study(ratios)
    r = study.analyses["m", "c"]
    spreads = sink.paired_spread(r, [(2, 1), (4, 2), (8, 3)], sink.MIN_PAIRED)
    spread = spreads[4]
    assert spread.windows == 16 and spread.point.heads == 11
    assert spread.ratio.high <= sink.LOWERS and spread.halved.low >= sink.HALVING_SHARE
    assert spread.ratio.low <= spread.ratio.value <= spread.ratio.high
    # the point figures: each head's lower median over its sink-holding windows, the median over heads
    heads = [ratios[:, li, h][~ratios[:, li, h].isnan()].sort().values for li in range(3) for h in range(4)]
    lower = [float(x[(len(x) - 1) // 2]) for x in heads if len(x) >= sink.MIN_PAIRED]
    assert spread.point.ratio == pytest.approx(float(torch.tensor(lower).quantile(0.5)))
    assert sink.interval_checks(list(spreads.values())) == (HELD, HELD)
    claim = sink.claim3(study, tmp_path)
    assert claim.verdict == HELD
    assert "on its 95 % interval over windows, on 1/1 runs" in claim.because
    table = claim.blocks[0]
    assert "median paired ratio [95 %]" in table and "| 16 | 11 |" in table and "no interval" not in table
    # seeded: the same intervals again
    assert sink.paired_spread(r, [(4, 2)], sink.MIN_PAIRED)[4] == spread


def test_claim3_is_undecided_where_the_interval_straddles_the_threshold(tmp_path):
    g = torch.Generator().manual_seed(1)
    # each head's windows: half at 0.7, half at 1.1, in its own order (its lower median is 0.7)
    ratios = torch.stack([torch.tensor([0.7] * 8 + [1.1] * 8, dtype=torch.float64)[torch.randperm(16, generator=g)]
                          for _ in range(12)], dim=1).reshape(16, 3, 4)
    study = _study(ratios)
    spread = sink.paired_spread(study.analyses["m", "c"], [(2, 1), (4, 2), (8, 3)], sink.MIN_PAIRED)[2]
    assert spread.ratio.value == pytest.approx(0.7)
    assert spread.ratio.low < sink.LOWERS < spread.ratio.high
    claim = sink.claim3(study, tmp_path)
    assert claim.verdict.startswith(UNDECIDED)
    notes = " ".join(claim.disagreements)
    assert "not wholly ≤ 0.9" in notes and "rarely halves" in notes  # no window halves F_N


def test_claim3_is_not_held_where_the_sink_changes_nothing(tmp_path):
    study = _study(torch.ones(16, 3, 4, dtype=torch.float64))
    assert sink.claim3(study, tmp_path).verdict == NOT_HELD


def test_claim3_reads_the_inf_and_no_ratio_rules():
    """SPEC §3: ∞ where only the sink-removed F is 0, no ratio where both are."""
    study = _study(torch.full((16, 3, 4), 0.5, dtype=torch.float64))
    r = study.analyses["m", "c"]
    f = names()["metric"].index("f_score")
    i, o = WINDOW_GROUPS.index("sink_in"), WINDOW_GROUPS.index("sink_removed")
    r.window_scores[0, o, f] = 0.0
    r.window_scores[0, i, f] = 0.3
    r.window_scores[1, o, f] = 0.0
    r.window_scores[1, i, f] = 0.0
    ratios = sink.window_ratios(r)
    assert torch.isinf(ratios[0]).all() and ratios[1].isnan().all() and (ratios[2:] == 0.5).all()


def test_claim3_without_per_window_values_prints_points_and_no_verdict(tmp_path):
    for study in (_study(None), _study(torch.full((16, 3, 4), math.nan, dtype=torch.float64))):
        r = study.analyses["m", "c"]
        assert sink.paired_spread(r, [(2, 1)], sink.MIN_PAIRED) is None
        claim = sink.claim3(study, tmp_path)
        assert claim.verdict == NO_INTERVAL
        table = claim.blocks[0]
        assert "0.300 (no interval)" in table and "70.0 % (no interval)" in table
        notes = " ".join(claim.disagreements)
        assert "no interval and not decided" in notes
        assert "python demos/reproduce.py without --reuse" in notes
    assert "keeps no per-window values" in " ".join(sink.claim3(_study(None), tmp_path).disagreements)
    old = " ".join(sink.claim3(_study(torch.full((16, 3, 4), math.nan, dtype=torch.float64)),
                               tmp_path).disagreements)
    assert "no per-window sink_in F_N" in old


def test_claim3_with_fewer_than_8_heads_is_too_few(tmp_path):
    study = _study(torch.full((16, 1, 4), 0.3, dtype=torch.float64), layers=(0,))
    spread = sink.paired_spread(study.analyses["m", "c"], [(2, 1)], sink.MIN_PAIRED)[2]
    assert spread.point.heads == 4 and spread.ratio.too_few and spread.ratio.n == 4
    claim = sink.claim3(study, tmp_path)
    assert claim.verdict == TOO_FEW and "(n = 4, too few)" in claim.blocks[0]


def test_claim3_on_a_real_analysis_is_decided_on_its_windows(tmp_path):
    """A computed analysis with per-window arrays gets intervals (the last query, 24 windows)."""
    result = _sink_case_analysis()
    corpus = corpora.Corpus("c", "text", "a fake corpus")
    study = Study(replace(QUICK, n_windows=24, seq_len=24), {"c": corpus}, {("m", "c"): result})
    spreads = sink.paired_spread(result, [(2, N_VALUES.index(2)), (5, N_VALUES.index(5))], sink.MIN_PAIRED)
    assert spreads is not None and all(s.windows == 24 for s in spreads.values())
    claim = sink.claim3(study, tmp_path)
    assert claim.verdict != NO_INTERVAL and "no interval" not in claim.blocks[0]
