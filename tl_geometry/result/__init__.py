"""The result of an analysis: :class:`HeadAnalysis` and its parts (docs/api.md lists them)."""

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
