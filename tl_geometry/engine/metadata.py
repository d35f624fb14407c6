"""What a result records about its run: options, shapes, model and weight processing."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._version import __version__
from .options import AnalysisOptions


def output_weights(model: Any, W_O: Tensor | None, layers: Sequence[int]) -> Tensor:
    """``W_O [layer, head, d_head, d_model]`` for ``space="output"``, from ``W_O`` or ``model``."""
    if W_O is None:
        W_O = getattr(model, "W_O", None) if model is not None else None
    if W_O is None:
        raise ValueError(
            "space='output' needs the output projections: pass model=... (with .W_O) or "
            "W_O=model.W_O, a [layer, head, d_head, d_model] tensor."
        )
    if not isinstance(W_O, Tensor):
        raise ValueError(f"W_O must be a torch tensor [layer, head, d_head, d_model], got {type(W_O).__name__}.")
    if W_O.ndim != 4 or max(layers) >= W_O.shape[0]:
        raise ValueError(f"W_O must be [layer, head, d_head, d_model] covering layer {max(layers)}, "
                         f"got shape {tuple(W_O.shape)}.")
    if not W_O.is_floating_point() or W_O.is_meta:
        raise ValueError(f"W_O must be a floating-point tensor with data, got {W_O.dtype} on {W_O.device}.")
    W_O = W_O.detach()
    if not torch.isfinite(W_O[list(layers)]).all():
        raise ValueError("W_O has NaN or inf entries in the analysed layers.")
    return W_O


def run_metadata(model: Any, source: Any, shape: tuple[int, int, int], opts: AnalysisOptions,
                 masked: bool, facts: Any = None) -> dict[str, Any]:
    """The metadata dict of a :class:`~tl_geometry.HeadAnalysis` (plain values only), with the
    model's :class:`~tl_geometry.inputs.facts.ModelFacts` ``facts`` as ``"model_facts"``, so that
    a saved result says what the analysis read of its model."""
    options = ("queries", "random_samples", "shuffle_samples", "shuffle", "seed", "distance",
               "space", "rank_by", "bounds")
    meta: dict[str, Any] = {
        "tl_geometry_version": __version__,
        "n_sequences": shape[0],
        "n_heads": shape[1],
        "n_positions": shape[2],
        "n_values": opts.n_values.tolist(),
        **{name: getattr(opts, name) for name in options},
        "attention_mask": masked,
        "cache_type": type(source).__name__,
        "model_name": None,
        "model_class": None,
        "loading": {},
        "model_facts": None if facts is None else {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(facts).items() if key != "name"},  # "model_name" names it
    }
    if model is not None:
        cfg = getattr(model, "cfg", None)
        meta["model_class"] = type(model).__name__
        meta["model_name"] = getattr(cfg, "model_name", None)
        meta["loading"] = _loading_info(model)
    return meta


def _loading_info(model: Any) -> dict[str, Any]:
    """How the weights were processed: folded value biases and centring change ``v`` and ``W_O``."""
    info: dict[str, Any] = dict(getattr(model, "tl_geometry_loading", {}) or {})
    cfg = getattr(model, "cfg", None)
    for key in ("fold_ln", "layer_norm_folding", "center_writing_weights", "center_unembed", "fold_value_biases",
                "default_prepend_bos", "dtype", "device"):
        value = getattr(cfg, key, None)
        if value is not None:
            info.setdefault(key, value if isinstance(value, (bool, int, float, str)) else str(value))
    for attr in ("compatibility_mode", "_compatibility_mode", "weights_processed", "_weights_processed"):
        value = getattr(model, attr, None)
        if isinstance(value, bool):
            info.setdefault(attr.lstrip("_"), value)
    return info
