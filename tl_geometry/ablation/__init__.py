"""Head ablation, single-head sensitivity and structured sparsification (SPEC §7).

``ablate_heads`` gives TransformerLens hooks on ``blocks.{l}.attn.hook_z`` that remove exactly
the listed query heads (GQA-safe); ``head_sensitivity`` scores every head alone in batched
forwards; ``critical_heads`` flags outliers; ``head_orderings`` and ``sparsification_curve``
compare removal orders on held-out text. The method is in ``docs/ablation.md``.

    with tl_geometry.ablate_heads(model, [(3, 4)]):
        loss = model(tokens, return_type="loss")
"""

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
from .sensitivity import CRITICAL_K, HeadSensitivity, critical_heads, head_sensitivity
from .sparsification import DEFAULT_RETENTION, SparsificationCurve, heads_kept, sparsification_curve

__all__ = [
    "CRITICAL_K",
    "DEFAULT_RETENTION",
    "MODES",
    "ORDERINGS",
    "HeadAblation",
    "HeadSensitivity",
    "Ordering",
    "SparsificationCurve",
    "ablate_heads",
    "attention_entropy",
    "critical_heads",
    "entropy_order",
    "head_orderings",
    "head_sensitivity",
    "heads_kept",
    "oracle_order",
    "random_order",
    "sparsification_curve",
    "taxonomy_order",
    "weight_norm_order",
    "weight_norms",
]
