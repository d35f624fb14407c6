"""tl_geometry — which tokens does an attention head really select, and why.

Cache ``hook_pattern`` and ``hook_v`` with TransformerLens, then::

    import tl_geometry
    model = tl_geometry.load_model()                      # SmolLM2-135M, offline
    _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    result = tl_geometry.analyze_heads(cache)
    print(result.summary())

The mathematics is in ``docs/math.md``; the pure tensor functions in
:mod:`tl_geometry.functional`.
"""

__version__ = "0.1.0"

from . import functional
from .analysis import analyze_heads
from .cache import CACHE_NAMES_FILTER, CacheError
from .data import sample_text, text_windows
from .models import load_model
from .result import HeadAnalysis
from .streaming import analyze_model

__all__ = [
    "CACHE_NAMES_FILTER",
    "CacheError",
    "HeadAnalysis",
    "analyze_heads",
    "analyze_model",
    "functional",
    "load_model",
    "sample_text",
    "text_windows",
]
