"""The random baseline's standard errors (SPEC §3): over sequences, and Monte Carlo from its
``R`` subsets per query. Both backends against the loop reference, which draws the engine's
subsets (:mod:`streams`)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from cases import make_case
from reference import METRICS, TRUNCATION, ref_analyze
from streams import engine_randoms

import tl_geometry
from tl_geometry.result.io import FORMAT_VERSION

N_VALUES = (1, 2, 3, 5)
SAMPLES = 4


def _analyze(case, backend: str, samples: int = SAMPLES, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weak sinks, N beyond the sequence: as they say
        return tl_geometry.analyze_heads(case.cache(), n_values=N_VALUES, attention_mask=case.attention_mask,
                                         backend=backend, random_samples=samples, **options)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize(("queries", "case_options"), [
    ("last", {"batch": 3, "ties": True, "duplicates": True, "sink": True}),
    ("all", {"batch": 2, "padding": "left", "n_kv": 1}),
    ("all", {"batch": 3, "padding": "right", "window": 5, "sink": True}),
])
def test_baseline_errors_equal_the_reference(backend, queries, case_options):
    """Every metric's two standard errors, at every (head, N), equal the loop reference's: the
    per-query variance of the mean of the R subsets, summed over a sequence's queries over Q²,
    and the spread of the per-sequence means."""
    case = make_case(31, **case_options)
    window = case_options.get("window")
    result = _analyze(case, backend, queries=queries, window=window)
    mask = None if case.attention_mask is None else case.attention_mask.numpy()
    want = ref_analyze(case.pattern.double().numpy(), case.v.double().numpy(), N_VALUES, queries=queries,
                       attention_mask=mask, window=window, randoms=engine_randoms(0, 0, mask, SAMPLES))
    for m in METRICS + TRUNCATION:
        for kind in ("sequences", "monte_carlo"):
            got = result.baseline_error(m, kind)[0].numpy()
            expected = want[f"random_se_{kind}_{m}"]
            # atol: s² = (Σx² − (Σx)²/R)/(R − 1) cancels where the draws nearly agree (√ of ~1e-17)
            np.testing.assert_allclose(got, expected, rtol=1e-7, atol=2e-8, equal_nan=True, err_msg=f"{kind} {m}")
        # The baselines carry no truncation figures (SPEC §10), so neither do their errors.
        assert np.isfinite(result.baseline_error(m, "monte_carlo")[0].numpy()).any() == (m not in TRUNCATION), m


def test_one_subset_has_no_monte_carlo_error_and_one_sequence_no_spread():
    case = make_case(5, batch=2)
    one_draw = _analyze(case, "numba", samples=1)
    assert torch.isnan(one_draw.baseline_error("f_score")).all()
    assert torch.isfinite(one_draw.baseline_error("f_score", "sequences")[..., 0]).all()
    one_sequence = _analyze(make_case(5, batch=1), "numba")
    assert torch.isnan(one_sequence.baseline_error("f_score", "sequences")).all()
    assert torch.isfinite(one_sequence.baseline_error("f_score")[..., 0]).all()


def test_more_subsets_shrink_the_monte_carlo_error():
    """R = 64 against R = 4 on the same queries: the Monte Carlo error falls by about √16 = 4
    (between 2× and 8× on the median over heads and N)."""
    case = make_case(9, batch=4, n_pos=20)
    few, many = _analyze(case, "numba", samples=4), _analyze(case, "numba", samples=64)
    ratio = (few.baseline_error("f_score") / many.baseline_error("f_score")).nanmedian()
    assert 2 < ratio < 8, ratio


def test_baseline_errors_are_saved_and_older_files_read_nan(tmp_path):
    result = _analyze(make_case(3), "numba")
    assert FORMAT_VERSION >= 8
    back = tl_geometry.HeadAnalysis.load(result.save(tmp_path / "r.pt"))
    torch.testing.assert_close(back.baseline_se, result.baseline_se, rtol=0, atol=0, equal_nan=True)
    older = tl_geometry.HeadAnalysis(**{**vars(result), "baseline_se": None})
    assert torch.isnan(older.baseline_error("recall")).all()
    with pytest.raises(ValueError, match="standard error kind"):
        result.baseline_error("f_score", "bootstrap")
    assert torch.isfinite(result.baseline_error("f_score", "sequences")).any()


def test_a_file_that_says_format_7_but_holds_baseline_errors_is_refused(tmp_path):
    from tl_geometry.result import ResultFileError
    from tl_geometry.result.io import checksum

    path = _analyze(make_case(3), "numba").save(tmp_path / "r.pt")
    payload = torch.load(path, weights_only=True)
    payload["format"] = "tl_geometry.HeadAnalysis/7"
    payload["checksum"] = checksum(payload)  # consistent, but relabelled
    torch.save(payload, tmp_path / "relabelled.pt")
    with pytest.raises(ResultFileError, match=r"baseline_se \(format 8\)"):
        tl_geometry.HeadAnalysis.load(tmp_path / "relabelled.pt")
