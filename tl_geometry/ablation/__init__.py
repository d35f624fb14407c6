"""Head ablation, single-head sensitivity and structured sparsification (SPEC §7).

``ablate_heads`` gives TransformerLens hooks on ``blocks.{l}.attn.hook_z`` that remove exactly
the listed query heads (GQA-safe); ``head_sensitivity`` scores every head alone in batched
forwards, each loss increase with its standard error over windows; ``critical_heads`` applies
SPEC §7's rule (large and above noise); ``ablation_vs_random`` compares a set of heads with
random sets of the same size; ``head_orderings`` and ``sparsification_curve`` compare removal
orders on held-out text. The method is in ``docs/ablation.md``. Top-N attention and retrieval
capacity live beside this package, in :mod:`tl_geometry.capacity`; the hook context and the
batched loss engine that both build on, in :mod:`tl_geometry.forward`.

    with tl_geometry.ablation.ablate_heads(model, [(3, 4)]):
        loss = model(tokens, return_type="loss")
"""

from ..functional.uncertainty import CRITICAL_LEVEL, CRITICAL_MIN_FRACTION, CRITICAL_MIN_NATS
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
from .random_sets import AblationVsRandom, ablation_vs_random, random_head_sets
from .sensitivity import CRITICAL_K, HeadSensitivity, critical_heads, head_sensitivity, mad_outliers
from .sparsification import DEFAULT_RETENTION, SparsificationCurve, heads_kept, sparsification_curve

__all__ = [
    "CRITICAL_K",
    "CRITICAL_LEVEL",
    "CRITICAL_MIN_FRACTION",
    "CRITICAL_MIN_NATS",
    "DEFAULT_RETENTION",
    "MODES",
    "ORDERINGS",
    "AblationVsRandom",
    "HeadAblation",
    "HeadSensitivity",
    "Ordering",
    "SparsificationCurve",
    "ablate_heads",
    "ablation_vs_random",
    "attention_entropy",
    "critical_heads",
    "entropy_order",
    "head_orderings",
    "head_sensitivity",
    "heads_kept",
    "mad_outliers",
    "oracle_order",
    "random_head_sets",
    "random_order",
    "sparsification_curve",
    "taxonomy_order",
    "weight_norm_order",
    "weight_norms",
]
