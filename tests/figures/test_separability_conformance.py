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
    assert_family_equals_reference,
)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=str)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
def test_separability_equals_the_reference(implementation, scenario):
    assert_family_equals_reference(implementation, scenario, GROUPS, SEPARABILITY)
