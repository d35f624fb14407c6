"""The analysis engine: the one place that turns a layer's pattern and values into results.

``options`` validates the options; ``layer`` does one layer's work (fused validation and votes,
Gram matrices, selections and scores, sink geometry) through the compiled ``check_kernel`` and
``score_kernel`` or their ``torch_kernels`` twins (with recomputed rows, the votes come from the
queries and keys: ``key_votes`` and ``vote_kernel``); ``accumulate`` sums layers, batches and
processes and finishes the :class:`~tl_geometry.HeadAnalysis`. ``analyze_heads`` (a cache) and
``analyze_model`` (forward hooks) are thin front-ends over it.
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
