"""SPEC §3's separability metrics (every §3 figure on the metric axis: P, R, F, γ, GInv, P*, F*)
of the top-N, sink-removed, random and shuffled selections, from the compiled kernels, their
torch twins and the functional layer, against the loop reference."""

from __future__ import annotations

import pytest
from conformance import (
    GROUPS,
    IMPLEMENTATIONS,
    SCENARIOS,
    SEPARABILITY,
    assert_compares_something,
    reference,
)
from shared_checks import assert_metrics_equal_reference


@pytest.mark.parametrize("scenario", SCENARIOS, ids=str)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
def test_separability_equals_the_reference(implementation, scenario):
    want = reference(scenario)
    groups = [g for g in GROUPS if g in implementation.groups]
    assert_metrics_equal_reference(implementation.run(scenario), want, groups, SEPARABILITY, tol=implementation.tol,
                                   what=f"{implementation} ")
    assert_compares_something(want, [f"{g}_{m}" for g in groups for m in SEPARABILITY])
