"""How the claims move with model size: every claim's rule applied to one model at a time.

The page's verdicts pool the runs of every model. Here each claim is decided again on the runs of
one model alone (its corpora, its ablation and capacity tables), by the same rule, so that a
verdict can be read against size: 135M → 270M → 0.5B. One model per size, each of another family
(Llama, Gemma-3, Qwen2), so size is confounded with architecture and training data; the page says
so, and calls a change a trend only when no step between two sizes goes the other way (ours).
"""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import layer_kinds
from .document import HELD, NOT_HELD, PARTLY, Claim, table
from .protocol import SIZES

#: Verdicts from weakest to strongest, to read a direction across sizes.
_STRENGTH = {NOT_HELD: 0, PARTLY: 1, HELD: 2}


def one_model(study: Any, model: str) -> Any:
    """The study restricted to ``model`` (a model, or one kind of its layers, :mod:`.layer_kinds`):
    its analyses, nulls, and its model's ablation and capacity tables."""
    whole = layer_kinds.base(model)
    return dataclasses.replace(
        study,
        analyses={k: v for k, v in study.analyses.items() if k[0] == model},
        nulls={k: v for k, v in study.nulls.items() if k[0] == model},
        ablation={k: v for k, v in study.ablation.items() if k == whole},
        capacity={k: v for k, v in study.capacity.items() if k == whole},
    )


def size_of(model: str) -> str:
    """The size the page names a run by: ``"270M"``, ``"270M global"`` for one kind of layers."""
    size = SIZES.get(layer_kinds.base(model), model)
    kind = layer_kinds.kind(model)
    return f"{size} {kind}" if kind else size


def per_model(study: Any, claims: Sequence[Callable[[Any, Path], Claim]]) -> dict[str, list[Claim]]:
    """Model → each claim decided on that model's runs alone (figures drawn to a scratch folder
    and dropped: the page shows the pooled ones)."""
    with tempfile.TemporaryDirectory() as scratch:
        return {model: [claim(one_model(study, model), Path(scratch)) for claim in claims]
                for model in study.models}


def direction(verdicts: Sequence[str]) -> str:
    """How a claim's verdict moves as size grows (ours): the same at every size; weakens
    (strengthens) when it moves and no step from one size to the next goes up (down); else
    without a trend. An undecided or too-few verdict at some size leaves the direction unread
    (SPEC §8: it has no level to compare)."""
    if not all(v in _STRENGTH for v in verdicts):
        return "has no direction to read (undecided or too few at some size)"
    levels = [_STRENGTH[v] for v in verdicts]
    if len(set(levels)) == 1:
        return "keeps the same verdict at every size"
    steps = [b - a for a, b in itertools.pairwise(levels)]
    if all(s <= 0 for s in steps):
        return "weakens as size grows"
    if all(s >= 0 for s in steps):
        return "strengthens as size grows"
    return "moves without a trend"


def across_sizes(verdicts: Sequence[str], models: Sequence[str]) -> str:
    """:func:`direction` across model sizes: a model read as its global and local layers apart
    (:mod:`.layer_kinds`) is one size, not two, so the direction is read once through each kind
    of its layers (with every other model) and stated where both readings agree; where they do
    not, the claim moves with the kind of layer, not with size."""
    kinds = sorted({k for m in models if (k := layer_kinds.kind(m))})
    if not kinds:
        return direction(verdicts)
    readings = {direction([v for v, m in zip(verdicts, models) if layer_kinds.kind(m) in (None, kind)])
                for kind in kinds}
    if len(readings) == 1:
        return readings.pop()
    if not all(v in _STRENGTH for v in verdicts):  # some verdict has no level: nothing to compare
        return direction(verdicts)
    return "reads differently through the global and the local layers, so no direction across sizes"


def section(pooled: Sequence[Claim], by_model: dict[str, list[Claim]]) -> list[str]:
    """The page's size section: a verdict table (claims × models, smallest first) and, per
    claim, how its verdict moves and each model's numbers under the rule."""
    models = list(by_model)
    size = [size_of(m) for m in models]
    header = ["claim"] + [f"{s} ({m})" for s, m in zip(size, models)]
    rows = [[f"{c.number}. {c.title}"] + [f"**{by_model[m][i].verdict}**" for m in models]
            for i, c in enumerate(pooled)]
    out = ["## How the claims move with model size", "",
           f"Each claim's rule applied again to the runs of one model alone ({' → '.join(size)} "
           "parameters; a model with sliding-window layers as its global and its local layers "
           "apart, SPEC §8 (i), with claims 6 and 7 read on the whole model). One model per size, "
           "each of another family, so size is confounded with "
           "architecture and training data, and so few sizes are not a trend test: a claim is "
           "said to weaken (strengthen) only when its verdict moves and no step from one size to "
           "the next goes the other way (ours).",
           "", table(header, rows, "l" + "l" * len(models)), ""]
    for i, c in enumerate(pooled):
        verdicts = [by_model[m][i].verdict for m in models]
        numbers = " ".join(f"*{s}:* **{by_model[m][i].verdict}**; {by_model[m][i].because}"
                           for s, m in zip(size, models))
        out.append(f"- **Claim {c.number}** {across_sizes(verdicts, models)}. {numbers}")
    out.append("")
    return out
