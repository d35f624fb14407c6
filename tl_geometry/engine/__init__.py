"""The analysis engine: the one place that turns a layer's pattern and values into results.

``options`` validates the options; ``layer`` does one layer's work on the numba kernels or their
torch twins (``backend``); ``accumulate`` sums layers, batches and processes into a
:class:`~tl_geometry.HeadAnalysis`. ``analyze_heads`` and ``analyze_model`` are front-ends.
"""

from .accumulate import Accumulator
from .layer import LayerStats, analyze_layer
from .metadata import output_weights, run_metadata
from .options import DEFAULT_N_VALUES, AnalysisOptions, check_options

__all__ = [
    "DEFAULT_N_VALUES",
    "Accumulator",
    "AnalysisOptions",
    "LayerStats",
    "analyze_layer",
    "check_options",
    "output_weights",
    "run_metadata",
]
