"""The figures table (tl_geometry.functional.figures) is the one definition the rest derives from."""

from __future__ import annotations

import pytest

from tl_geometry.engine import layout
from tl_geometry.functional.figures import FIGURES, figure, labels, slot
from tl_geometry.functional.local_sink import LocalSink
from tl_geometry.functional.regime import RegimeDiagnostics
from tl_geometry.functional.separability import METRIC_NAMES, TRUNCATION_NAMES, Separability
from tl_geometry.functional.sink import SinkDiagnostics
from tl_geometry.functional.truncation import Truncation
from tl_geometry.result import schema
from tl_geometry.result.shortcuts import _AXIS, DOCUMENTED, Shortcuts, _Slice


def test_each_axis_lists_each_figure_once_with_its_spec_section():
    axes = dict.fromkeys(f.axis for f in FIGURES)
    for axis in axes:
        assert len(set(labels(axis))) == len(labels(axis)), axis
    assert all(f.spec.startswith("§") and f.doc for f in FIGURES)


def test_the_functional_layer_returns_the_table_s_figures_in_its_order():
    assert Separability._fields + TRUNCATION_NAMES == METRIC_NAMES
    assert all(figure("metric", name).spec == "§10" for name in TRUNCATION_NAMES)
    assert SinkDiagnostics._fields == labels("sink_field")
    assert RegimeDiagnostics._fields == labels("regime_field")
    assert LocalSink._fields == labels("local_field")
    assert Truncation._fields == TRUNCATION_NAMES


def test_the_result_s_axes_are_the_table_s():
    table_axes = dict.fromkeys(f.axis for f in FIGURES)
    for axis in table_axes:
        assert schema.names()[axis] == labels(axis), axis


def test_the_kernel_slots_are_the_figures_indices():
    from tl_geometry.engine.compiled import score

    for name in METRIC_NAMES:
        assert getattr(score, name.upper()) == slot("metric", name) == METRIC_NAMES.index(name)
    assert (slot("metric", "f_score"), slot("metric", "inversions")) == (layout.F_SCORE, layout.INVERSIONS)
    assert (slot("sink_field", "mass"), slot("sink_field", "share")) == (layout.SINK_MASS, layout.SINK_SHARE)


def test_the_shortcut_column_names_the_shortcuts_that_read_one_figure():
    declared = {name: value for name, value in vars(Shortcuts).items() if isinstance(value, _Slice)}
    one_figure = {name: (s.accessor, s.key[0]) for name, s in declared.items()
                  if s.accessor in _AXIS and len(s.key) == 1}
    by_table = {f.shortcut: f for f in FIGURES if f.shortcut}
    assert set(by_table) == set(one_figure)
    for name, row in by_table.items():
        accessor, key = one_figure[name]
        assert (_AXIS[accessor], key) == (row.axis, row.name)
        assert row.doc in declared[name].__doc__
    assert set(by_table) <= set(DOCUMENTED)


def test_kernels_cached_with_other_slots_are_refused(monkeypatch):
    from tl_geometry.engine.compiled import score, signatures

    signatures.check_slots()  # the kernels as compiled today
    monkeypatch.setattr(score, "SLOTS", tuple(reversed(score.SLOTS)))  # as if the table had changed
    with pytest.raises(signatures.StaleKernelsError, match="Delete numba's cached kernels"):
        signatures.check_slots()


def test_the_file_format_follows_the_figures_it_saves():
    from tl_geometry.result import io

    assert io._ADDED_IN["metric"] == {"tail_mass": 5, "truncation_error": 5}
    assert max(f.since for f in FIGURES) <= io.FORMAT_VERSION


def test_unknown_names_are_refused_with_the_valid_ones():
    with pytest.raises(KeyError, match="f_score"):
        figure("metric", "f_scroe")
    with pytest.raises(KeyError, match="sink_field"):
        labels("sink_fields")
