"""The front doors of the analysis: :func:`analyze_heads` reads a cache (``from_cache``),
:func:`analyze_model` runs a model with forward hooks, one layer at a time (``from_model``).
Both validate their options and hand each layer to :mod:`tl_geometry.engine`.
"""

from .from_cache import analyze_heads
from .from_model import analyze_model

__all__ = ["analyze_heads", "analyze_model"]
