"""Attention-sink diagnostics for one query row (SPEC §4).

The sink is the first valid position of the sequence. For a query whose valid keys are ``T_t``
and ``J = T_t ∖ {sink}``::

    mass        α_sink
    norm_ratio  κ = ‖v_sink‖ / mean_{j∈J} ‖v_j‖
    cosine      mean_{j∈J} cos(v_sink, v_j)        (signed, never clipped)
    mean_cosine cos(v_sink, mean_{j∈J} v_j)
    share       α_sink‖v_sink‖ / Σ_{j∈T_t} α_j‖v_j‖

with ``cos(a, b) = ⟨a, b⟩ / (‖a‖‖b‖ + η)``. Rows with ``J`` empty are NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .dtypes import COSINE_EPS, as_compute
from .figures import labels
from .heads import value_dots

#: The sink figures in storage order (the result's ``sink_field`` axis, :data:`.figures.FIGURES`).
SINK_FIELDS = labels("sink_field")


class SinkDiagnostics(NamedTuple):
    """Sink figures of SPEC §4, each of the rows' shape."""

    mass: Float[Tensor, "*batch"]
    norm_ratio: Float[Tensor, "*batch"]
    cosine: Float[Tensor, "*batch"]
    mean_cosine: Float[Tensor, "*batch"]
    share: Float[Tensor, "*batch"]


def sink_diagnostics(
    alpha: Float[Tensor, "*abatch key"],
    values: Float[Tensor, "*vbatch key d"],
    key_mask: Bool[Tensor, "*mbatch key"],
    sink: Int[Tensor, "*ibatch"] | int,
) -> SinkDiagnostics:
    """Sink mass, norm ratio κ, signed cosines and contribution share per row (SPEC §4), with
    ``sink`` each row's sink index (broadcast against the rows' leading dimensions).

    >>> v = torch.tensor([[-0.1, 0.0], [1.0, 0.0], [1.0, 0.0]])
    >>> d = sink_diagnostics(torch.tensor([0.5, 0.25, 0.25]), v, torch.ones(3, dtype=torch.bool),
    ...                      torch.tensor(0))
    >>> round(d.norm_ratio.item(), 6), round(d.cosine.item(), 6)
    (0.1, -1.0)
    """
    alpha, values = as_compute(alpha), as_compute(values)
    n_key = alpha.shape[-1]
    sink = torch.as_tensor(sink, device=alpha.device)
    is_sink = torch.arange(n_key, device=alpha.device) == sink.unsqueeze(-1)
    others = key_mask & ~is_sink
    n_others = others.sum(-1)
    # ⟨v_sink, v_j⟩ for every j and ‖v_sink‖², from a one-hot aggregate.
    sink_sq_norm, sink_dots = value_dots(is_sink.to(values.dtype), values)
    sink_norm = sink_sq_norm.sqrt()
    norms = torch.linalg.vector_norm(values, dim=-1)
    mean_other_norm = torch.where(others, norms, 0).sum(-1) / n_others
    cos_to_sink = sink_dots / (sink_norm.unsqueeze(-1) * norms + COSINE_EPS)
    cosine = torch.where(others, cos_to_sink, 0).sum(-1) / n_others
    mean_weights = others.to(values.dtype) / n_others.unsqueeze(-1)  # in the compute dtype, not float32
    mean_sq_norm, _ = value_dots(mean_weights.to(values.dtype), values)
    sink_dot_mean = torch.where(others, sink_dots, 0).sum(-1) / n_others
    mean_cosine = sink_dot_mean / (sink_norm * mean_sq_norm.sqrt() + COSINE_EPS)
    sink_alpha = torch.where(is_sink, alpha, 0).sum(-1)
    total = torch.where(key_mask, alpha * norms, 0).sum(-1)
    share = sink_alpha * sink_norm / total
    defined = n_others > 0
    nan = torch.tensor(torch.nan, dtype=alpha.dtype, device=alpha.device)
    fields = (sink_alpha, sink_norm / mean_other_norm, cosine, mean_cosine, share, defined)
    *fields, defined = torch.broadcast_tensors(*fields)
    return SinkDiagnostics(*(torch.where(defined, f, nan) for f in fields))
