"""The analysis engine: the one place that turns a layer's pattern and values into results.

``options`` validates the options; ``layer`` does one layer's work (fused validation and votes
in ``checks``, sink geometry, selections and scores; with recomputed rows, the
votes come from the queries and keys: ``key_votes``) through the :class:`~.backend.Backend`
that ``backend`` chooses for it: the compiled kernels of ``compiled`` (numba, CPU) or their
torch twins of ``twins`` (any device), which share ``layout``; ``accumulate`` sums layers,
batches and processes and finishes the :class:`~tl_geometry.HeadAnalysis`. ``analyze_heads``
(a cache) and ``analyze_model`` (forward hooks) are thin front-ends over it.
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
