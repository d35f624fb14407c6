"""The seeded selections of the scoring twin (:mod:`.score`): the random baseline's subsets and
the value-shuffle nulls' permutations (and rescaled weights), drawn from the counter-based
stream of :mod:`..rng` bit for bit as the compiled kernel draws them (:mod:`..compiled.order`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..options import NULL_NORMS, NULL_VALUES
from ..rng import SHUFFLE_SALT, torch_mix, torch_swap_index


def random_ranks(valid: Tensor, m: Tensor, row_key: Tensor, samples: int, n_values: Tensor) -> Tensor:
    """Ranks of the partial Fisher–Yates shuffles of :mod:`..rng` (``[b, h, q, sample, k]``)."""
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


def shuffled(alpha: Tensor, top: Tensor, keep: Tensor, row_key: Tensor, shuffles: int, shuffle_kind: int,
             norms: Tensor) -> tuple[Tensor, Tensor]:
    """Weights ``[b, h, q, sample, k]`` and ranks of the value-shuffle null, as in the kernel.

    Key ``k`` takes the value of ``π(k)``, a full Fisher–Yates shuffle of the non-sink valid
    keys (``keep``); equivalently weight ``α_k`` sits on key ``π(k)``, ranked as ``k``. The norms
    and directions nulls rescale the weights (``norms [b, h, 1, k]`` = ‖v‖), as
    :func:`..compiled.score._null_weights` does: the norms null keeps ``α_k ‖v_π(k)‖/‖v_k‖`` on
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
    """``num / den``, 0 where ``den`` is 0 (:func:`..compiled.score._ratio`)."""
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


def unselected_sources(top: Tensor, keep: Tensor, row_key: Tensor, shuffles: int, n_values: Tensor) -> Tensor:
    """``source [b, h, q, sample, n, k]``: the key whose value key ``k`` holds in the unselected
    null (SPEC §3, ours), as in :func:`..compiled.score._run_unselected`.

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
