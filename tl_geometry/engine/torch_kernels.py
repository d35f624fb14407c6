"""Pure-torch twins of the compiled kernels, for CUDA and every device numba does not serve.

Same inputs, outputs and random stream as :mod:`.score_kernel` (the tests compare the two against
the NumPy reference), vectorised over sequences, heads, queries, selections and N instead of
looping over rows; only the Fisher–Yates steps (at most ``max N``) are a Python loop. Work is
split over queries so that one block holds about :data:`BLOCK_ELEMENTS` selection weights.
"""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..functional._types import COMPUTE_DTYPE, COSINE_EPS
from ..functional.attention import visible_keys
from ..functional.selection import _inverse_permutation
from ..functional.separability import Separability, chance_corrected
from .options import NO_WINDOW, NULL_NORMS, NULL_UNSELECTED, NULL_VALUES
from .rng import SHUFFLE_SALT, torch_mix, torch_swap_index

#: Metrics before the truncation figures of SPEC §10 (the last two).
_N_SEPARABILITY = len(Separability._fields)

BLOCK_ELEMENTS = 1 << 22
_LEAK_TOL = 1e-4


def check_and_vote(
    rows: Float[Tensor, "batch head query key"], q_start: int, is_token: Bool[Tensor, "batch pos"],
    sink: Int[Tensor, " batch"], norms: Float[Tensor, "batch group key"], group_size: int,
    stats: Float[Tensor, "batch head stat"], votes: Int[Tensor, "batch head 3"], window: int = NO_WINDOW,
) -> None:
    """:func:`.check_kernel.check_and_vote` in torch, one sequence at a time: the rows of queries
    ``q_start …`` add to ``stats`` and ``votes`` (written in place); ``window`` is the layer's
    sliding window (:data:`.options.NO_WINDOW`: none)."""
    from .check_kernel import (
        ST_DEAD,
        ST_DEAD_Q,
        ST_FUTURE,
        ST_MIN,
        ST_NONFINITE,
        ST_NONFINITE_K,
        ST_NONFINITE_Q,
        ST_PADDING,
        ST_ROW_SUM,
        ST_WINDOW,
    )

    batch, _, n_q, n_pos = rows.shape
    device = rows.device
    keys = torch.arange(n_pos, device=device)
    positions = q_start + torch.arange(n_q, device=device)
    causal = keys[None, :] <= positions[:, None]  # [q, k]
    in_window = keys[None, :] > positions[:, None] - window  # [q, k]; all True without a window
    for b in range(batch):
        x = rows[b].to(COMPUTE_DTYPE)  # [h, q, k]
        query_real = is_token[b, q_start : q_start + n_q]
        row_real = query_real[None, :, None]
        valid = causal & in_window & is_token[b][None, :] & row_real
        finite = torch.isfinite(x)
        bad = valid & ~finite
        s = stats[b]
        first_q, first_k = _first_index(bad)
        new = (s[:, ST_NONFINITE] == 0) & bad.any((-1, -2))
        s[:, ST_NONFINITE_Q] = torch.where(new, first_q + q_start, s[:, ST_NONFINITE_Q])
        s[:, ST_NONFINITE_K] = torch.where(new, first_k, s[:, ST_NONFINITE_K])
        s[:, ST_NONFINITE] += bad.sum((-1, -2)).to(COMPUTE_DTYPE)
        leak = (~valid & row_real) & ~(x.abs() <= _LEAK_TOL)
        amount = torch.where(torch.isfinite(x), x.abs(), torch.inf)
        s[:, ST_FUTURE] = torch.maximum(s[:, ST_FUTURE], torch.where(leak & ~causal, amount, 0).amax((-1, -2)))
        padding = causal & ~is_token[b][None, :]
        s[:, ST_PADDING] = torch.maximum(s[:, ST_PADDING], torch.where(leak & padding, amount, 0).amax((-1, -2)))
        before = causal & ~in_window & is_token[b][None, :]  # real keys before the window
        s[:, ST_WINDOW] = torch.maximum(s[:, ST_WINDOW], torch.where(leak & before, amount, 0).amax((-1, -2)))
        good = valid & finite
        s[:, ST_MIN] = torch.minimum(s[:, ST_MIN], torch.where(good, x, 0).amin((-1, -2)).clamp_max(0))
        row_sum = torch.where(good, x, 0).sum(-1)  # [h, q]
        s[:, ST_ROW_SUM] = torch.maximum(s[:, ST_ROW_SUM], torch.where(query_real, row_sum, 0).amax(-1))
        dead = query_real & (row_sum.abs() < 1e-6)
        new = (s[:, ST_DEAD] == 0) & dead.any(-1)
        first_dead = dead.to(torch.int8).argmax(-1).to(COMPUTE_DTYPE) + q_start
        s[:, ST_DEAD_Q] = torch.where(new, first_dead, s[:, ST_DEAD_Q])
        s[:, ST_DEAD] += dead.sum(-1).to(COMPUTE_DTYPE)
        head_norms = norms[b].repeat_interleave(group_size, dim=0)[:, None, :]  # [h, 1, k]
        winner = torch.where(good, x * head_norms, -1.0).argmax(-1)  # first maximum: lower index
        counted = query_real & (positions > sink[b])
        kind = torch.where(winner == positions, 0, torch.where(winner == sink[b], 1, 2))
        votes[b] += torch.nn.functional.one_hot(kind, 3).mul(counted[None, :, None]).sum(1)


def _first_index(bad: Bool[Tensor, "head query key"]) -> tuple[Tensor, Tensor]:
    """(query, key) of each head's first True in row-major order, −1 where none."""
    flat = bad.flatten(1)
    pos = flat.to(torch.int8).argmax(-1)
    n_key = bad.shape[-1]
    none = ~flat.any(-1)
    q = torch.where(none, -1, pos // n_key).to(COMPUTE_DTYPE)
    k = torch.where(none, -1, pos % n_key).to(COMPUTE_DTYPE)
    return q, k


def score_rows(
    rows: Tensor, row_of: Tensor, h0: int, group_size: int, g0: int, queries: Tensor, is_token: Tensor,
    sink: Tensor, window: int, real_index: Tensor, sequence_keys: Tensor, gram: Tensor, values: Tensor,
    n_values: Tensor, samples: int, shuffles: int, shuffle_kind: int, by_contribution: bool, cosine: bool,
    metrics: Tensor,
    sink_in_top: Tensor, sink_fields: Tensor,
) -> None:
    """:func:`.score_kernel.score_rows` in torch: same arguments, same outputs (written in place).

    The truncation figures (SPEC §10) come from the Gram matrix here (:func:`_truncation`), not
    from ``values`` as in the kernel: two computations that the tests hold to each other."""
    n_cg, n_key = gram.shape[1], gram.shape[-1]
    n_ch = n_cg * group_size
    n_sel = 2 + samples + shuffles
    per_query = rows.shape[0] * n_ch * n_sel * len(n_values) * n_key
    step = max(1, BLOCK_ELEMENTS // max(per_query, 1))
    for q0 in range(0, queries.shape[1], step):
        q1 = min(queries.shape[1], q0 + step)
        _score_block(rows, row_of[:, q0:q1], h0, group_size, queries[:, q0:q1], is_token, sink, window, real_index,
                     sequence_keys, gram, n_values, samples, shuffles, shuffle_kind, by_contribution, cosine,
                     metrics[:, h0 : h0 + n_ch, q0:q1], sink_in_top[:, h0 : h0 + n_ch, q0:q1],
                     sink_fields[:, h0 : h0 + n_ch, q0:q1])


def _score_block(rows, row_of, h0, group_size, queries, is_token, sink, window, real_index, sequence_keys, gram,
                 n_values, samples, shuffles, shuffle_kind, by_contribution, cosine, metrics, sink_in_top,
                 sink_fields) -> None:
    device = gram.device
    n_b, n_cg, n_key = gram.shape[0], gram.shape[1], gram.shape[-1]
    n_ch = n_cg * group_size
    t = queries.clamp_min(0)  # [b, q]
    ok = (queries >= 0) & is_token.gather(1, t)
    keys = torch.arange(n_key, device=device)
    # The candidates T_t: real keys the query sees (t − window < i ≤ t; SPEC §1).
    valid = visible_keys(t, n_key, window=window, key_mask=is_token[:, :n_key]) & ok[..., None]  # [b, q, k]
    sees_sink = t - window < sink[:, None]  # [b, q]: a query whose window starts after the sink has none
    index = row_of.clamp_min(0)[:, None, :, None].expand(n_b, n_ch, -1, rows.shape[-1])
    alpha = rows[:, h0 : h0 + n_ch].gather(2, index)[..., :n_key].to(COMPUTE_DTYPE)
    alpha = torch.where(valid[:, None], alpha, 0.0)  # [b, h, q, k]
    gdiag = gram.diagonal(dim1=-2, dim2=-1).repeat_interleave(group_size, dim=1)[:, :, None]
    norms = gdiag.clamp_min(0).sqrt()  # [b, h, 1, k]
    is_sink = (keys == sink[:, None, None]) & sees_sink[..., None]  # [b, q, k]

    total = (alpha * norms).sum(-1)
    mass = (alpha * is_sink[:, None]).sum(-1)
    sink_norm = (norms * is_sink[:, None]).sum(-1)
    has_other = (ok & sees_sink & (valid.sum(-1) > 1))[:, None]  # SPEC §4 needs a key besides the sink
    sink_fields[..., 0] = torch.where(has_other, mass, torch.nan)
    sink_fields[..., 4] = torch.where(has_other, mass * sink_norm / total, torch.nan)

    score = alpha * norms if by_contribution else alpha
    top = _ranks(score, valid[:, None])
    sink_rank = (top * is_sink[:, None]).sum(-1)  # [b, h, q]
    sink_in_top.copy_((sink_rank[..., None] < n_values) & sees_sink[:, None, :, None])
    keep = valid & ~is_sink
    dropped = _ranks(score, keep[:, None])
    m = valid.sum(-1)  # [b, q]
    row_key = torch_mix(torch_mix(sequence_keys[:, None] + real_index.gather(1, t))[:, None]
                        + torch.arange(h0, h0 + n_ch, device=device)[:, None])  # [b, h, q]
    whole = alpha[:, :, :, None]  # one weight row for every selection: [b, h, q, 1, k]
    # name → (weights, ranks, candidate keys, the unselected null's value sources or None)
    groups: dict[str, tuple[Tensor, Tensor, Tensor, Tensor | None]] = {"top": (whole, top[:, :, :, None], valid, None)}
    if samples > 0:
        groups["random"] = (whole, _random_ranks(valid, m, row_key, samples, n_values), valid, None)
    if shuffles > 0 and shuffle_kind == NULL_UNSELECTED:
        source = _unselected_sources(top, keep, row_key, shuffles, n_values)
        groups["shuffled"] = (whole, top[:, :, :, None], valid, source)
    elif shuffles > 0:
        weights, rank = _shuffled(alpha, top, keep, row_key, shuffles, shuffle_kind, norms)
        groups["shuffled"] = (weights, rank, valid, None)
    groups["sink_removed"] = (whole, dropped[:, :, :, None], keep, None)
    # [b, h, q, n, metric]; each part averaged over the selections on its own, so that adding
    # the truncation figures leaves the reduction of the others as it was, bit for bit.
    out = {name: torch.cat([part.mean(3) for part in _score(w, gram, gdiag, rank, keyset[:, None, :, None, None],
                                                            n_values, group_size, cosine, source)], dim=-1)
           for name, (w, rank, keyset, source) in groups.items()}
    if "shuffled" in out and shuffle_kind != NULL_VALUES:  # SPEC §10 figures: the values null only
        out["shuffled"][..., _N_SEPARABILITY:] = torch.nan
    nan = torch.full_like(out["top"], torch.nan)
    out["sink_removed"] = torch.where(sees_sink[:, None, :, None, None], out["sink_removed"], nan)  # no sink: skipped
    grouped = torch.stack([out.get(g, nan) for g in ("top", "random", "shuffled", "sink_removed")], dim=3)
    metrics.copy_(torch.where(ok[:, None, :, None, None, None], grouped, torch.nan))


def _ranks(score: Tensor, valid: Tensor) -> Tensor:
    """Rank by decreasing score, ties → lower index, invalid keys last (SPEC §2)."""
    order = torch.sort(torch.where(valid, score, -torch.inf), dim=-1, descending=True, stable=True)
    return _inverse_permutation(order.indices)


def _random_ranks(valid: Tensor, m: Tensor, row_key: Tensor, samples: int, n_values: Tensor) -> Tensor:
    """Ranks of the partial Fisher–Yates shuffles of :mod:`.rng` (``[b, h, q, sample, k]``)."""
    n_b, n_h, n_q = row_key.shape
    n_key = valid.shape[-1]
    keys = torch.arange(n_key, device=valid.device)
    listed = torch.sort(torch.where(valid, keys, n_key), dim=-1).values  # valid keys first, in order
    perm = listed[:, None, :, None, :].expand(n_b, n_h, n_q, samples, n_key).clone()
    fits = n_values[None, None, :] < m[..., None]  # [b, q, n]
    n_top = torch.where(fits, n_values, 0).amax(-1)[:, None, :, None]  # [b, 1, q, 1]
    sample = torch.arange(samples, device=valid.device)
    mm = m[:, None, :, None]
    for r in range(int(n_top.max()) if n_top.numel() else 0):
        j = torch_swap_index(row_key[..., None], sample, r, mm).clamp_max(n_key - 1)
        live = r < n_top
        a, b = perm[..., r].clone(), perm.gather(-1, j[..., None]).squeeze(-1)
        perm[..., r] = torch.where(live, b, a)
        perm.scatter_(-1, j[..., None], torch.where(live, a, b)[..., None])
    position = torch.arange(n_key, device=valid.device).expand_as(perm)
    rank = torch.full((*perm.shape[:-1], n_key + 1), n_key, dtype=torch.int64, device=valid.device)
    rank.scatter_(-1, perm, torch.where(position < n_top[..., None], position, n_key))
    return rank[..., :n_key]


def _shuffled(alpha: Tensor, top: Tensor, keep: Tensor, row_key: Tensor, shuffles: int, shuffle_kind: int,
              norms: Tensor) -> tuple[Tensor, Tensor]:
    """Weights ``[b, h, q, sample, k]`` and ranks of the value-shuffle null, as in the kernel.

    Key ``k`` takes the value of ``π(k)``, a full Fisher–Yates shuffle of the non-sink valid
    keys (``keep``); equivalently weight ``α_k`` sits on key ``π(k)``, ranked as ``k``. The norms
    and directions nulls rescale the weights (``norms [b, h, 1, k]`` = ‖v‖), as
    :func:`.score_kernel._null_weights` does: the norms null keeps ``α_k ‖v_π(k)‖/‖v_k‖`` on
    ``k`` itself, the directions null puts ``α_k ‖v_k‖/‖v_π(k)‖`` on ``π(k)``.
    """
    n_key = alpha.shape[-1]
    listed, perm = _value_permutations(keep, row_key, shuffles, alpha.shape[1])
    # moved[k] = π(k): identity off the listed keys; position n_key absorbs the unused slots.
    keys = torch.arange(n_key, device=alpha.device)
    moved = torch.cat([keys, keys.new_tensor([n_key])]).expand(*perm.shape[:-1], n_key + 1).clone()
    moved.scatter_(-1, listed[:, None, :, None, :].expand_as(perm), perm)
    moved = moved[..., :n_key]
    placed = alpha[:, :, :, None].expand_as(moved)  # the weight that moves with key k
    if shuffle_kind != NULL_VALUES:
        own = norms[:, :, :, None].expand(moved.shape)
        drawn = own.gather(-1, moved)
        if shuffle_kind == NULL_NORMS:  # k keeps its place: no scatter, the ranks are the top-N's
            return placed * _ratio(drawn, own), top[:, :, :, None].expand_as(moved)
        placed = placed * _ratio(own, drawn)
    weights = torch.zeros_like(alpha)[:, :, :, None].expand_as(moved).clone()
    weights.scatter_(-1, moved, placed)
    rank = torch.empty_like(moved).scatter_(-1, moved, top[:, :, :, None].expand_as(moved))
    return weights, rank


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den``, 0 where ``den`` is 0 (:func:`.score_kernel._ratio`)."""
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


def _value_permutations(keep: Tensor, row_key: Tensor, shuffles: int, n_h: int) -> tuple[Tensor, Tensor]:
    """``(listed [b, q, k], σ [b, h, q, sample, k])``: the non-sink valid keys (``keep``) in
    position order, and their full Fisher–Yates shuffle of each sample from the value-shuffle
    stream (the kernel's); the slots past each row's keys hold ``k`` (= ``n_key``)."""
    n_b, n_q, n_key = keep.shape
    device = keep.device
    keys = torch.arange(n_key, device=device)
    listed = torch.sort(torch.where(keep, keys, n_key), dim=-1).values  # [b, q, k]
    perm = listed[:, None, :, None, :].expand(n_b, n_h, n_q, shuffles, n_key).clone()
    m = keep.sum(-1)[:, None, :, None]  # [b, 1, q, 1]
    shuffle_key = torch_mix(row_key ^ SHUFFLE_SALT)[..., None]
    sample = torch.arange(shuffles, device=device)
    for r in range(int(m.max()) - 1 if m.numel() else 0):
        j = torch_swap_index(shuffle_key, sample, r, m).clamp_max(n_key - 1)
        live = r < m - 1
        a, b = perm[..., r].clone(), perm.gather(-1, j[..., None]).squeeze(-1)
        perm[..., r] = torch.where(live, b, a)
        perm.scatter_(-1, j[..., None], torch.where(live, a, b)[..., None])
    return listed, perm


def _unselected_sources(top: Tensor, keep: Tensor, row_key: Tensor, shuffles: int, n_values: Tensor) -> Tensor:
    """``source [b, h, q, sample, n, k]``: the key whose value key ``k`` holds in the unselected
    null (SPEC §3, ours), as in :func:`.score_kernel._run_unselected`.

    For each N, ``U_N`` = the non-sink valid keys outside ``S_N`` (rank ≥ N): its ``c``-th key in
    position order takes the value of its ``c``-th key in the order of the value-shuffle
    permutation ``σ`` of the sample; every other key is its own source.
    """
    n_h, n_key = top.shape[1], top.shape[-1]
    keys = torch.arange(n_key, device=top.device)
    _, sigma = _value_permutations(keep, row_key, shuffles, n_h)  # [b, h, q, sample, k]
    at = torch.full((*sigma.shape[:-1], n_key + 1), n_key, dtype=sigma.dtype, device=top.device)
    at.scatter_(-1, sigma, keys.expand_as(sigma))  # at[k] = k's place in σ (n_key off σ)
    unselected = keep[:, None, :, None, :] & (top[:, :, :, None, :] >= n_values[:, None])  # [b, h, q, n, k]
    place = torch.where(unselected[:, :, :, None], at[:, :, :, :, None, :n_key], n_key + 1)  # [b, h, q, s, n, k]
    drawn = place.sort(dim=-1, stable=True).indices  # U_N in σ's order first
    listed = torch.sort(torch.where(unselected, keys, n_key), dim=-1).values  # U_N in position order first
    source = torch.cat([keys, keys.new_tensor([n_key])]).expand(*place.shape[:-1], n_key + 1).clone()
    source.scatter_(-1, listed[:, :, :, None].expand_as(drawn), drawn)  # the rest lands on slot n_key
    return source[..., :n_key]


def _score(alpha, gram, gdiag, rank, keyset, n_values, group_size, cosine, source=None) -> tuple[Tensor, Tensor]:
    """The metrics of every (selection, N), ``[b, h, q, sel, n, metric]``, NaN where N does not
    fit: SPEC §3's, and the truncation figures of SPEC §10 (a second tensor).

    ``alpha [b, h, q, sel or 1, k]`` are the weights of each selection's keys. With ``source
    [b, h, q, sample, n, k]`` (the unselected null), key ``k`` holds the value of key
    ``source[k]`` (the selected keys their own): its ``⟨v, s⟩`` and ``‖v‖²`` are read there.
    """
    n = n_values[:, None]
    selected = rank[..., None, :] < n  # [b, h, q, sel, n, k]
    weights = alpha[..., None, :] * selected
    grouped = rearrange(weights, "b (g r) q s n k -> b g (r q s n) k", r=group_size)
    dots = rearrange(grouped @ gram, "b g (r q s n) k -> b (g r) q s n k", r=group_size,
                     q=alpha.shape[2], s=rank.shape[3])
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
    unselected = keyset & ~selected
    e_max = torch.where(selected, e, -torch.inf).amax(-1)
    e_min = torch.where(unselected, e, torch.inf).amin(-1)
    contaminating = (unselected & (e <= e_max[..., None])).sum(-1)
    recalled = (selected & (e < e_min[..., None])).sum(-1)
    sorted_out = torch.where(unselected, e, torch.inf).sort(-1).values
    below = torch.searchsorted(sorted_out, torch.where(selected, e, -torch.inf).contiguous(), right=True)
    inversions = (below * selected).sum(-1).to(COMPUTE_DTYPE)
    nf = n.to(COMPUTE_DTYPE).squeeze(-1)
    precision = nf / (nf + contaminating)
    recall = recalled / nf
    f_score = torch.where(recalled > 0, 2 * precision * recall / (precision + recall), 0.0)
    if cosine:
        margin = e_min - e_max
    else:
        s2 = sq_s.squeeze(-1)
        d_min = (e_min + s2).clamp_min(0).sqrt()
        d_max = (e_max + s2).clamp_min(0).sqrt()
        margin = torch.where(d_min + d_max > 0, (e_min - e_max) / (d_min + d_max), 0.0)
    n_keys = keyset.sum(-1)  # [b, 1, q, 1, 1]
    precision_cc, f_score_cc = chance_corrected(precision, recall, nf, n_keys.to(COMPUTE_DTYPE))
    out = torch.stack([precision, recall, f_score, margin, inversions, precision_cc, f_score_cc], dim=-1)
    if source is None:
        cut = torch.stack(_truncation(alpha, gram, dots, selected, sq_s.squeeze(-1), group_size), dim=-1)
    else:  # the unselected null: SPEC §10's figures are the values null's only
        cut = torch.full((*out.shape[:-1], 2), torch.nan, dtype=out.dtype, device=out.device)
    defined = n.squeeze(-1) < n_keys  # [b, 1, q, 1, n]: 1 ≤ N < |keys|
    return torch.where(defined[..., None], out, torch.nan), torch.where(defined[..., None], cut, torch.nan)


def _truncation(alpha, gram, dots, selected, sq_s, group_size) -> tuple[Tensor, Tensor]:
    """``τ_N`` and ``‖o − o_N‖/‖o‖`` (SPEC §10) of every (selection, N), ``[b, h, q, sel, n]``,
    from the same tail sums as :func:`.score_kernel._truncation`.

    ``alpha [b, h, q, sel or 1, k]`` is 0 off the row's keys, so the tail is every key with a
    weight outside the selection (the sink too, in the sink-removed group).
    """
    grouped = rearrange(alpha, "b (g r) q s k -> b g (r q s) k", r=group_size)
    o_dots = rearrange(grouped @ gram, "b g (r q s) k -> b (g r) q s k", r=group_size,
                       q=alpha.shape[2], s=alpha.shape[3])  # ⟨v_k, o⟩
    sq_o = (alpha * o_dots).sum(-1)[..., None]  # ‖o‖², [b, h, q, sel, 1]
    in_tail = alpha[..., None, :] * ~selected  # [b, h, q, sel, n, k]
    tail = in_tail.sum(-1)
    t_s = (in_tail * dots).sum(-1)  # ⟨t, s_N⟩ with t = o − s_N
    t_t = (in_tail * (o_dots[..., None, :] - dots)).sum(-1)  # ‖t‖²
    r = tail / (1 - tail)
    error = ((t_t - 2 * r * t_s + r * r * sq_s).clamp_min(0) / sq_o).sqrt()
    error = torch.where(tail >= 1, 1.0, error)  # nothing kept: o_N = 0
    return tail, torch.where(sq_o > 0, error, torch.nan)
