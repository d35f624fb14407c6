"""The result of an analysis: :class:`HeadAnalysis` and its parts.

``schema`` holds every name and axis (one source); ``select`` reads by name (``sel``);
``headline`` the dense-N rules; ``tables`` and ``text`` the ``DataFrame`` and text forms; ``io``
the versioned, checked files; ``shortcuts`` the attribute shortcuts, one per documented slice;
``labels`` the label confidence, the label export and the agreement with other head scores;
``null_decomposition`` the table of top − null gaps over the nulls of SPEC §3.
``budgets`` the certified top-N budgets (SPEC §10).
"""

from ..functional.separability import METRIC_NAMES, TRUNCATION_NAMES
from .budgets import NO_BUDGET, truncation_budgets
from .head_analysis import HeadAnalysis
from .io import ResultFileError
from .labels import label_agreement
from .schema import (
    AXES,
    BOUND_KINDS,
    BOUND_METRICS,
    GROUPS,
    PAIRED_FIELDS,
    PERCENTILE,
    SE_KINDS,
    NoBoundsError,
    UnknownNameError,
    names,
)
from .select import HeadSelection
from .tables import null_decomposition

__all__ = [
    "AXES",
    "BOUND_KINDS",
    "BOUND_METRICS",
    "GROUPS",
    "METRIC_NAMES",
    "NO_BUDGET",
    "PAIRED_FIELDS",
    "PERCENTILE",
    "SE_KINDS",
    "TRUNCATION_NAMES",
    "HeadAnalysis",
    "HeadSelection",
    "NoBoundsError",
    "ResultFileError",
    "UnknownNameError",
    "label_agreement",
    "names",
    "null_decomposition",
    "truncation_budgets",
]
