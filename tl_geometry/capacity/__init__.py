"""Retrieval capacity: how few keys per query a model needs (SPEC §10, ``docs/capacity.md``).

``top_n_attention`` gives hooks on ``blocks.{l}.attn.hook_pattern`` that keep only each query's
top-``N`` attention weights (one ``N`` or a per-head ``TopNPolicy``); ``retrieval_capacity`` and
``capacity_sweep`` measure the loss that costs; ``capacity_correlation`` asks which per-head
quantity predicts it.

    with tl_geometry.capacity.top_n_attention(model, 8):
        loss = model(tokens, return_type="loss")
"""

from ..functional.stats import spearman
from .geometry import CapacityCorrelation, capacity_correlation, head_geometry
from .policy import KEEP_ALL, TopNPolicy
from .sweep import (
    DEFAULT_N_VALUES,
    CapacitySweep,
    RetrievalCapacity,
    capacity_sweep,
    retrieval_capacity,
)
from .topn import SPARSIFY_MODES, TopNAttention, sparsify_pattern, top_n_attention

__all__ = [
    "DEFAULT_N_VALUES",
    "KEEP_ALL",
    "SPARSIFY_MODES",
    "CapacityCorrelation",
    "CapacitySweep",
    "RetrievalCapacity",
    "TopNAttention",
    "TopNPolicy",
    "capacity_correlation",
    "capacity_sweep",
    "head_geometry",
    "retrieval_capacity",
    "sparsify_pattern",
    "spearman",
    "top_n_attention",
]
