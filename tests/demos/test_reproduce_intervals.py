"""demos/_reproduce/intervals.py: the bootstrap over windows and the three-outcome verdicts of
SPEC §8, on synthetic numbers (no model, no saved results)."""

from __future__ import annotations

import functools
import itertools
import math
import sys

import pytest
import torch
from repo_paths import REPO, TESTS

sys.path.insert(0, str(REPO / "demos"))
sys.path.insert(0, str(TESTS))

from _reproduce import intervals
from _reproduce.intervals import (
    HELD,
    NOT_HELD,
    PARTLY,
    TOO_FEW,
    UNDECIDED,
    Interval,
    blocks,
    bootstrap,
    categorize,
    combine,
    decide,
)


def _mean_of(values: torch.Tensor):
    return lambda idx: float(values[idx].mean())


def test_same_seed_same_interval_and_another_seed_another():
    values = torch.randn(64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a = bootstrap(_mean_of(values), 64, seed=3)
    assert a == bootstrap(_mean_of(values), 64, seed=3)
    assert a != bootstrap(_mean_of(values), 64, seed=4)
    torch.manual_seed(123)  # the global generator does not enter
    assert a == bootstrap(_mean_of(values), 64, seed=3)


def test_interval_covers_the_mean_with_the_width_of_its_standard_error():
    values = torch.randn(400, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    iv = bootstrap(_mean_of(values), 400, resamples=1000)
    se = float(values.std() / math.sqrt(400))
    assert iv.value == pytest.approx(float(values.mean()))
    assert iv.low < iv.value < iv.high and iv.n == 400
    assert (iv.high - iv.low) == pytest.approx(2 * 1.96 * se, rel=0.15)


def test_constant_data_gives_a_point_interval_and_statistics_over_heads_stay_fixed():
    # 12 windows × 3 heads; the statistic is the median over heads of each head's mean over the
    # drawn windows, recomputed in every resample.
    per_window = torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64).expand(12, 3)
    iv = bootstrap(lambda idx: float(per_window[idx].mean(0).median()), 12)
    assert (iv.value, iv.low, iv.high) == (0.5, 0.5, 0.5)


def test_fewer_than_eight_units_is_too_few():
    values = torch.arange(7.0)
    iv = bootstrap(_mean_of(values), 7)
    assert iv.too_few and math.isnan(iv.low) and iv.value == 3.0
    assert decide(iv, low=0.0) == TOO_FEW and categorize(iv) == TOO_FEW
    assert iv.show() == "3.000 (n = 7, too few)"
    assert not bootstrap(_mean_of(torch.arange(8.0)), 8).too_few


def test_undefined_resamples_are_left_out_and_none_defined_is_undecided():
    values = torch.tensor([math.nan] * 9 + [1.0], dtype=torch.float64)
    iv = bootstrap(lambda idx: float(values[idx].nanmean()), 10)
    assert iv.low == iv.high == 1.0  # resamples that drew only NaN windows are skipped
    never = bootstrap(lambda idx: math.nan, 10)
    assert math.isnan(never.low) and decide(never, low=0.0) == UNDECIDED


def test_three_outcomes_of_a_threshold_rule():
    assert decide(Interval(0.3, 0.2, 0.4, 64), low=0.1) == HELD
    assert decide(Interval(0.3, 0.2, 0.4, 64), low=0.5) == NOT_HELD
    assert decide(Interval(0.3, 0.05, 0.4, 64), low=0.1) == UNDECIDED  # straddles the threshold
    assert decide(Interval(0.1, 0.06, 0.16, 64), low=0.058, high=0.172) == HELD  # a range
    assert decide(Interval(0.1, 0.05, 0.16, 64), low=0.058, high=0.172) == UNDECIDED
    assert decide(Interval(0.3, 0.2, 0.4, 64), high=0.1) == NOT_HELD


def test_geometry_gap_categories_and_undecided_between_neighbours():
    # SmolLM2's gap of SPEC §8: −0.053 ± 0.006 is not "lowers" on its interval.
    assert categorize(Interval(-0.053, -0.065, -0.041, 64)) == "undecided between lowers and no effect"
    assert categorize(Interval(-0.17, -0.19, -0.15, 64)) == "lowers"
    assert categorize(Interval(0.01, -0.02, 0.03, 64)) == "no effect"
    assert categorize(Interval(0.09, 0.07, 0.11, 64)) == "raises"
    assert categorize(Interval(0.05, 0.04, 0.06, 64)) == "undecided between no effect and raises"
    assert categorize(Interval(0.0, -0.1, 0.1, 64)) == "undecided between lowers and raises"


def test_blocks_of_128_queries_drop_partial_blocks():
    rows = blocks([300, 128, 100, 256])
    assert rows.shape == (2 + 1 + 0 + 2, 128)
    assert rows[0, 0] == 0 and rows[1, -1] == 255  # window 1: queries 0–255; 256–299 dropped
    assert rows[2, 0] == 300  # window 2 starts after the 300 queries of window 1
    assert rows[3, 0] == 300 + 128 + 100 and rows[-1, -1] == 300 + 128 + 100 + 255
    assert blocks([]).shape == (0, 128)


def test_claim_verdict_from_three_outcome_checks():
    assert combine({"a": [HELD, HELD], "b": [HELD]}, "a") == HELD
    assert combine({"a": [NOT_HELD, NOT_HELD], "b": [HELD]}, "a") == NOT_HELD
    assert combine({"a": [HELD, NOT_HELD], "b": [HELD]}, "a") == PARTLY
    # An undecided check that could make the claim held or partly held leaves it undecided.
    assert combine({"a": [HELD, UNDECIDED], "b": [HELD]}, "a") == f"{UNDECIDED} ({PARTLY} or {HELD})"
    # ... but not where the verdict is the same either way.
    assert combine({"a": [HELD, NOT_HELD], "b": [UNDECIDED]}, "a") == PARTLY
    # Too few carries no verdict: left out, and a core check with nothing left is too few.
    assert combine({"a": [HELD, TOO_FEW], "b": [HELD]}, "a") == HELD
    assert combine({"a": [TOO_FEW], "b": [HELD]}, "a") == TOO_FEW


def test_the_protocol_constants_are_the_spec_s():
    assert (intervals.RESAMPLES, intervals.MIN_UNITS, intervals.BLOCK, intervals.LEVEL) == (1000, 8, 128, 0.95)


def test_claim_verdict_with_its_own_rule_and_without_intervals():
    from _reproduce.intervals import NO_INTERVAL

    def rule(checks):  # held when every check holds; not held when none holds anywhere
        if all(all(v) for v in checks.values()):
            return HELD
        return NOT_HELD if not any(any(v) for v in checks.values()) else PARTLY

    assert combine({"a": [NOT_HELD], "b": [NOT_HELD]}, rule) == NOT_HELD
    assert combine({"a": [NOT_HELD], "b": [UNDECIDED]}, rule) == f"{UNDECIDED} ({NOT_HELD} or {PARTLY})"
    # A check without intervals is not decided on its point value: it is left out.
    assert combine({"a": [HELD], "b": [NO_INTERVAL]}, rule) == HELD
    assert combine({"a": [NO_INTERVAL], "b": [TOO_FEW]}, rule) == TOO_FEW


def test_claim5_shares_are_recomputed_from_the_drawn_windows_votes():
    from types import SimpleNamespace

    from _reproduce.taxonomy import DOMINANCE, _share_intervals

    # 16 windows × 1 layer × 10 heads, votes (current, sink, other). Heads 0–7 are Resets in every
    # window, head 8 a Retriever; head 9 is a Retriever in half the windows and a Mixer in the
    # other half, with equal totals (a tie, which SPEC §5 gives to the Retriever).
    votes = torch.zeros(16, 1, 10, 3, dtype=torch.int32)
    votes[:, 0, :8, 2] = 5
    votes[:, 0, 8, 0] = 5
    votes[::2, 0, 9, 0] = 5
    votes[1::2, 0, 9, 1] = 5
    spread = _share_intervals(SimpleNamespace(sequence_votes=votes))
    retriever = spread["retriever"]
    assert retriever.value == pytest.approx(0.2) and retriever.n == 16
    assert retriever.low == pytest.approx(0.1) and retriever.high == pytest.approx(0.2)  # head 9 flips
    assert decide(retriever, 0.058, 0.172) == UNDECIDED
    assert categorize(spread["dominance"], DOMINANCE) == "Reset"
    few = _share_intervals(SimpleNamespace(sequence_votes=votes[:5]))
    assert few["retriever"].too_few and decide(few["retriever"], 0.058, 0.172) == TOO_FEW
    assert _share_intervals(SimpleNamespace(sequence_votes=None)) == {}  # no per-window votes saved


def test_claim5c_compares_the_classes_sink_mass_over_the_drawn_windows():
    """(c): α_sink(Mixer) − max(α_sink(Retriever), α_sink(Reset)), labels and masses from the same
    drawn windows; held when the Mixers' mass is clearly larger, not held when clearly smaller,
    no interval without per-window sink figures."""
    from types import SimpleNamespace

    from _reproduce.taxonomy import _sink_interval

    from tl_geometry.functional.sink import SINK_FIELDS

    gen = torch.Generator().manual_seed(4)
    votes = torch.zeros(16, 1, 6, 3, dtype=torch.int32)
    votes[:, 0, :2, 1] = 5  # Mixers
    votes[:, 0, 2:4, 0] = 5  # Retrievers
    votes[:, 0, 4:, 2] = 5  # Resets
    sink = torch.full((16, len(SINK_FIELDS), 1, 6), torch.nan)
    sink[:, 0] = 0.1 + 0.02 * torch.rand(16, 1, 6, generator=gen)
    sink[:, 0, 0, :2] += 0.5  # the Mixers attend the sink most
    held = _sink_interval(SimpleNamespace(sequence_votes=votes, window_sink=sink))
    assert held.value == pytest.approx(0.5, abs=0.03) and held.n == 16 and decide(held, low=0.0) == HELD
    sink[:, 0, 0, :2] -= 0.55  # now the least
    assert decide(_sink_interval(SimpleNamespace(sequence_votes=votes, window_sink=sink)), low=0.0) == NOT_HELD
    assert _sink_interval(SimpleNamespace(sequence_votes=votes, window_sink=None)) is None
    votes[:, 0, :2] = votes[:, 0, 2:3]  # no Mixer left: nothing to compare
    assert math.isnan(_sink_interval(SimpleNamespace(sequence_votes=votes, window_sink=sink)).value)


def test_several_numbers_from_the_same_resamples():
    from _reproduce.intervals import bootstraps

    values = torch.randn(32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mean, shifted = bootstraps(lambda idx: torch.stack([values[idx].mean(), values[idx].mean() + 1]), 32)
    assert mean == bootstrap(_mean_of(values), 32)  # one pass over the same draws
    assert shifted.low == pytest.approx(mean.low + 1) and shifted.high == pytest.approx(mean.high + 1)


# --- the claims' intervals from per-window arrays (window_scores, window_sink) ------------------


def _windowed(top, shuffled, random, ns=(2,)):
    """A result-like object with per-window arrays ``[window, layer, head, n]`` for the top,
    shuffled and random groups of F∗ (the other groups and metrics NaN)."""
    from types import SimpleNamespace

    from tl_geometry.result.schema import WINDOW_GROUPS, names

    metrics = names()["metric"]
    scores = torch.full((top.shape[0], len(WINDOW_GROUPS), len(metrics), *top.shape[1:]), math.nan)
    for group, values in (("top", top), ("shuffled", shuffled), ("random", random)):
        scores[:, WINDOW_GROUPS.index(group), metrics.index("f_score_cc")] = values
    return SimpleNamespace(window_scores=scores, n_values=torch.tensor(ns), headline_n=tuple(ns),
                           metadata={"n_positions": 64})


def test_a_gap_interval_that_straddles_the_threshold_is_undecided_between_two_readings():
    from _reproduce.separability import spread

    # 16 windows × 1 layer × 2 heads at N = 2: F∗(top) − F∗(shuffled) is −0.05 ± 0.03 per window.
    top = torch.full((16, 1, 2, 1), 0.5)
    wobble = torch.tensor([-0.03, 0.03] * 8).reshape(16, 1, 1, 1).expand(16, 1, 2, 1)
    straddle = spread(_windowed(top, top + 0.05 + wobble, top - 0.3))
    gap = straddle.gap[0]
    assert gap.low < -0.05 < gap.high and gap.value == pytest.approx(-0.05)
    assert straddle.reading(0) == "undecided between lowers and no effect"
    assert straddle.lowering == [] and straddle.geometric == NOT_HELD  # it cannot raise
    assert straddle.never_lowers == UNDECIDED  # (a): it may lower
    assert straddle.above_random == HELD and straddle.small == HELD  # gain 0.3; N = 2 is the best
    assert straddle.heads == [2] and straddle.windows == 16
    # A clear gap is decided, both ways.
    clear = spread(_windowed(top, top + 0.2 + wobble, top - 0.3))
    assert clear.reading(0) == "lowers" and clear.lowering == [2] and clear.never_lowers == NOT_HELD
    raised = spread(_windowed(top, top - 0.2 + wobble, top - 0.3))
    assert raised.reading(0) == "raises" and raised.geometric == HELD and raised.never_lowers == HELD
    # The gain over random (the attention ranking's) is read apart and decides none of (a)–(c).
    below = spread(_windowed(top, top - 0.2 + wobble, top + 0.3))
    assert below.above_random == NOT_HELD and below.gain[0].value == pytest.approx(-0.3)
    assert (below.never_lowers, below.geometric, below.small) == (raised.never_lowers, raised.geometric,
                                                                    raised.small)
    # Too few windows: no verdict; no per-window arrays: no interval at all.
    few = spread(_windowed(top[:5], top[:5] + 0.2, top[:5] - 0.3))
    assert few.reading(0) == TOO_FEW and few.above_random == TOO_FEW and few.never_lowers == TOO_FEW
    from types import SimpleNamespace
    assert spread(SimpleNamespace(window_scores=None, n_values=torch.tensor([2]), headline_n=(2,),
                                  metadata={})) is None


def test_the_gap_interval_comes_from_the_analysis_own_windows():
    """On a real analysis (analyze_heads with per_window=True), the interval's point value is
    claim 1's mean over heads of the saved means, and resampling moves it."""
    from _reproduce.separability import measure, spread
    from cases import make_case

    import tl_geometry

    case = make_case(0, batch=10, n_pos=40, sink=True)
    r = tl_geometry.analyze_heads(case.cache(), per_window=True, n_values=[1, 2, 4, 8],
                                  random_samples=4, shuffle_samples=4, queries="last")
    m, sp = measure(r), spread(r)
    assert sp.ns == [2, 4, 8]
    for k, i in enumerate(m.headline):
        assert sp.gap[k].value == pytest.approx(m.geometry[i], abs=1e-6)
        assert sp.gap[k].low <= sp.gap[k].value <= sp.gap[k].high and sp.gap[k].n == 10
    assert sp == spread(r)  # seeded


def test_claim4_intervals_come_from_the_analysis_own_windows():
    """Claim 4's thresholded numbers on a real analysis with per-window bounds: each interval's
    point value is the figure the rule reads on the saved means (the smallest within-N ρ, the
    best-N excess, ρ(c_sink, R_2)) for the §6b envelope, which decides, and for the shell bounds,
    reported; an analysis without per-window bounds has the sink's only."""
    from dataclasses import replace

    from _reproduce.certificates import ENVELOPE, SHELLS, intervals, measure
    from cases import make_case

    import tl_geometry

    case = make_case(2, batch=12, n_pos=40, sink=True, n_heads=8, n_kv=8)
    r = tl_geometry.analyze_heads(case.cache(), per_window=True, bounds=True, n_values=[1, 2, 4, 8],
                                  random_samples=4, shuffle_samples=4, queries="last")
    spread, point = intervals(r), measure(r)
    fits = {ENVELOPE: point.envelope, **{kind: point.shells[kind] for kind, _ in SHELLS}}
    for kind, fit in fits.items():
        assert spread[f"{kind} rho"].value == pytest.approx(fit.rho_min, abs=1e-6)
        assert spread[f"{kind} excess"].value == pytest.approx(fit.best.excess, abs=1e-9)
        assert spread[f"{kind} rho"].n == 12
    assert spread["sink rho"].value == pytest.approx(point.sink_recall[2], abs=1e-6)
    assert spread["sink rho"].low <= spread["sink rho"].value <= spread["sink rho"].high
    assert set(intervals(replace(r, window_bounds=None))) == {"sink rho"}


def test_claim4_best_n_excess_interval_is_the_bca_one():
    """SPEC §8 (2026-12-06): the best-N excess over chance, a statistic whose resamples can lie
    mostly on one side of its point, gets the BCa interval over windows — the same ends as
    :func:`.intervals.bca` on the same draws and leave-one-out values of the excess, recomputed
    here from the per-window envelope and F_N."""
    from _reproduce.certificates import ENVELOPE, intervals
    from _reproduce.intervals import bca, draws, window_values
    from cases import make_case

    import tl_geometry
    from tl_geometry.result import BOUND_KINDS
    from tl_geometry.result.tables import argmax_n
    from tl_geometry.result.tracking import agreement_vs_chance

    case = make_case(2, batch=12, n_pos=40, sink=True, n_heads=8, n_kv=8)
    r = tl_geometry.analyze_heads(case.cache(), per_window=True, bounds=True, n_values=[1, 2, 4, 8],
                                  random_samples=4, shuffle_samples=4, queries="last")
    f_score = window_values(r, "f_score")
    envelope = r.window_bounds[:, BOUND_KINDS.index(ENVELOPE), 2].double()

    def excess(idx: torch.Tensor) -> float:
        measured, bound = f_score[idx].nanmean(0), envelope[idx].nanmean(0)
        return agreement_vs_chance(argmax_n(r, measured, bound=False), argmax_n(r, bound, bound=True),
                                   n_shuffles=1).excess

    units = torch.arange(len(f_score))
    resampled = torch.tensor([excess(idx) for idx in draws(len(units))], dtype=torch.float64)
    left_out = torch.tensor([excess(units[units != i]) for i in units], dtype=torch.float64)
    want = bca(excess(units), resampled, left_out)
    got = intervals(r)[f"{ENVELOPE} excess"]
    assert (got.low, got.high) == pytest.approx(want, abs=1e-12)
    assert got.low <= got.value <= got.high


def _nulls(main_windows, parts, noise=0.0, flip=()):
    """Decomposition-null results whose F∗(top) − F∗(null) per window is ``parts[kind]`` (plus an
    alternating ``noise``, of the opposite phase for the kinds in ``flip``), beside a main
    analysis of ``main_windows`` windows."""
    top = torch.full((main_windows, 1, 2, 1), 0.5)
    wobble = torch.tensor([-noise, noise] * (main_windows // 2)).reshape(-1, 1, 1, 1).expand_as(top)
    return {kind: _windowed(top, top - part + (-wobble if kind in flip else wobble), top)
            for kind, part in parts.items()}


def test_the_mechanism_names_the_largest_part_only_when_its_interval_allows():
    from _reproduce.separability import MECHANISM_UNSAID, mechanism, parts

    main = _windowed(*(torch.zeros(16, 1, 2, 1),) * 3)
    clear = parts(main, _nulls(16, {"norms": -0.02, "directions": -0.04, "unselected": -0.2}, 0.01), 2)
    assert clear["unselected"].high < -0.05
    sentence = mechanism(clear)
    assert sentence.startswith("the largest part is unselected") and "[" in sentence
    # Two parts that move apart from window to window and differ by 0.01 on average: their
    # difference straddles 0, so the largest is not separated and nothing is named.
    close = parts(main, _nulls(16, {"norms": -0.19, "directions": -0.04, "unselected": -0.2}, 0.03,
                               flip=("norms",)), 2)
    assert close["norms − unselected"].low < 0 < close["norms − unselected"].high
    assert mechanism(close).startswith("no mechanism is named") and "norms" in mechanism(close)
    # The largest part does not lower F∗ on its own whole interval.
    weak = parts(main, _nulls(16, {"norms": 0.0, "directions": 0.0, "unselected": -0.05}, 0.03), 2)
    assert mechanism(weak).startswith("no mechanism is named") and "−0.05" in mechanism(weak)
    # Nulls without per-window values, or a null missing: no interval, nothing named.
    old = _nulls(16, {"norms": 0.0, "directions": 0.0, "unselected": -0.2})
    old["norms"].window_scores = None
    assert parts(main, old, 2) is None and mechanism(None) == MECHANISM_UNSAID
    assert parts(main, {"norms": old["directions"]}, 2) is None


@functools.lru_cache(maxsize=1)
def _analysis():
    """One small analysis with per-window arrays (12 windows of 40 tokens, 1 layer, 4 heads
    sharing 2 KV heads, a compressed sink), computed once for the tests below."""
    from cases import make_case

    import tl_geometry

    case = make_case(1, batch=12, n_pos=40, sink=True)
    return tl_geometry.analyze_heads(case.cache(), per_window=True, n_values=[1, 2, 4, 8],
                                     random_samples=4, shuffle_samples=4, queries="last")


def _sink_study(weak: bool | None):
    """A one-run study of a real analysis with per-window arrays; its sink check set to a weak
    sink (True), a strong one (False) or absent (None: a file written before the check)."""
    from dataclasses import replace

    from _reproduce import corpora
    from _reproduce.protocol import QUICK
    from _reproduce.study import Study

    r = replace(_analysis(), metadata=dict(_analysis().metadata))  # one analysis, copied
    if weak is None:
        r.metadata.pop("sink", None)
    else:
        r.metadata["sink"] = {**r.metadata.get("sink", {}), "weak": weak}
    corpus = corpora.Corpus("c", "text", "a fake corpus")
    return Study(replace(QUICK, n_windows=12, seq_len=40), {"c": corpus}, {("m", "c"): r})


def test_a_weak_sink_makes_the_sink_claims_no_sink(tmp_path, monkeypatch):
    from _reproduce import plots, sink
    from _reproduce.intervals import NO_INTERVAL, NO_SINK, weak_sink

    monkeypatch.setattr(plots, "grid", lambda *a, **k: None)  # no figure: fast
    weak = _sink_study(True)
    assert weak_sink(weak.analyses["m", "c"])
    for claim in (sink.claim2, sink.claim3):
        c = claim(weak, tmp_path)
        assert c.verdict == NO_SINK and "weak sink" in " ".join(c.disagreements)
    strong, before = _sink_study(False), _sink_study(None)
    assert not weak_sink(strong.analyses["m", "c"]) and not weak_sink(before.analyses["m", "c"])
    for study in (strong, before):  # read as before: decided (on its intervals for claim 2)
        for claim in (sink.claim2, sink.claim3):
            assert claim(study, tmp_path).verdict not in (NO_SINK, NO_INTERVAL)


def test_claim2_medians_over_kv_heads_get_intervals_and_too_few_units(tmp_path, monkeypatch):
    from _reproduce import plots, sink
    from _reproduce.intervals import NO_INTERVAL

    monkeypatch.setattr(plots, "grid", lambda *a, **k: None)
    from dataclasses import replace

    r = replace(_analysis(), metadata=dict(_analysis().metadata))
    spread = sink.sink_spread(r)
    # 1 layer × 2 KV heads: a median over 2 units is too few (SPEC §8), whatever the windows.
    assert r.n_layers * r.n_kv_heads == 2
    assert spread["kappa"].too_few and spread["kappa"].n == 2
    assert spread["kappa"].value == pytest.approx(sink.median(r.kv_heads("sink_norm_ratio")), rel=1e-5)
    r.window_sink = None  # a file without per-window arrays: no interval, not decided
    assert sink.sink_spread(r) is None
    assert sink.claim2(_study_of(r), tmp_path).verdict == NO_INTERVAL


def _study_of(r):
    from dataclasses import replace

    from _reproduce import corpora
    from _reproduce.protocol import QUICK
    from _reproduce.study import Study

    return Study(replace(QUICK, n_windows=12, seq_len=40), {"c": corpora.Corpus("c", "t", "fake")},
                 {("m", "c"): r})


@pytest.mark.parametrize(("kind", "statistic"), [
    ("symmetric", "mean"), ("skewed", "mean"), ("skewed", "median"), ("skewed", "std"),
])
def test_bca_interval_equals_scipy_on_the_same_draws(kind, statistic):
    """SPEC §8: the interval is scipy.stats.bootstrap(method="BCa")'s. Given the draws scipy makes
    from the same generator, the ends agree to round-off, on symmetric and skewed data."""
    np = pytest.importorskip("numpy")
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(7)
    data = rng.normal(size=40) if kind == "symmetric" else rng.lognormal(sigma=1.2, size=40)
    reduce = {"mean": np.mean, "median": np.median, "std": np.std}[statistic]
    seed, resamples = 11, 2000
    want = stats.bootstrap((data,), reduce, n_resamples=resamples, method="BCa", confidence_level=0.95,
                           rng=np.random.default_rng(seed), vectorized=True).confidence_interval
    drawn = torch.from_numpy(np.random.default_rng(seed).integers(0, len(data), (resamples, len(data))))
    values = torch.from_numpy(data)

    def figure(idx: torch.Tensor) -> torch.Tensor:
        return torch.tensor([float(reduce(values[idx].numpy()))], dtype=torch.float64)

    (got,) = intervals.bootstraps(figure, len(data), indices=drawn)
    assert got.low == pytest.approx(want.low, rel=1e-9, abs=1e-12)
    assert got.high == pytest.approx(want.high, rel=1e-9, abs=1e-12)
    if kind == "skewed" and statistic == "mean":  # the correction moves the interval to the right
        plain = torch.quantile(torch.stack([figure(i) for i in drawn])[:, 0],
                               torch.tensor([0.025, 0.975], dtype=torch.float64))
        assert got.low > plain[0] and got.high > plain[1]


def test_bca_corrects_a_statistic_whose_resamples_lie_above_its_point():
    """Claim 4's best-N excess (SPEC §8) is a maximum over noisy candidates: its resamples lie
    mostly above the point, and the percentile interval can exclude it. BCa's bias correction
    (z0 < 0) moves both ends down, here to hold the point; where every resample lies above it
    there is no interval at all (NaN, read as undecided), never a percentile one."""
    per_window = torch.randn(32, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.05

    def best(idx: torch.Tensor) -> float:
        return float(per_window[idx].mean(0).max())

    iv = bootstrap(best, 32)
    resampled = torch.tensor([best(i) for i in intervals.draws(32)], dtype=torch.float64)
    plain = torch.quantile(resampled, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    assert float((resampled < iv.value).double().mean()) < 0.5  # biased upward
    assert iv.low < plain[0] and iv.high < plain[1]
    assert iv.low <= iv.value <= iv.high < plain[1]


def test_bca_without_defined_resamples_or_on_one_side_has_no_interval():
    assert all(math.isnan(x) for x in intervals.bca(1.0, torch.tensor([math.nan]), torch.ones(3)))
    assert all(math.isnan(x) for x in intervals.bca(0.0, torch.tensor([1.0, 2.0]), torch.ones(3)))  # z0 = −∞
    assert intervals.bca(2.0, torch.full((50,), 2.0), torch.full((9,), 2.0)) == (2.0, 2.0)


def test_window_means_are_each_heads_nan_aware_mean_over_the_drawn_windows():
    """:class:`WindowMeans` (two products with the draw counts) against a loop over heads that
    averages the defined values of the drawn windows, repeats included; an array with ±inf is
    read by gathering, and sums over the drawn windows are NaN where a drawn window is."""
    g = torch.Generator().manual_seed(3)
    values = torch.rand(9, 2, 3, 4, generator=g, dtype=torch.float64)
    values[torch.rand(values.shape, generator=g) < 0.3] = math.nan
    values[:, 1, 2, 0] = math.nan  # a head undefined on every window
    ready = intervals.WindowMeans(values)
    for idx in (torch.arange(9), torch.tensor([0, 0, 0, 4, 8, 8, 2, 2, 2]), torch.tensor([5])):
        got = intervals.head_means(ready, idx)
        want = torch.full(values.shape[1:], math.nan, dtype=torch.float64)
        for entry in itertools.product(*(range(n) for n in values.shape[1:])):
            drawn = [float(values[(int(w), *entry)]) for w in idx]
            defined = [x for x in drawn if not math.isnan(x)]
            if defined:
                want[entry] = sum(defined) / len(defined)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15, equal_nan=True)
        torch.testing.assert_close(got, values[idx].nanmean(0), rtol=1e-12, atol=1e-15, equal_nan=True)
    with_inf = values.clone()
    with_inf[0, 0, 0, 0] = math.inf
    idx = torch.tensor([1, 2, 3])  # window 0 not drawn: its inf must not reach the mean
    torch.testing.assert_close(intervals.head_means(intervals.WindowMeans(with_inf), idx),
                               with_inf[idx].nanmean(0), equal_nan=True)
    votes = torch.randint(0, 5, (9, 6, 3), generator=g).double()
    idx = torch.tensor([0, 0, 7])
    torch.testing.assert_close(intervals.WindowMeans(votes).sums_over(idx), votes[idx].sum(0))
    assert torch.isnan(ready.sums_over(torch.arange(9))[1, 2, 0])


def test_per_run_functions_compute_once_per_arguments_only_within_remembered():
    calls: list[tuple] = []

    @intervals.per_run
    def figure(result, n):
        calls.append((result, n))
        return [n]

    a, b = object(), object()
    assert figure(a, 2) == [2] and figure(a, 2) == [2] and len(calls) == 2  # outside: every call
    with intervals.remembered():
        first = figure(a, 2)
        assert figure(a, 2) is first and figure(a, [2]) is not first  # by value: 2 is not [2]
        figure(b, 2)
        with intervals.remembered():  # nested: the same memo
            assert figure(b, 2) == [2]
    assert len(calls) == 5
    figure(a, 2)
    assert len(calls) == 6  # the memo ended with the outer block
