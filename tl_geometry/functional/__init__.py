"""Pure tensor functions of tl_geometry: tensors in, tensors out, no TransformerLens.

The pipeline's mathematics (SPEC §1–6, §10), the local sink of a sliding-window head (ours) and
attention rows recomputed for chosen queries, each vectorised over heads, queries and selections;
``figures`` lists every figure once.
"""

from .attention import (
    NO_QUERY,
    attention_row_block,
    attention_row_blocks,
    attention_rows,
    visible_keys,
)
from .bounds import Bounds, RegimeParams, fit_regime, inversion_bounds, regime_bounds
from .figures import FIGURES, Figure
from .heads import (
    causal_key_mask,
    contribution_norms,
    first_duplicate,
    kv_head_index,
    last_positions,
    sink_positions,
    value_dots,
)
from .local_sink import (
    LOCAL_SINK_FIELDS,
    LocalSink,
    beyond_columns,
    beyond_window,
    local_sink,
    local_sink_from_columns,
)
from .regime import RegimeDiagnostics, regime_diagnostics
from .selection import random_ranks, top_n_mask, top_n_ranks
from .separability import Separability, distances, scores_from_energies, separability
from .shell import shell_bounds
from .sink import SinkDiagnostics, sink_diagnostics
from .stats import spearman
from .taxonomy import (
    CLASSES,
    N_RESAMPLES,
    UNLABELLED,
    UNSTABLE_BELOW,
    VOTES,
    bootstrap_resample_weights,
    bootstrap_stability,
    labels_from_votes,
    source_votes,
    source_winners,
    vote_fractions,
    vote_margin,
)
from .truncation import Truncation, truncation

__all__ = [
    "CLASSES",
    "FIGURES",
    "LOCAL_SINK_FIELDS",
    "NO_QUERY",
    "N_RESAMPLES",
    "UNLABELLED",
    "UNSTABLE_BELOW",
    "VOTES",
    "Bounds",
    "Figure",
    "LocalSink",
    "RegimeDiagnostics",
    "RegimeParams",
    "Separability",
    "SinkDiagnostics",
    "Truncation",
    "attention_row_block",
    "attention_row_blocks",
    "attention_rows",
    "beyond_columns",
    "beyond_window",
    "bootstrap_resample_weights",
    "bootstrap_stability",
    "causal_key_mask",
    "contribution_norms",
    "distances",
    "first_duplicate",
    "fit_regime",
    "inversion_bounds",
    "kv_head_index",
    "labels_from_votes",
    "last_positions",
    "local_sink",
    "local_sink_from_columns",
    "random_ranks",
    "regime_bounds",
    "regime_diagnostics",
    "scores_from_energies",
    "separability",
    "shell_bounds",
    "sink_diagnostics",
    "sink_positions",
    "source_votes",
    "source_winners",
    "spearman",
    "top_n_mask",
    "top_n_ranks",
    "truncation",
    "value_dots",
    "visible_keys",
    "vote_fractions",
    "vote_margin",
]
