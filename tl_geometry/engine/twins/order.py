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
    n_key = valid.shape[-1]
    fits = n_values[None, None, :] < m[..., None]  # [b, q, n]
    n_top = torch.where(fits, n_values, 0).amax(-1)[:, None, :, None]  # [b, 1, q, 1]
    _, perm = _fisher_yates(valid, row_key[..., None], samples, n_top, m[:, None, :, None])
    position = torch.arange(n_key, device=valid.device).expand_as(perm)
    rank = torch.full((*perm.shape[:-1], n_key + 1), n_key, dtype=torch.int64, device=valid.device)
    rank.scatter_(-1, perm, torch.where(position < n_top[..., None], position, n_key))
    return rank[..., :n_key]


def _fisher_yates(mask: Tensor, key: Tensor, samples: int, steps: Tensor,
                  m: Tensor) -> tuple[Tensor, Tensor]:
    """``(listed [b, q, k], perm [b, h, q, sample, k])``: the keys of ``mask`` in position order
    (the slots past them hold ``n_key``), and the first ``steps`` swaps of the Fisher–Yates
    shuffle of these ``m`` keys in each sample, drawn with ``key [b, h, q, 1]`` (the kernel's)."""
    n_b, n_q, n_key = mask.shape
    keys = torch.arange(n_key, device=mask.device)
    listed = torch.sort(torch.where(mask, keys, n_key), dim=-1).values
    perm = listed[:, None, :, None, :].expand(n_b, key.shape[1], n_q, samples, n_key).clone()
    sample = torch.arange(samples, device=mask.device)
    for r in range(int(steps.max()) if steps.numel() else 0):
        j = torch_swap_index(key, sample, r, m).clamp_max(n_key - 1)
        live = r < steps
        a, b = perm[..., r].clone(), perm.gather(-1, j[..., None]).squeeze(-1)
        perm[..., r] = torch.where(live, b, a)
        perm.scatter_(-1, j[..., None], torch.where(live, a, b)[..., None])
    return listed, perm


def shuffled(alpha: Tensor, top: Tensor, keep: Tensor, row_key: Tensor, shuffles: int, shuffle_kind: int,
             norms: Tensor) -> tuple[Tensor, Tensor]:
    """Weights ``[b, h, q, sample, k]`` and ranks of the value-shuffle null: weight ``α_k`` on key
    ``π(k)`` (a shuffle of the non-sink valid keys, ``keep``), ranked as ``k``; the norms and
    directions nulls rescale it as :func:`..compiled.score._null_weights` does."""
    n_key = alpha.shape[-1]
    listed, perm = _value_permutations(keep, row_key, shuffles)
    # moved[k] = π(k): identity off the listed keys; position n_key absorbs the unused slots.
    moved = torch.arange(n_key + 1, device=alpha.device).expand(*perm.shape[:-1], n_key + 1).clone()
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


def _value_permutations(keep: Tensor, row_key: Tensor, shuffles: int) -> tuple[Tensor, Tensor]:
    """:func:`_fisher_yates` of the non-sink valid keys (``keep``), whole, from the value-shuffle
    stream: ``(listed, σ)``."""
    m = keep.sum(-1)[:, None, :, None]  # [b, 1, q, 1]
    return _fisher_yates(keep, torch_mix(row_key ^ SHUFFLE_SALT)[..., None], shuffles, m - 1, m)


def unselected_sources(top: Tensor, keep: Tensor, row_key: Tensor, shuffles: int, n_values: Tensor) -> Tensor:
    """``source [b, h, q, sample, n, k]``: the key whose value key ``k`` holds in the unselected
    null (SPEC §3, ours), as :func:`..compiled.score._run_unselected` draws it."""
    n_key = top.shape[-1]
    keys = torch.arange(n_key, device=top.device)
    _, sigma = _value_permutations(keep, row_key, shuffles)  # [b, h, q, sample, k]
    at = torch.full((*sigma.shape[:-1], n_key + 1), n_key, dtype=sigma.dtype, device=top.device)
    at.scatter_(-1, sigma, keys.expand_as(sigma))  # at[k] = k's place in σ (n_key off σ)
    unselected = keep[:, None, :, None, :] & (top[:, :, :, None, :] >= n_values[:, None])  # [b, h, q, n, k]
    place = torch.where(unselected[:, :, :, None], at[:, :, :, :, None, :n_key], n_key + 1)  # [b, h, q, s, n, k]
    drawn = place.sort(dim=-1, stable=True).indices  # U_N in σ's order first
    listed = torch.sort(torch.where(unselected, keys, n_key), dim=-1).values  # U_N in position order first
    source = torch.cat([keys, keys.new_tensor([n_key])]).expand(*place.shape[:-1], n_key + 1).clone()
    source.scatter_(-1, listed[:, :, :, None].expand_as(drawn), drawn)  # the rest lands on slot n_key
    return source[..., :n_key]
