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

from typing import TYPE_CHECKING, Any

from . import ablation, capacity, functional
from ._version import __version__ as __version__
from .analyze.from_cache import analyze_heads
from .analyze.from_model import analyze_model, analyze_model_nulls
from .analyze.head_scores import head_scores
from .inputs.cache import CACHE_NAMES_FILTER, CacheError
from .inputs.text import sample_text, text_windows
from .result import (
    HeadAnalysis,
    HeadSelection,
    ResultFileError,
    label_agreement,
    truncation_budgets,
)

# Exports whose modules are imported on first use, so that `import tl_geometry` stays light:
# the model loaders pull in transformers, the views and report matplotlib.
_LAZY = {"load_model": "inputs.models", "ModelLoadError": "inputs.models", "views": "views",
         "write_report": "views.report"}

if TYPE_CHECKING:
    from . import views
    from .inputs.models import ModelLoadError, load_model
    from .views.report import write_report


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tl_geometry' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(f".{_LAZY[name]}", __name__)
    value = module if _LAZY[name] == name else getattr(module, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "CACHE_NAMES_FILTER",
    "CacheError",
    "HeadAnalysis",
    "HeadSelection",
    "ModelLoadError",
    "ResultFileError",
    "ablation",
    "analyze_heads",
    "analyze_model",
    "analyze_model_nulls",
    "capacity",
    "functional",
    "head_scores",
    "label_agreement",
    "load_model",
    "sample_text",
    "text_windows",
    "truncation_budgets",
    "views",
    "write_report",
]
