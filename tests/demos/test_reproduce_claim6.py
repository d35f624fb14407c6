"""Claim 6's sentences on intervals only (SPEC §8 (iv)): a loss against the unablated loss, or
against another order's, is lower / undecided / higher on the interval of the paired difference;
heads that lower or raise the loss are counted on their whole interval; single-head changes are
never added up into a joint removal."""

from __future__ import annotations

import re
import sys

import pandas as pd
import pytest
import torch
from repo_paths import REPO

sys.path.insert(0, str(REPO / "demos"))

from _reproduce import document
from _reproduce.ablation import (
    HIGHER,
    LOWER,
    below_dense,
    breaks_model,
    claim6,
    curve_intervals,
    head_intervals,
    head_signs,
    order_losses,
    sign,
    versus_random,
)
from _reproduce.intervals import TOO_FEW, UNDECIDED, Interval
from test_reproduce import _fake_study

RETENTIONS = (1.0, 0.9, 0.75, 0.5, 0.25)
#: A zero-mean pattern over 8 windows; scaled per row or head, so that each interval has a width.
PATTERN = torch.tensor([1.0, -1.0, 0.6, -0.6, 1.2, -1.2, 0.4, -0.4], dtype=torch.float64)
#: Single-head loss increases (point, spread over windows) of a 2 × 4 sweep: four heads with a
#: negative point estimate whose interval holds 0, one lowering on its whole interval, one raising,
#: one critical and one undecided above 0.
HEADS = [(-0.01, 0.1), (-0.02, 0.1), (-0.01, 0.08), (-0.015, 0.12),
         (-0.05, 0.005), (0.05, 0.005), (0.5, 0.05), (0.02, 0.1)]
#: Held-out loss minus the unablated loss per order and retention (point, spread): the taxonomy's
#: at 0.9 straddles 0, the oracle's at 0.9 lies below 0 on its whole interval.
ORDERS = {
    "taxonomy": [(0.0, 0.0), (-0.01, 0.05), (0.1, 0.01), (2.0, 0.02), (3.0, 0.02)],
    "weight_norm": [(0.0, 0.0), (0.5, 0.01), (0.9, 0.01), (1.0, 0.02), (2.0, 0.02)],
    "entropy": [(0.0, 0.0), (0.5, 0.01), (0.9, 0.01), (1.0, 0.02), (2.0, 0.02)],
    "random": [(0.0, 0.0), (0.4, 0.01), (0.8, 0.01), (1.5, 0.02), (2.5, 0.02)],
    "oracle": [(0.0, 0.0), (-0.2, 0.01), (0.05, 0.01), (0.5, 0.02), (1.0, 0.02)],
}
#: The second random order (seed 1): at 0.9 its loss is the taxonomy's within a spread that
#: holds 0 (undecided), at 0.75 well above it.
RANDOM_1 = [(0.0, 0.0), (0.0, -0.06), (0.9, 0.01), (1.6, 0.02), (2.6, 0.02)]


def _tables(n_windows: int = 8, heads=HEADS, windows: bool = True) -> dict:
    """One model's claim-6 tables with per-window losses built from :data:`HEADS` and
    :data:`ORDERS` (equal prediction counts per window, so a point loss is the windows' mean)."""
    pattern = PATTERN[:n_windows] - PATTERN[:n_windows].mean()
    dense = 3.0 + 0.2 * pattern  # the unablated loss varies over the windows
    rows, curve_windows = [], []
    for name, cells in [*ORDERS.items(), ("random", RANDOM_1)]:
        seed = (1 if cells is RANDOM_1 else 0) if name == "random" else None
        for r, (delta, spread) in zip(RETENTIONS, cells):
            per_window = dense + delta + spread * pattern
            rows.append({"ordering": name, "seed": seed, "retention": r, "loss": float(per_window.mean())})
            curve_windows.append(per_window)
    curve = pd.DataFrame(rows)
    increase = torch.stack([delta + spread * pattern for delta, spread in heads])
    sens = pd.DataFrame({"layer": [i // 4 for i in range(len(heads))], "head": [i % 4 for i in range(len(heads))],
                         "loss_increase": increase.mean(-1).tolist()})
    sens["loss"] = 3.0 + sens.loss_increase
    weight = torch.full((n_windows,), 15.0, dtype=torch.float64)
    per_window = {"sensitivity": (dense + increase).reshape(-1, 4, n_windows), "base": dense, "weight": weight,
                  "curve": torch.stack(curve_windows), "held_out_base": dense, "held_out_weight": weight}
    return {"sensitivity": sens, "curve": curve, "base_loss": float(dense.mean()),
            "held_out_base_loss": float(dense.mean()), "windows": per_window if windows else None}


def _claim(tmp_path, tables):
    study = _fake_study()
    study.ablation = {"m": tables}
    return claim6(study, tmp_path)


def _text(claim) -> str:
    """Every sentence and table cell of the claim's section, and its notes."""
    return document.page(["# fake"], [claim], "results") + "\n" + "\n".join(claim.disagreements)


def test_sign_reads_a_loss_change_on_its_whole_interval():
    assert sign(Interval(-0.3, -0.5, -0.1, 8)) == LOWER
    assert sign(Interval(0.3, 0.1, 0.5, 8)) == HIGHER
    assert sign(Interval(-0.3, -0.5, 0.1, 8)) == UNDECIDED  # a negative point is not enough
    assert sign(Interval(-0.3, -0.5, 0.0, 8)) == UNDECIDED  # an end on 0 is not below it
    assert sign(Interval(-0.3, float("nan"), float("nan"), 4)) == TOO_FEW


def test_a_taxonomy_loss_whose_interval_holds_the_unablated_loss_is_undecided_not_below(tmp_path):
    tables = _tables()
    curve = tables["curve"]
    row = curve.index[(curve.ordering == "taxonomy") & (curve.retention == 0.9)].tolist()
    (difference,) = curve_intervals(tables, [(row, [-1])])
    assert difference.value == pytest.approx(-0.01) and difference.n == 8
    assert difference.low < 0 < difference.high and sign(difference) == UNDECIDED

    notes = below_dense("m", tables, head_intervals(tables))
    taxonomy = next(n for n in notes if "the taxonomy order's" in n)
    assert (f"{difference.show()} nats at retention 0.9, undecided (the interval holds 0)" in taxonomy)
    assert "95 % BCa interval over the same 8 held-out windows" in taxonomy
    assert "lower on its whole interval" not in taxonomy
    # The oracle's difference lies below 0 on its whole interval: lower; the orders whose
    # difference lies above 0 on its whole interval get no note at all.
    oracle = next(n for n in notes if "the oracle order's" in n)
    assert re.search(r"-0\.200 \[-0\.2\d\d, -0\.19\d\] nats at retention 0\.9, lower on its whole interval", oracle)
    assert not any(name in n for n in notes for name in ("weight_norm", "entropy", "random"))

    claim = _claim(tmp_path, tables)
    page = _text(claim)
    assert "falls below" not in page and "below the unablated" not in page
    assert taxonomy in claim.disagreements


def test_order_losses_and_orders_against_random_carry_their_intervals():
    tables = _tables()
    losses = order_losses(tables)
    assert losses["taxonomy", 0.9].value == pytest.approx(tables["curve"].loss[1])
    assert losses["random", 0.9].value == pytest.approx(3.0 + (0.4 + 0.0) / 2)  # mean of the two seeds
    assert all(iv.low <= iv.value <= iv.high for iv in losses.values())
    # At 0.9 the taxonomy order is lower than random seed 0 on the whole interval and undecided
    # against seed 1: a note, with both intervals; at 0.75 it is lower than both: none.
    (note,) = versus_random("m", tables)
    assert note.startswith("m: at retention 0.9 the taxonomy order's held-out loss minus each random order's, "
                           "95 % BCa interval over 8 held-out windows: seed 0: -0.410 [")
    assert "(lower), seed 1: -0.010 [" in note
    assert "(undecided) nats — lower than 1, undecided against 1 of the 2 random orders." in note


def test_heads_are_counted_on_their_whole_interval_not_on_point_estimates(tmp_path):
    tables = _tables()
    intervals = head_intervals(tables)
    assert sum(iv.value < 0 for iv in intervals) == 5  # five negative point estimates ...
    assert [sign(iv) for iv in intervals] == [UNDECIDED] * 4 + [LOWER, HIGHER, HIGHER, UNDECIDED]  # ... one lowers
    text = head_signs(intervals, 4)
    assert text.startswith("On the 8 ablation windows, 1 of 8 heads lower the loss when removed alone on "
                           "their whole 95 % interval, 2 raise it on theirs and 5 are undecided; the largest "
                           f"decrease among them is L1H0's {intervals[4].show()} nats.")
    claim = _claim(tmp_path, tables)
    page = _text(claim)
    assert "5 of 8 heads" not in page
    assert text in next(n for n in claim.disagreements if "the oracle order's" in n)
    row = next(line for line in page.splitlines() if line.startswith("| m | 3.000 |"))
    assert row.endswith("| 1 / 2 / 5 | 8, 8 |")  # lower / higher / undecided; windows, heads


def test_no_sentence_adds_single_head_changes_into_a_joint_removal(tmp_path):
    tables = _tables()
    page = _text(_claim(tmp_path, tables))
    sens = tables["sensitivity"]
    lowering = sens.loss_increase[sens.loss_increase < 0]
    assert "together" not in page
    assert document.fmt(float(lowering.sum())) not in page  # the sum of the negative deltas
    assert document.fmt(float(sens.loss_increase.sum())) not in page
    assert "its sparsification curve is the measured joint removal" in page


def test_every_number_a_sentence_reads_names_its_interval_and_windows(tmp_path):
    claim = _claim(tmp_path, _tables())
    for note in claim.disagreements:
        assert "interval" in note, note
        assert re.search(r"\b8 (held-out|ablation) windows\b", note), note
        bare = re.sub(r"-?\d+\.\d+ \[-?\d+\.\d+, -?\d+\.\d+\]", "", note)
        assert not re.search(r"\d\.\d{3}", bare), note  # every loss figure comes with its interval
    assert "95 % BCa interval" in claim.because and "8 held-out windows per model" in claim.because
    assert "8 ablation windows, 8 heads" in claim.because
    page = _text(claim)
    loss_row = next(line for line in page.splitlines() if line.startswith("| m | taxonomy |"))
    assert loss_row.count("[") == len(RETENTIONS)  # each order's loss with its interval
    check_row = next(line for line in page.splitlines() if "taxonomy − random (mean) at r = 0.9" in line)
    assert re.search(r"\| -?\d\.\d{3} \[-?\d\.\d{3}, -?\d\.\d{3}\] \| 8 \|", check_row)


def test_breaking_the_model_is_read_on_the_interval(tmp_path):
    # A head whose point estimate is below 1 nat but whose interval holds it: undecided, not
    # "no single head breaks the model" (as a point reading said).
    tables = _tables(heads=[*HEADS[:7], (0.9, 0.6)])
    intervals = head_intervals(tables)
    assert intervals[7].value < 1 < intervals[7].high
    (note,) = breaks_model("m", intervals, 4)
    assert note.startswith("m: whether a single head breaks the model alone (ours: a loss increase of at least 1 "
                           "nat on the whole 95 % interval over 8 ablation windows) is undecided: L1H3 ")
    assert "no single head breaks" not in _text(_claim(tmp_path, tables))
    # Every interval below 1 nat: none breaks it, the largest named with its interval.
    (note,) = breaks_model("m", head_intervals(_tables()), 4)
    assert "no single head breaks the model alone" in note and "L1H2 0.500 [" in note
    # A whole interval above 1 nat: it breaks the model.
    (note,) = breaks_model("m", head_intervals(_tables(heads=[*HEADS[:7], (1.5, 0.05)])), 4)
    assert note.startswith("m: 1 of 8 heads break the model alone") and "L1H3 1.500 [" in note


def test_too_few_windows_or_no_per_window_losses_give_no_reading(tmp_path):
    few = _tables(n_windows=4)
    intervals = head_intervals(few)
    assert all(sign(iv) == TOO_FEW for iv in intervals)
    assert below_dense("m", few, intervals) == [] and breaks_model("m", intervals, 4) == []
    assert "0 of 8 heads lower the loss" in head_signs(intervals, 4)
    assert "(8 with too few windows: n = 4)" in head_signs(intervals, 4)
    assert "n = 4, too few" in _text(_claim(tmp_path, few))
    old = _tables(windows=False)
    assert below_dense("m", old, None) == [] and versus_random("m", old) == []
    page = _text(_claim(tmp_path, old))
    assert "falls below" not in page and "(no interval)" in page
