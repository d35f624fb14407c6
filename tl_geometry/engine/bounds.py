"""Bounds of the top-N sets of one layer (SPEC §6): inversion certificates, regime bounds and
the shell certificate (:mod:`.shell`), in plain torch, one sequence and block of queries at a
time (``bounds=True`` only). Next to ``(P̲, R̲, F̲)``, each kind's ``"separated"`` (ours) is the
indicator ``P̲ = R̲ = 1``: its mean is the fraction of instances the bound proves separated (for
the inversion certificate, the measured fraction, ``GInv = 0 ⇔ P = R = 1``).
"""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from ..functional.attention import visible_keys
from ..functional.bounds import (
    RegimeParams,
    inversion_bounds,
    pair_stats,
    params_from_pairs,
    regime_bounds,
)
from ..functional.dtypes import COMPUTE_DTYPE
from ..functional.regime import diagnostics_from_pairs
from ..functional.selection import top_n_ranks
from .block import LayerBlock, group_values
from .layout import BLOCK_ELEMENTS
from .options import AnalysisOptions
from .shell import SHELL_KINDS, shell_block


def layer_bounds(
    data: LayerBlock, opts: AnalysisOptions, inversions: Tensor, layer: int
) -> tuple[Tensor, Tensor]:
    """Per-sequence means ``[b, head, kind, n, (P, R, F, separated)]`` (kinds: ``BOUND_KINDS``)
    and regime diagnostics ``[b, head, field]``, from the measured GInv ``inversions``."""
    batch, n_heads, n_pos = data.source.shape
    values = group_values(data, 0, batch, n_pos)  # [b, g, k, d]
    # Extremes over each sequence's real keys are certificates for every query of it; quantiles
    # give the predicted envelope (SPEC §6b).
    pairs = pair_stats(values, data.sink[:, None], data.is_token[:, None])
    regimes = (params_from_pairs(pairs, "certificate"), params_from_pairs(pairs, "predict"))
    regime = torch.stack(diagnostics_from_pairs(pairs), dim=-1).repeat_interleave(data.group_size, dim=1)
    n_values = opts.n_values.to(values.device)
    n_list = n_values.tolist()
    inverted = torch.stack(inversion_bounds(n_values, inversions), dim=-1)  # [b, h, q, n, 3]
    out = torch.full((batch, n_heads, inversions.shape[2], len(regimes) + len(SHELL_KINDS), len(n_values), 3),
                     torch.nan, dtype=COMPUTE_DTYPE, device=values.device)
    norms = torch.linalg.vector_norm(values, dim=-1).repeat_interleave(data.group_size, dim=1)
    step = max(1, BLOCK_ELEMENTS // (n_heads * n_pos))
    for b in range(batch):
        for q0 in range(0, data.queries.shape[1], step):
            t = data.queries[b, q0 : q0 + step]
            ok = data.is_token[b].gather(0, t.clamp_min(0)) & (t >= 0)
            # T_t: the real keys each query sees (its sliding window, SPEC §1), [q, k]
            key_mask = visible_keys(t[None], n_pos, window=data.window, key_mask=data.is_token[b : b + 1])[0]
            key_mask &= ok[:, None]
            rows, row_of = data.source.rows(b, b + 1, t[None])
            alpha = rows[0][:, row_of[0].clamp_min(0)].to(COMPUTE_DTYPE)  # [h, q, k]
            alpha = torch.where(key_mask, alpha, 0.0)
            score = alpha * norms[b][:, None] if opts.rank_by == "contribution" else alpha
            top = top_n_ranks(score, key_mask)
            split = rearrange(alpha, "(g r) q k -> g r q k", r=data.group_size)
            ranks = rearrange(top, "(g r) q k -> g r q k", r=data.group_size)
            for kind, params in enumerate(regimes):
                p = RegimeParams(*(x[b][:, None, None] for x in params))
                for i, n in enumerate(n_list):
                    selected = ranks < n
                    bound = regime_bounds(split, p, n, sink=data.sink[b], key_mask=key_mask,
                                          selected=selected & key_mask)
                    out[b, :, q0 : q0 + step, kind, i] = rearrange(
                        torch.stack(bound, dim=-1), "g r q f -> (g r) q f")
            shell = shell_block(split, key_mask, ranks, values[b], n_list)  # [g, r, q, kind, n, 3]
            out[b, :, q0 : q0 + step, len(regimes):] = rearrange(shell, "g r q k n f -> (g r) q k n f")
    bounds = torch.cat([inverted[:, :, :, None], out], dim=3)  # [b, h, q, kind, n, 3]
    ok_rows = data.is_token.gather(1, data.queries.clamp_min(0)) & (data.queries >= 0)
    bounds = torch.where(ok_rows[:, None, :, None, None, None], bounds, torch.nan)
    bounds = torch.cat([bounds, separated(bounds)[..., None]], dim=-1)  # [..., (P, R, F, separated)]
    finite = torch.isfinite(bounds)
    mean = torch.where(finite, bounds, 0).sum(2) / finite.sum(2)
    return mean, regime


def separated(bounds: Float[Tensor, "*batch 3"]) -> Float[Tensor, "*batch"]:
    """1 where the bound certifies ``P = R = 1`` (``P̲ = R̲ = 1``), else 0; NaN where undefined."""
    p, r = bounds[..., 0], bounds[..., 1]
    return torch.where(torch.isnan(p) | torch.isnan(r), torch.nan, ((p == 1) & (r == 1)).to(bounds.dtype))
