"""The conformance families cover the figures table: every figure on the metric, sink_field
and bound_metric axes belongs to one family (a figure with another SPEC section would be
compared by none), and each family has its figures in the reference's output."""

from __future__ import annotations

from conformance import BOUND_METRICS, SEPARABILITY, SINK, TRUNCATION
from reference import BOUND_METRICS as REFERENCE_BOUND_METRICS
from reference import METRICS, SINK_KEYS
from reference import TRUNCATION as REFERENCE_TRUNCATION

from tl_geometry.functional.figures import labels


def test_every_metric_figure_is_in_one_family():
    assert sorted(SEPARABILITY + TRUNCATION) == sorted(labels("metric"))
    assert not set(SEPARABILITY) & set(TRUNCATION)


def test_the_reference_names_every_figure_of_each_family():
    assert set(SEPARABILITY) <= set(METRICS), set(SEPARABILITY) - set(METRICS)
    assert set(TRUNCATION) <= set(REFERENCE_TRUNCATION), set(TRUNCATION) - set(REFERENCE_TRUNCATION)
    assert set(SINK) <= set(SINK_KEYS), set(SINK) - set(SINK_KEYS)
    assert set(BOUND_METRICS) <= set(REFERENCE_BOUND_METRICS), set(BOUND_METRICS) - set(REFERENCE_BOUND_METRICS)
