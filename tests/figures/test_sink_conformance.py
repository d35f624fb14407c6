"""SPEC §4's sink fields (every figure on the sink_field axis), from the compiled kernels, their
torch twins and the functional layer, against the loop reference."""

from __future__ import annotations

import pytest
from conformance import IMPLEMENTATIONS, SCENARIOS, SINK, assert_compares_something, reference
from shared_checks import assert_sink_equals_reference


@pytest.mark.parametrize("scenario", SCENARIOS, ids=str)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
def test_sink_fields_equal_the_reference(implementation, scenario):
    want = reference(scenario)
    assert_sink_equals_reference(implementation.run(scenario), want, SINK, tol=implementation.tol,
                                 what=f"{implementation} ")
    assert_compares_something(want, [f"sink_{field}" for field in SINK])
