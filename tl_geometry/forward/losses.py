"""The batched loss engine: many variants of one model's forward, stacked along the batch axis.

``R`` replicas of a ``[batch, pos]`` input go through as few forwards as memory allows
(:func:`replicas_per_forward`); hooks tell the replicas apart by batch row, so each can run a
different intervention (heads ablated, attention sparsified). Every loss is the mean next-token
cross-entropy over the valid predictions, summed in float64, and kept per window
(:class:`WindowLosses`) so that a loss change has its standard error over windows (SPEC §7).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..functional.uncertainty import window_mean
from ..inputs.cache import check_attention_mask
from .hooks import HookList, model_device

#: Memory that one batched forward may use for its replicas (logits dominate: 3 copies of
#: ``[batch, pos, d_vocab]`` float32 per replica). Pass ``batch_heads`` / ``batch_size`` to override.
MEMORY_BUDGET_BYTES = 2 * 2**30


def replicas_per_forward(model: Any, batch: int, n_pos: int, budget: int = MEMORY_BUDGET_BYTES) -> int:
    """How many copies of a ``[batch, n_pos]`` input fit one forward within ``budget`` bytes."""
    cfg = model.cfg
    width = max(getattr(cfg, "d_model", 0) or 0, getattr(cfg, "d_mlp", 0) or 0)
    per_token = 4 * (3 * (getattr(cfg, "d_vocab", 0) or 0) + 16 * width)
    return max(1, budget // max(1, per_token * batch * n_pos))


def valid_targets(tokens: Tensor, attention_mask: Tensor | None) -> Bool[Tensor, "batch pos_1"]:
    """Next-token predictions that count: both the position and its target are real tokens."""
    valid = check_attention_mask(attention_mask, *tokens.shape)
    targets = valid[:, :-1] & valid[:, 1:]
    if not targets.any():
        raise ValueError("attention_mask leaves no next-token prediction (no two adjacent real "
                         "tokens): the loss is undefined. Pass sequences with ≥ 2 real tokens.")
    return targets


@torch.no_grad()
def model_loss(model: Any, tokens: Tensor, attention_mask: Tensor | None = None) -> float:
    """The model's own mean next-token cross-entropy (``return_type="loss"``), unablated."""
    device = model_device(model)
    valid_targets(tokens, attention_mask)  # a clear error before the forward, not TL's assert
    kwargs = {} if attention_mask is None else {
        "attention_mask": check_attention_mask(attention_mask, *tokens.shape).long().to(device)}
    return float(model(tokens.to(device), return_type="loss", **kwargs))


class WindowLosses(NamedTuple):
    """Per-window losses of some replicas of one batch (SPEC §7 uncertainty, ours).

    ``loss[r, b]`` is the mean next-token loss of replica ``r`` over the valid predictions of
    window ``b`` (float64; NaN for a window with none), ``weight[b]`` the number of those
    predictions. The replica's loss over the whole batch is the weighted mean, :attr:`total`.
    """

    loss: Float[Tensor, "replica window"]
    weight: Float[Tensor, " window"]

    @property
    def total(self) -> Float[Tensor, " replica"]:
        """``Σ_b w_b L_b / Σ_b w_b``: the mean over every valid prediction of the batch."""
        return window_mean(self.loss, self.weight)


@torch.no_grad()
def window_losses(model: Any, tokens: Int[Tensor, "batch pos"],
                  attention_mask: Tensor | None = None) -> WindowLosses:
    """The unablated model's loss on every window (one replica, no hooks): the dense side of
    every paired loss change."""
    return stacked_window_losses(model, tokens, 1, lambda start, stop: [],
                                 attention_mask=attention_mask, per_forward=1)


@torch.no_grad()
def stacked_losses(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    n_rep: int,
    hooks_for: Callable[[int, int], HookList],
    *,
    attention_mask: Tensor | None = None,
    per_forward: int | None = None,
    progress: Any = None,
) -> Float[Tensor, " replica"]:
    """Mean next-token loss of ``n_rep`` replicas of the batch, ``per_forward`` per forward pass
    (see the module): ``hooks_for(start, stop)`` gives the hooks that treat replicas
    ``start:stop``; ``progress`` (a tqdm bar or ``None``) is advanced by the replicas done. Per
    window: :func:`stacked_window_losses`."""
    return stacked_window_losses(model, tokens, n_rep, hooks_for, attention_mask=attention_mask,
                                 per_forward=per_forward, progress=progress).total


@torch.no_grad()
def stacked_window_losses(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    n_rep: int,
    hooks_for: Callable[[int, int], HookList],
    *,
    attention_mask: Tensor | None = None,
    per_forward: int | None = None,
    progress: Any = None,
) -> WindowLosses:
    """:func:`stacked_losses` per window: ``loss[r, b]`` is replica ``r``'s mean per-token loss
    over the valid predictions of window ``b`` (summed in float64), ``weight[b]`` their number.
    Keeping the windows apart is what gives every loss change its standard error (SPEC §7)."""
    batch, n_pos = tokens.shape
    per_forward = per_forward or replicas_per_forward(model, batch, n_pos)
    device = model_device(model)
    targets = valid_targets(tokens, attention_mask).to(device)
    weight = targets.sum(-1).double()  # [window]
    mask = None if attention_mask is None else (
        check_attention_mask(attention_mask, batch, n_pos).long().to(device))
    sums = torch.empty(n_rep, batch, dtype=torch.float64)
    for start in range(0, n_rep, per_forward):
        stop = min(n_rep, start + per_forward)
        k = stop - start
        kwargs = {} if mask is None else {"attention_mask": mask.repeat(k, 1)}
        with model.hooks(fwd_hooks=hooks_for(start, stop)):
            per_token = model(tokens.repeat(k, 1).to(device), return_type="loss",
                              loss_per_token=True, **kwargs)
        # where, not a product: a padded position's loss may be NaN, and NaN · 0 is NaN.
        per_token = torch.where(targets, per_token.double().reshape(k, batch, n_pos - 1), 0.0)
        sums[start:stop] = per_token.sum(-1).cpu()
        if progress is not None:
            progress.update(k)
    weight = weight.cpu()
    loss = torch.where(weight > 0, sums / weight.clamp_min(1), torch.nan)
    return WindowLosses(loss, weight)
