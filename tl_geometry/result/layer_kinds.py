"""An analysis restricted to some of its layers, and a model's global and local layers apart.

SPEC §8 (i): on a model with sliding-window layers every figure is read for the global and the
local layers apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from . import select
from .headline import layer_windows
from .schema import AXES

#: A :class:`~tl_geometry.result.HeadAnalysis` (not imported: it imports this module).
Analysis = TypeVar("Analysis", bound=Any)

#: Metadata holding one entry per analysed layer, in layer order.
PER_LAYER_METADATA = ("window", "sink_visible", "instances", "sink_read_earlier", "votes_rechecked")
#: The two kinds of layer of a model with sliding windows (SPEC §1): full attention, or a window.
LAYER_KINDS = ("global", "local")


def layer_subset(result: Analysis, layers: Sequence[int]) -> Analysis:
    """``result`` restricted to the model layers ``layers``, in the order given: a new
    :class:`~tl_geometry.result.HeadAnalysis` (nothing is recomputed) with every tensor field
    along its ``layer`` axis and the :data:`PER_LAYER_METADATA` of those layers.

    >>> local = layer_subset(result, [0, 1, 2])   # doctest: +SKIP
    >>> local.f_score.shape[0]                     # doctest: +SKIP
    3
    """
    wanted = [int(x) for x in layers]
    if not wanted:
        raise ValueError("layer_subset needs at least one layer; give some of result.layers: "
                         f"{list(result.layers)}.")
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"layers={wanted} repeats a layer; give each of them once.")
    index = select.positions("layer", wanted, list(result.layers))
    assert isinstance(index, list)
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.init}
    for name, axes in AXES.items():
        value = fields.get(name)
        if isinstance(value, Tensor) and "layer" in axes:
            fields[name] = value.index_select(axes.index("layer"),
                                              torch.tensor(index, dtype=torch.long, device=value.device))
    metadata = dict(result.metadata)
    for key in PER_LAYER_METADATA:
        saved = metadata.get(key)
        if isinstance(saved, list) and len(saved) == len(result.layers):
            metadata[key] = [saved[i] for i in index]
    fields.update(layers=tuple(wanted), metadata=metadata)
    return type(result)(**fields)


def by_layer_kind(result: Analysis) -> dict[str, Analysis]:
    """The analysis of the global layers and that of the local (sliding-window) layers, by
    ``metadata["window"]``, each named in ``metadata["layer_kind"]`` (SPEC §1, §8 (i)); ``{}``
    when every layer is of one kind.

    >>> parts = by_layer_kind(gemma_result)                          # doctest: +SKIP
    >>> parts["global"].layers, parts["local"].layers[:5]            # doctest: +SKIP
    ((5, 11, 17), (0, 1, 2, 3, 4))
    """
    windows = layer_windows(result)
    kinds = {"global": [layer for layer, w in zip(result.layers, windows) if w is None],
             "local": [layer for layer, w in zip(result.layers, windows) if w is not None]}
    if not kinds["global"] or not kinds["local"]:
        return {}
    parts = {kind: layer_subset(result, layers) for kind, layers in kinds.items()}
    for kind, part in parts.items():
        part.metadata["layer_kind"] = kind
    return parts


__all__ = ["LAYER_KINDS", "PER_LAYER_METADATA", "by_layer_kind", "layer_subset"]
