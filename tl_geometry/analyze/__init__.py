"""The front doors of the analysis: :func:`analyze_heads` reads a cache, :func:`analyze_model`
(and :func:`analyze_model_nulls`) runs a model with forward hooks, and :func:`head_scores` runs a
model for the head scores other tools use (SPEC §9)."""

from .from_cache import analyze_heads
from .from_model import analyze_model, analyze_model_nulls
from .head_scores import head_scores

__all__ = ["analyze_heads", "analyze_model", "analyze_model_nulls", "head_scores"]
