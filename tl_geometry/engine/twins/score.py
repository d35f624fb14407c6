"""Scoring in torch: the twin of :mod:`..compiled.score`, vectorised over sequences, heads,
queries, selections and N (only the Fisher–Yates steps of :mod:`.order` are a Python loop), in
blocks of queries of about :data:`..layout.BLOCK_ELEMENTS` selection weights.
"""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from ...functional.attention import visible_keys
from ...functional.dtypes import COMPUTE_DTYPE, COSINE_EPS, KEPT_MASS_MIN
from ...functional.heads import first_duplicate
from ...functional.selection import top_n_ranks
from ...functional.separability import scores_from_energies
from ..block import LayerBlock
from ..layout import (
    BLOCK_ELEMENTS,
    SEQUENCE_GROUPS,
    SINK_MASS,
    SINK_SHARE,
    ScoreChunk,
    ScoreOutputs,
    ScoreSettings,
)
from ..options import NULL_UNSELECTED
from ..rng import torch_mix
from .order import random_ranks, shuffled, unselected_sources


def score_vectors(data: LayerBlock, chunk: Tensor) -> Tensor:
    """The value vectors as :func:`score_rows` takes them: as they are."""
    return chunk


def score_rows(chunk: ScoreChunk, settings: ScoreSettings, outputs: ScoreOutputs) -> None:
    """:func:`..compiled.score.score_rows` in torch, same records, outputs written in place.

    Inner products come from the vectors or the tied Gram matrices ``chunk.gram`` where not empty
    (:class:`_Dots`), as in the kernel. The truncation figures (SPEC §10) come from inner products
    here (:func:`_truncation`), not from the difference vectors: two computations that the tests
    hold to each other. ``chunk.is_token`` keeps padding out of the candidates (no ``start``)."""
    queries, values, gram = chunk.queries, chunk.values, chunk.gram
    n_ch = values.shape[1] * chunk.group_size
    n_sel = 2 + settings.samples + settings.shuffles
    per_query = chunk.rows.shape[0] * n_ch * n_sel * len(settings.n_values) * values.shape[2]
    step = max(1, BLOCK_ELEMENTS // max(per_query, 1))
    inner = _Dots(values, gram if gram.numel() else None)
    heads = slice(chunk.h0, chunk.h0 + n_ch)
    for q0 in range(0, queries.shape[1], step):
        block = slice(q0, min(queries.shape[1], q0 + step))
        _score_block(chunk._replace(row_of=chunk.row_of[:, block], queries=queries[:, block]), settings,
                     ScoreOutputs(*(out[:, heads, block] for out in outputs)), inner)


def _score_block(chunk: ScoreChunk, settings: ScoreSettings, outputs: ScoreOutputs, dots: _Dots) -> None:
    """:func:`score_rows` for one block of queries: ``chunk``'s queries and ``outputs`` are the
    block's (the outputs also cut to the chunk's heads); ``dots`` gives the inner products."""
    rows, row_of, h0, group_size, _, queries, is_token, _, sink, window, real_index, sequence_keys, _, _ = chunk
    n_values, samples, shuffles, shuffle_kind, by_contribution, cosine = settings
    metrics, sink_in_top, sink_fields, random_var = outputs
    device = dots.values.device
    n_b, n_cg, n_key = dots.values.shape[:3]
    n_ch = n_cg * group_size
    t = queries.clamp_min(0)  # [b, q]
    ok = (queries >= 0) & is_token.gather(1, t)
    keys = torch.arange(n_key, device=device)
    # The candidates T_t: real keys the query sees (t − window < i ≤ t; SPEC §1).
    valid = visible_keys(t, n_key, window=window, key_mask=is_token[:, :n_key]) & ok[..., None]  # [b, q, k]
    # [b, q]: a query whose window starts after the sink, or that comes before it, has none
    sees_sink = (t - window < sink[:, None]) & (sink[:, None] <= t)
    index = row_of.clamp_min(0)[:, None, :, None].expand(n_b, n_ch, -1, rows.shape[-1])
    alpha = rows[:, h0 : h0 + n_ch].gather(2, index)[..., :n_key].to(COMPUTE_DTYPE)
    alpha = torch.where(valid[:, None], alpha, 0.0)  # [b, h, q, k]
    gdiag = dots.squared_norms.repeat_interleave(group_size, dim=1)[:, :, None]
    norms = gdiag.clamp_min(0).sqrt()  # [b, h, 1, k]
    is_sink = (keys == sink[:, None, None]) & sees_sink[..., None]  # [b, q, k]

    total = (alpha * norms).sum(-1)
    mass = (alpha * is_sink[:, None]).sum(-1)
    sink_norm = (norms * is_sink[:, None]).sum(-1)
    has_other = (ok & sees_sink & (valid.sum(-1) > 1))[:, None]  # SPEC §4 needs a key besides the sink
    sink_fields[..., SINK_MASS] = torch.where(has_other, mass, torch.nan)
    sink_fields[..., SINK_SHARE] = torch.where(has_other, mass * sink_norm / total, torch.nan)

    score = alpha * norms if by_contribution else alpha
    top = top_n_ranks(score, valid[:, None])
    sink_rank = (top * is_sink[:, None]).sum(-1)  # [b, h, q]
    sink_in_top.copy_((sink_rank[..., None] < n_values) & sees_sink[:, None, :, None])
    keep = valid & ~is_sink
    dropped = top_n_ranks(score, keep[:, None])
    m = valid.sum(-1)  # [b, q]
    row_key = torch_mix(torch_mix(sequence_keys[:, None] + real_index.gather(1, t))[:, None]
                        + torch.arange(h0, h0 + n_ch, device=device)[:, None])  # [b, h, q]
    whole = alpha[:, :, :, None]  # one weight row for every selection: [b, h, q, 1, k]
    # name → (weights, ranks, candidate keys, the unselected null's value sources or None)
    groups: dict[str, tuple[Tensor, Tensor, Tensor, Tensor | None]] = {"top": (whole, top[:, :, :, None], valid, None)}
    if samples > 0:
        groups["random"] = (whole, random_ranks(valid, m, row_key, samples, n_values), valid, None)
    if shuffles > 0 and shuffle_kind == NULL_UNSELECTED:
        source = unselected_sources(top, keep, row_key, shuffles, n_values)
        groups["shuffled"] = (whole, top[:, :, :, None], valid, source)
    elif shuffles > 0:
        weights, rank = shuffled(alpha, top, keep, row_key, shuffles, shuffle_kind, norms)
        groups["shuffled"] = (weights, rank, valid, None)
    groups["sink_removed"] = (whole, dropped[:, :, :, None], keep, None)
    # [b, h, q, n, metric]; each part averaged over the selections on its own, so that adding
    # the truncation figures leaves the reduction of the others as it was, bit for bit.
    out: dict[str, Tensor] = {}
    spread: Tensor | None = None
    for name, (w, rank, keyset, held) in groups.items():
        parts = _score(w, dots, gdiag, rank, keyset[:, None, :, None, None], n_values, group_size, cosine, held,
                       truncate=name in ("top", "sink_removed"))
        out[name] = torch.cat([part.mean(3) for part in parts], dim=-1)
        if name == "random" and samples > 1:  # the Monte Carlo variance of the mean over R subsets, s²/R (SPEC §3)
            spread = torch.cat([part.var(3) for part in parts], dim=-1) / samples
    random_var.fill_(torch.nan)
    if spread is not None:
        random_var.copy_(torch.where(ok[:, None, :, None, None], spread, torch.nan))
    nan = torch.full_like(out["top"], torch.nan)
    out["sink_removed"] = torch.where(sees_sink[:, None, :, None, None], out["sink_removed"], nan)  # no sink: skipped
    grouped = torch.stack([out.get(g, nan) for g in SEQUENCE_GROUPS], dim=3)
    metrics.copy_(torch.where(ok[:, None, :, None, None, None], grouped, torch.nan))


class _Dots:
    """``⟨v_k, Σ_j w_j v_j⟩`` for rows of weights ``w`` over the keys of each value group, from
    the value vectors or from the tied Gram matrices ``gram`` where given. Keys with bit-identical
    value vectors read the first one's products and squared norm (SPEC §3's exact ties)."""

    def __init__(self, values: Float[Tensor, "b g k d"], gram: Float[Tensor, "b g k j"] | None = None) -> None:
        self.values, self.gram = values, gram
        if gram is not None:  # tied already (twins.geometry.tied_gram): its diagonal too
            self.tied = False
            self.squared_norms = gram.diagonal(dim1=-2, dim2=-1)  # ‖v_k‖², [b, g, k]
            return
        self.duplicate = first_duplicate(values)  # [b, g, k]
        self.tied = not torch.equal(self.duplicate, torch.arange(values.shape[2], device=values.device)
                                    .expand_as(self.duplicate))
        self.squared_norms = self._tie((values * values).sum(-1))

    def __call__(self, weights: Float[Tensor, "b g rows k"]) -> Float[Tensor, "b g rows k"]:
        if self.gram is not None:
            return weights @ self.gram  # tied already
        return self.of(self.aggregate(weights))

    def aggregate(self, weights: Float[Tensor, "b g rows k"]) -> Float[Tensor, "b g rows d"]:
        """``s = Σ_k w_k v_k`` of every row of weights."""
        return weights @ self.values

    def of(self, aggregate: Float[Tensor, "b g rows d"]) -> Float[Tensor, "b g rows k"]:
        """``⟨v_k, s⟩`` at every key, for every aggregate ``s``."""
        return self._tie(aggregate @ self.values.transpose(-1, -2))

    def distance(self, alpha: Tensor, key: Tensor, aggregate: Tensor, group_size: int,
                 source: Tensor | None) -> Tensor:
        """``D = ‖α_k v_k − s‖`` at one key per row, from the vectors (as
        :func:`..compiled.score._distance`): ``key [b, h, q, sel, n]``, ``aggregate [b, h, q, sel,
        n, d]``; with ``source`` (the unselected null) key ``k`` holds ``source[k]``'s vector."""
        weight = alpha[..., None, :].expand(*key.shape, alpha.shape[-1]).gather(-1, key[..., None])
        held = key if source is None else source.gather(-1, key[..., None]).squeeze(-1)
        by_head = self.values.repeat_interleave(group_size, dim=1)  # [b, h, k, d]
        index = held.flatten(2)[..., None].expand(-1, -1, -1, by_head.shape[-1])
        vectors = by_head.gather(2, index).view(*key.shape, -1)
        return (weight * vectors - aggregate).square().sum(-1).sqrt()

    def _tie(self, x: Tensor) -> Tensor:
        if not self.tied:
            return x
        return x.gather(-1, self.duplicate.view(*self.duplicate.shape[:2], *(1,) * (x.ndim - 3), -1).expand(x.shape))


def _score(alpha, inner, gdiag, rank, keyset, n_values, group_size, cosine, source=None,
           truncate=True) -> tuple[Tensor, Tensor]:
    """The metrics of SPEC §3 and the truncation figures of SPEC §10 (NaN unless ``truncate``)
    of every (selection, N), ``[b, h, q, sel, n, metric]``, NaN where N does not fit.
    ``alpha [b, h, q, sel or 1, k]`` are the weights of each selection's keys; with ``source
    [b, h, q, sample, n, k]`` (the unselected null), key ``k`` holds the value of ``source[k]``.
    """
    n = n_values[:, None]
    selected = rank[..., None, :] < n  # [b, h, q, sel, n, k]
    weights = alpha[..., None, :] * selected
    grouped = rearrange(weights, "b (g r) q s n k -> b g (r q s n) k", r=group_size)
    aggregate = None if inner.gram is not None else inner.aggregate(grouped)  # the vectors path's s
    dots = rearrange(inner(grouped) if aggregate is None else inner.of(aggregate),
                     "b g (r q s n) k -> b (g r) q s n k", r=group_size, q=alpha.shape[2], s=rank.shape[3])
    sq_s = (weights * dots).sum(-1, keepdim=True)
    a = alpha[..., None, :]
    g = gdiag[:, :, :, None, None, :]
    if source is not None:  # S_N keeps its values: s_N and ‖s_N‖² are the top-N set's
        dots = dots.expand(*source.shape).gather(-1, source)
        g = g.expand(*source.shape).gather(-1, source)
    if cosine:
        e = 1 - a * dots / (a * g.clamp_min(0).sqrt() * sq_s.clamp_min(0).sqrt() + COSINE_EPS)
    else:
        e = a * (a * g - 2 * dots)
    scores, e_min, e_max = scores_from_energies(e, selected, keyset, n.squeeze(-1))
    if cosine:
        margin = scores.margin
    elif aggregate is not None:  # D_min and D_max from the vectors, at the lowest key of each extreme E (as the kernel)
        aggregate = rearrange(aggregate, "b g (r q s n) d -> b (g r) q s n d", r=group_size,
                              q=alpha.shape[2], s=rank.shape[3])
        unselected = keyset & ~selected
        d_min = inner.distance(alpha, torch.where(unselected, e, torch.inf).argmin(-1), aggregate, group_size, source)
        d_max = inner.distance(alpha, torch.where(selected, e, -torch.inf).argmax(-1), aggregate, group_size, source)
        margin = d_min - d_max
    else:  # from the Gram matrix E + ‖s‖² is exact where it is 0 (as the kernel)
        s2 = sq_s.squeeze(-1)
        d_min = (e_min + s2).clamp_min(0).sqrt()
        d_max = (e_max + s2).clamp_min(0).sqrt()
        margin = torch.where(d_min + d_max > 0, (e_min - e_max) / (d_min + d_max), 0.0)
    n_keys = keyset.sum(-1)  # [b, 1, q, 1, 1]
    out = torch.stack(tuple(scores._replace(margin=margin)), dim=-1)
    if truncate:
        cut = torch.stack(_truncation(alpha, inner, dots, selected, sq_s.squeeze(-1), group_size), dim=-1)
    else:
        cut = torch.full((*out.shape[:-1], 2), torch.nan, dtype=out.dtype, device=out.device)
    defined = n.squeeze(-1) < n_keys  # [b, 1, q, 1, n]: 1 ≤ N < |keys|
    return torch.where(defined[..., None], out, torch.nan), torch.where(defined[..., None], cut, torch.nan)


def _truncation(alpha, inner, dots, selected, sq_s, group_size) -> tuple[Tensor, Tensor]:
    """``τ_N`` and ``‖o − o_N‖/‖o‖`` of every (selection, N), ``[b, h, q, sel, n]``, as
    :func:`..compiled.score._truncation` defines them. ``alpha`` is 0 off the row's keys, so the
    tail is every key weighted outside the selection (the sink too, in the sink-removed group).
    With ``t = o − s_N``, ``o − o_N = t − r s_N`` where ``r = (1 − kept)/kept``.
    """
    grouped = rearrange(alpha, "b (g r) q s k -> b g (r q s) k", r=group_size)
    o_dots = rearrange(inner(grouped), "b g (r q s) k -> b (g r) q s k", r=group_size,
                       q=alpha.shape[2], s=alpha.shape[3])  # ⟨v_k, o⟩
    sq_o = (alpha * o_dots).sum(-1)[..., None]  # ‖o‖², [b, h, q, sel, 1]
    in_tail = alpha[..., None, :] * ~selected  # [b, h, q, sel, n, k]
    tail = in_tail.sum(-1)
    kept = (alpha[..., None, :] * selected).sum(-1)
    t_s = (in_tail * dots).sum(-1)  # ⟨t, s_N⟩ with t = o − s_N
    t_t = (in_tail * (o_dots[..., None, :] - dots)).sum(-1)  # ‖t‖²
    enough = kept >= KEPT_MASS_MIN
    r = (1 - kept) / torch.where(enough, kept, 1.0)
    error = ((t_t - 2 * r * t_s + r * r * sq_s).clamp_min(0) / sq_o).sqrt()
    return tail, torch.where((sq_o > 0) & enough, error, torch.nan)
