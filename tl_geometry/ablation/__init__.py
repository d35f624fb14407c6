"""Head ablation, single-head sensitivity and structured sparsification (SPEC §7).

``ablate_heads`` gives TransformerLens hooks on ``blocks.{l}.attn.hook_z`` that remove exactly
the listed query heads (GQA-safe); ``head_sensitivity`` scores every head alone in batched
forwards, each loss increase with its standard error over windows; ``critical_heads`` applies
SPEC §7's rule (large and above noise); ``ablation_vs_random`` compares a set of heads with
random sets of the same size; ``head_orderings`` and ``sparsification_curve`` compare removal
orders on held-out text. The method is in ``docs/ablation.md``.
``top_n_attention`` keeps only each query's top-N keys on ``hook_pattern``;
``retrieval_capacity``, ``capacity_sweep`` and ``capacity_correlation`` measure what that costs
(``docs/capacity.md``); a ``TopNPolicy`` gives every head its own N (SPEC §10).

    with tl_geometry.ablate_heads(model, [(3, 4)]):
        loss = model(tokens, return_type="loss")
"""

from ..functional.stats import spearman
from ..functional.uncertainty import CRITICAL_LEVEL, CRITICAL_MIN_FRACTION, CRITICAL_MIN_NATS
from .capacity import (
    DEFAULT_N_VALUES,
    CapacitySweep,
    RetrievalCapacity,
    capacity_sweep,
    retrieval_capacity,
)
from .capacity_geometry import CapacityCorrelation, capacity_correlation, head_geometry
from .hooks import MODES, HeadAblation, ablate_heads
from .orderings import (
    ORDERINGS,
    Ordering,
    attention_entropy,
    entropy_order,
    head_orderings,
    oracle_order,
    random_order,
    taxonomy_order,
    weight_norm_order,
    weight_norms,
)
from .policy import KEEP_ALL, TopNPolicy
from .random_sets import AblationVsRandom, ablation_vs_random, random_head_sets
from .sensitivity import CRITICAL_K, HeadSensitivity, critical_heads, head_sensitivity, mad_outliers
from .sparsification import DEFAULT_RETENTION, SparsificationCurve, heads_kept, sparsification_curve
from .topn import SPARSIFY_MODES, TopNAttention, sparsify_pattern, top_n_attention

__all__ = [
    "CRITICAL_K",
    "CRITICAL_LEVEL",
    "CRITICAL_MIN_FRACTION",
    "CRITICAL_MIN_NATS",
    "DEFAULT_N_VALUES",
    "DEFAULT_RETENTION",
    "KEEP_ALL",
    "MODES",
    "ORDERINGS",
    "SPARSIFY_MODES",
    "AblationVsRandom",
    "CapacityCorrelation",
    "CapacitySweep",
    "HeadAblation",
    "HeadSensitivity",
    "Ordering",
    "RetrievalCapacity",
    "SparsificationCurve",
    "TopNAttention",
    "TopNPolicy",
    "ablate_heads",
    "ablation_vs_random",
    "attention_entropy",
    "capacity_correlation",
    "capacity_sweep",
    "critical_heads",
    "entropy_order",
    "head_geometry",
    "head_orderings",
    "head_sensitivity",
    "heads_kept",
    "mad_outliers",
    "oracle_order",
    "random_head_sets",
    "random_order",
    "retrieval_capacity",
    "sparsification_curve",
    "sparsify_pattern",
    "spearman",
    "taxonomy_order",
    "top_n_attention",
    "weight_norm_order",
    "weight_norms",
]
