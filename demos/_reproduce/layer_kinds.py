"""A model's global and local layers read apart (SPEC §8 (i)): the study as the claims see it.

Gemma-3 has five sliding-window (local) layers of 512 keys to each full-attention (global)
layer; Gemma-7B, the model the paper measured, has global layers only. A figure pooled over both
kinds describes neither, so every claim reads a model with both kinds as two runs, named
``"<model> · global"`` and ``"<model> · local"`` (each the analysis's figures for those layers:
:meth:`tl_geometry.HeadAnalysis.by_layer_kind`). The ablation and capacity tables (claims 6 and
7) measure a loss per head and stay whole per model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: Between a model's name and the kind of its layers in a split run's name.
SEPARATOR = " · "


def split(study: Any) -> Any:
    """``study`` with each model that has global and local layers read as two models, its
    analyses and decomposition nulls restricted to each kind; the rest unchanged."""
    analyses: dict[tuple[str, str], Any] = {}
    nulls: dict[tuple[str, str], dict[str, Any]] = {}
    for (model, corpus), result in study.analyses.items():
        parts = result.by_layer_kind()
        if not parts:
            analyses[model, corpus] = result
            if (model, corpus) in study.nulls:
                nulls[model, corpus] = study.nulls[model, corpus]
            continue
        for kind, part in parts.items():
            analyses[f"{model}{SEPARATOR}{kind}", corpus] = part
            if (model, corpus) in study.nulls:  # a null without the windows recorded is left out
                split_nulls = {name: null.by_layer_kind() for name, null in study.nulls[model, corpus].items()}
                nulls[f"{model}{SEPARATOR}{kind}", corpus] = {
                    name: parts_of[kind] for name, parts_of in split_nulls.items() if kind in parts_of}
    return dataclasses.replace(study, analyses=analyses, nulls=nulls)


def base(name: str) -> str:
    """The model of a run's name: ``"gemma3-270m · local"`` → ``"gemma3-270m"``."""
    return name.split(SEPARATOR)[0]


def kind(name: str) -> str | None:
    """The layer kind of a split run's name (``"global"``, ``"local"``), None for a whole model."""
    parts = name.split(SEPARATOR)
    return parts[1] if len(parts) > 1 else None


__all__ = ["SEPARATOR", "base", "kind", "split"]
