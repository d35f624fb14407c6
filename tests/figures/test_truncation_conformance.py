"""SPEC §10's truncation figures (every §10 figure on the metric axis: the tail mass and the
relative output error) of the top-N and sink-removed selections, from the compiled kernels,
their torch twins and the functional layer, against the loop reference; the baselines carry
none (NaN)."""

from __future__ import annotations

import numpy as np
import pytest
from conformance import (
    BASELINES,
    IMPLEMENTATIONS,
    SCENARIOS,
    TRUNCATION,
    assert_family_equals_reference,
    reference,
)
from shared_checks import assert_metrics_equal_reference

SCORED = ("top", "sink_removed")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=str)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
def test_truncation_equals_the_reference(implementation, scenario):
    assert_family_equals_reference(implementation, scenario, SCORED, TRUNCATION)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=str)
@pytest.mark.parametrize("implementation", [i for i in IMPLEMENTATIONS if set(BASELINES) <= set(i.groups)], ids=str)
def test_the_baselines_carry_no_truncation_figures(implementation, scenario):
    want = reference(scenario)
    for key in (f"{g}_{m}" for g in BASELINES for m in TRUNCATION):
        assert np.isnan(want[key]).all(), f"the reference's {key} is defined"
    assert_metrics_equal_reference(implementation.run(scenario), want, BASELINES, TRUNCATION, tol=implementation.tol,
                                   what=f"{implementation} ")
