"""demos/window_length.py: the pure functions of the fixed-position sink-visibility experiment, on
synthetic numbers (no model, no saved results)."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from repo_paths import REPO

sys.path.insert(0, str(REPO / "demos"))

import window_length as wl


def test_side_positions_split_at_the_window_edge():
    assert wl.side_positions(512, 12) == {"visible": list(range(500, 512)), "invisible": list(range(512, 524))}
    # a sink at p is visible while t ≤ p + w − 1
    assert wl.side_positions(4, 1, sink=2) == {"visible": [5], "invisible": [6]}
    with pytest.raises(ValueError):
        wl.side_positions(4, 0)


def test_bootstrap_mean_is_seeded_nan_aware_and_reads_both_signs():
    rng = np.random.default_rng(1)
    x = rng.normal(-0.2, 0.05, size=(16, 3, 4))
    a, b = wl.bootstrap_mean(x, geometry=True), wl.bootstrap_mean(x, geometry=True)
    assert a == b  # same seed, same interval
    assert a["lo"] <= a["mean"] <= a["hi"] and a["n"] == 16
    assert math.isclose(a["mean"], float(x.mean()))
    assert a["reading"] == "lowers"
    y = x.copy()
    y[0, 0, 0] = np.nan  # an undefined head is left out, not counted as 0
    assert math.isclose(wl.bootstrap_mean(y)["mean"], float(np.nanmean(y)))
    few = wl.bootstrap_mean(x[:4])  # fewer than 8 windows: no interval (SPEC §8)
    assert few["lo"] is None and few["hi"] is None and few["n"] == 4


def test_head_difference_is_mean_and_standard_error_over_heads():
    visible = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    invisible = np.zeros((2, 3))
    d = wl.head_difference(visible, invisible)
    assert d["mean"] == 2.0 and d["n_heads"] == 3 and d["n_negative"] == 0
    assert math.isclose(d["se"], 1.0 / math.sqrt(3))


def _report(n_windows=8, n_layers=2, n_heads=2, k=2, w=4):
    """A saved report whose geometry term is +0.1 where the sink is visible and −0.2 where it is
    not, on the local layer only; the decomposition nulls equal the top-N scores except norms."""
    sides = wl.side_positions(w, k)
    positions = sides["visible"] + sides["invisible"]
    shape = (n_windows, 2, n_layers, n_heads, len(wl.N_SHOWN))
    top = np.full(shape, 0.5)
    values = top.copy()
    values[:, 0, 0] -= 0.1  # visible: top − values = +0.1 on layer 0 (local)
    values[:, 1, 0] += 0.2  # invisible: −0.2
    norms = values.copy()
    sink = np.zeros((n_windows, len(positions), n_layers, n_heads))
    sink[:, :k] = 0.05
    sink[:, :, 1] = 0.3  # the global layer sees the sink everywhere
    return {"layer_kinds": ["local", "global"], "positions": sides,
            "per_window": {"query_positions": positions,
                           "side_means": {"top": top.tolist(), "values": values.tolist(), "norms": norms.tolist(),
                                          "directions": top.tolist(), "unselected": top.tolist()},
                           "sink_mass": sink.tolist()}}


def test_fixed_summary_reads_sides_parts_and_sink_mass():
    summary = wl._fixed_summary(_report())
    local, glob = summary["local"], summary["global"]
    net = local["terms"]["values"]["4"]
    assert math.isclose(net["visible"]["mean"], 0.1) and math.isclose(net["invisible"]["mean"], -0.2)
    assert net["visible"]["reading"] == "raises" and net["invisible"]["reading"] == "lowers"
    assert math.isclose(local["change"]["values"]["4"]["mean"], 0.3)
    assert math.isclose(local["per_head_change"]["values"]["4"]["mean"], 0.3)
    assert local["terms"]["directions"]["2"]["visible"]["mean"] == 0.0  # this null equals top-N
    assert math.isclose(local["sink_mass"]["visible"]["mean"], 0.05)
    assert local["sink_mass"]["invisible"]["mean"] == 0.0
    assert glob["terms"]["values"]["8"]["visible"]["mean"] == 0.0
    assert math.isclose(glob["sink_mass"]["invisible"]["mean"], 0.3)
    assert "| local (1) | top − values (net) |" in wl._fixed_table({**_report(), "kinds": summary})


def test_per_window_intervals_resample_windows_not_layers(tmp_path):
    rng = np.random.default_rng(0)
    gap = rng.normal(0.0, 0.01, size=(8, 3, 2, len(wl.N_SHOWN)))
    gap[:, 1] -= 0.2  # the one global layer lowers separability, the local ones do nothing
    report = {"runs": [{"model": "m", "T": 16, "layer_kinds": ["local", "global", "local"],
                        "per_window_gap": gap.tolist()}]}
    run = wl._write_per_window(report, tmp_path)["runs"][0]
    cell = run["global"]["gap"]["2"]
    assert cell["n"] == 8 and math.isclose(cell["mean"], float(gap[:, 1, :, 0].mean()))
    assert cell["reading"] == "lowers" and run["local"]["gap"]["2"]["reading"] == "no effect"
    assert run["local"]["layers"] == [0, 2]
    assert (tmp_path / "window_length_per_window.json").exists()
