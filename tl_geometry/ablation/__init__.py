"""Head ablation, single-head sensitivity and structured sparsification (SPEC §7).

``ablate_heads`` gives hooks on ``blocks.{l}.attn.hook_z`` that remove exactly the listed query
heads (GQA-safe); ``head_sensitivity`` and ``critical_heads`` score every head alone;
``ablation_vs_random`` compares a set of heads with random sets of the same size;
``head_orderings`` and ``sparsification_curve`` compare removal orders on held-out text. The
method is in ``docs/ablation.md``.

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
from .sensitivity import (
    CRITICAL_K,
    AblationVsRandom,
    HeadSensitivity,
    ablation_vs_random,
    critical_heads,
    head_sensitivity,
    mad_outliers,
    random_head_sets,
)
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
