"""The front doors of the analysis: :func:`analyze_heads` reads a cache (``from_cache``),
:func:`analyze_model` runs a model with forward hooks, one layer at a time (``from_model``;
:func:`analyze_model_nulls`: every null of SPEC §3 from one forward).
Both validate their options and hand each layer to :mod:`tl_geometry.engine`.
:func:`head_scores` runs a model for the head scores other tools use (SPEC §9).
"""

from .from_cache import analyze_heads
from .from_model import analyze_model, analyze_model_nulls
from .head_scores import head_scores

__all__ = ["analyze_heads", "analyze_model", "analyze_model_nulls", "head_scores"]
