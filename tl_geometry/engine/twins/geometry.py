"""Sink geometry and tied Gram matrices in torch: the twin of :mod:`..compiled.geometry`, for
every device."""

from __future__ import annotations

import torch
from einops import einsum
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ...functional.dtypes import COMPUTE_DTYPE, COSINE_EPS
from ...functional.heads import first_duplicate
from ..layout import SINK_COSINE, SINK_MEAN_COSINE, SINK_NORM_RATIO


def write_sink_geometry(
    values: Float[Tensor, "b g k d"], is_token: Bool[Tensor, "b k"], sink: Int[Tensor, " b"],
    queries: Int[Tensor, "b q"], h0: int, group_size: int, window: int,
    sink_fields: Float[Tensor, "b head q field"],
) -> None:
    """:func:`..compiled.geometry.sink_geometry` in torch, same arguments, NaN at −1 and padded
    queries and where the query's ``window`` does not hold the sink."""
    sees_sink = (queries - window < sink[:, None]) & (sink[:, None] <= queries)
    geometry = sink_geometry(values, is_token, sink, queries, sees_sink, window)
    ok = ((queries >= 0) & is_token.gather(1, queries.clamp_min(0)))[:, None, :, None]
    geometry = torch.where(ok, geometry.repeat_interleave(group_size, dim=1), torch.nan)
    fields = [SINK_NORM_RATIO, SINK_COSINE, SINK_MEAN_COSINE]
    sink_fields[:, h0 : h0 + values.shape[1] * group_size, :, fields] = geometry


def band_gram(values: Float[Tensor, "b g k d"], window: int) -> Float[Tensor, "b g k j"]:
    """``G = V Vᵀ`` on its band ``|i − j| < window`` (the pairs that the keys of a sliding-window
    query can form), at ``3·k·window·d`` multiply-adds instead of ``k²·d``: blocks of ``window``
    rows against the columns within their reach, zero where no block reaches. The whole matrix
    where the window holds every key.

        >>> v = torch.randn(1, 1, 6, 4, dtype=torch.float64)
        >>> bool(band_gram(v, 2)[0, 0, 0, 3] == 0)
        True
    """
    n_key = values.shape[2]
    if window >= n_key:
        # One batched product over (sequence, group): faster than matmul's broadcast on CPU, the
        # same products and sums.
        flat = values.reshape(-1, n_key, values.shape[-1])
        return torch.bmm(flat, flat.transpose(1, 2)).view(*values.shape[:2], n_key, n_key)
    gram = values.new_zeros(*values.shape[:2], n_key, n_key)
    for r0 in range(0, n_key, window):
        r1 = min(n_key, r0 + window)
        c0, c1 = max(0, r0 - window + 1), min(n_key, r1 + window - 1)
        gram[:, :, r0:r1, c0:c1] = values[:, :, r0:r1] @ values[:, :, c0:c1].transpose(-1, -2)
    return gram


def tied_gram(values: Float[Tensor, "b g k d"], window: int | None = None) -> Float[Tensor, "b g k j"]:
    """``G = V Vᵀ`` with duplicate rows made bit-identical (BLAS may round them apart), whole
    whatever the ``window``: a sliding-window query reads only the band (:func:`band_gram`)."""
    gram = values @ values.transpose(-1, -2)  # b g k j; matmul is markedly faster than einsum here
    dup = first_duplicate(values)
    if not torch.equal(dup, torch.arange(dup.shape[-1], device=dup.device).expand_as(dup)):
        gram = gram.gather(-2, dup[..., :, None].expand(gram.shape))
        gram = gram.gather(-1, dup[..., None, :].expand(gram.shape))
    return gram


def sink_geometry(
    values: Float[Tensor, "b g k d"], is_token: Bool[Tensor, "b k"], sink: Int[Tensor, " b"],
    queries: Int[Tensor, "b q"], sees_sink: Bool[Tensor, "b q"], window: int | None = None,
) -> Float[Tensor, "b g q 3"]:
    """κ, mean cosine to the sink and cosine to the mean, at each query (SPEC §4), over ``J_t``
    (:func:`..compiled.geometry.sink_geometry`): differences of prefix sums along the keys when
    most queries are chosen, else masked sums at the chosen queries. NaN where ``J_t`` is empty,
    and where ``sees_sink`` is False: a query that does not see the sink has none (SPEC §1, ours).
    """
    n_key = values.shape[2]
    keys = torch.arange(n_key, device=values.device)
    others = (is_token & (keys != sink[:, None])).to(COMPUTE_DTYPE)  # [b, k]
    norms = torch.linalg.vector_norm(values, dim=-1)  # [b, g, k]
    index = sink[:, None, None, None].expand(-1, values.shape[1], 1, values.shape[-1])
    v_sink = values.gather(2, index)  # [b, g, 1, d]
    sink_norm = norms.gather(-1, sink[:, None, None].expand(-1, values.shape[1], 1))
    sink_dots = (values @ v_sink.transpose(-1, -2)).squeeze(-1)  # [b, g, k]
    cos = sink_dots / (sink_norm * norms + COSINE_EPS)
    # The last key before query t's window (−1: none before it).
    before = (queries - window if window is not None else torch.full_like(queries, -1)).clamp(-1, n_key - 1)
    if 4 * queries.shape[1] >= n_key:  # prefix sums, read at the queries
        at = queries.clamp_min(0)[:, None, :].expand(-1, values.shape[1], -1)
        cut = before[:, None, :].expand(-1, values.shape[1], -1)
        prefix = others[:, None, :]

        def window_sum(sums: Tensor, dim: int) -> Tensor:  # prefix sums at t minus those before the window
            index, out = (at, cut) if dim == -1 else (at[..., None], cut[..., None])
            if dim != -1:
                index, out = (x.expand(-1, -1, -1, sums.shape[-1]) for x in (index, out))
            taken = sums.gather(dim, out.clamp_min(0)) * (out >= 0)
            return sums.gather(dim, index) - taken

        def upto(x: Tensor) -> Tensor:  # Σ_{j∈J_t} x_j at every query t, [b, g, q]
            return window_sum((x * prefix).cumsum(-1), -1)

        total = window_sum((values * prefix[..., None]).cumsum(2), 2)  # [b, g, q, d]
    else:  # masked sums at the chosen queries only
        seen = (keys <= queries[..., None]) & (keys > before[..., None])
        weight = (seen * others[:, None, :]).to(COMPUTE_DTYPE)  # [b, q, k]

        def upto(x: Tensor) -> Tensor:
            return einsum(x, weight, "b g k, b q k -> b g q")

        total = einsum(weight, values, "b q k, b g k d -> b g q d")
    count = torch.where(sees_sink[:, None, :], upto(torch.ones_like(norms)), 0.0)
    fields = torch.stack([
        sink_norm / (upto(norms) / count),
        upto(cos) / count,
        (upto(sink_dots) / count) / (sink_norm * (torch.linalg.vector_norm(total, dim=-1) / count) + COSINE_EPS),
    ], dim=-1)
    return torch.where((count > 0)[..., None], fields, torch.nan)
