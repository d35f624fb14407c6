"""What every ablation sweep does first and last, in one place.

:func:`head_sensitivity`, :func:`ablation_vs_random` and :func:`sparsification_curve` take the
same model, tokens, ``mode``, reference batch and ``progress``; :func:`prepare_ablation` checks
them in one order, with one set of messages, and :func:`ablated_losses` runs the dense model and
every ablated replica of the batch the same way for all three.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxtyping import Bool
from torch import Tensor

from ..forward import losses as _losses
from ..forward.hooks import check_tokens
from ..inputs.facts import model_facts
from ..progress import check_progress, progress_counter
from . import hooks as _hooks


class AblationRun(NamedTuple):
    """The checked inputs of one ablation sweep: ``tokens`` (``[batch, pos]`` ids), the model's
    ``n_layers`` and ``n_heads``, and ``progress`` as a bool."""

    tokens: Tensor
    n_layers: int
    n_heads: int
    progress: bool


def prepare_ablation(
    model: Any,
    tokens: Any,
    mode: str,
    reference_tokens: Any,
    reference_attention_mask: Any,
    progress: Any,
    check_hooks: bool = True,
) -> AblationRun:
    """Check a sweep's common inputs, in this order: ``mode``, ``progress``, ``tokens`` (against
    the model's vocabulary), the reference batch (only with ``mode="mean"``), the model's shape
    and, with ``check_hooks``, its ``hook_z`` on every layer. Raises ``ValueError`` naming the
    first problem."""
    _hooks.check_mode(mode)
    progress = check_progress(progress)
    tokens = check_tokens(tokens, model=model)
    _hooks.check_reference(mode, reference_tokens, reference_attention_mask)
    n_layers, n_heads = model_facts(model).shape()
    if check_hooks:
        _hooks.check_hooks(model, range(n_layers))
    return AblationRun(tokens, n_layers, n_heads, progress)


def positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    """``value`` must be an int ≥ 1 (not a bool), or ``None`` when ``allow_none``: otherwise a
    ``ValueError`` naming ``name``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")


class AblatedLosses(NamedTuple):
    """The dense model's loss on a batch (``base``, its own ``return_type="loss"``), its
    per-window losses (``dense``) and those of every ablated replica (``ablated``; None where
    nothing was ablated)."""

    base: float
    dense: _losses.WindowLosses
    ablated: _losses.WindowLosses | None


def ablated_losses(
    model: Any,
    tokens: Tensor,
    remove: Bool[Tensor, "replica layer head"],
    mode: str,
    *,
    attention_mask: Tensor | None,
    reference_tokens: Tensor | None,
    reference_attention_mask: Tensor | None,
    per_forward: int | None,
    progress: bool,
    label: str,
    unit: str,
) -> AblatedLosses:
    """The losses of :class:`AblatedLosses`: replica ``r`` has heads ``remove[r]`` ablated
    (:func:`~tl_geometry.ablation.hooks.replica_window_losses`, ``per_forward`` replicas per
    forward), by zeros or, with ``mode="mean"``, by each head's mean ``z`` over
    ``reference_tokens`` (default: ``tokens``); a ``label`` bar counts the replicas in ``unit``."""
    fill = None
    if mode == "mean" and len(remove):  # first: mean_z checks the reference batch itself
        if reference_tokens is None:
            reference_tokens, reference_attention_mask = tokens, attention_mask
        fill = _hooks.mean_z(model, reference_tokens, range(remove.shape[1]), reference_attention_mask)
    base = _losses.model_loss(model, tokens, attention_mask)
    dense = _losses.window_losses(model, tokens, attention_mask)
    if len(remove) == 0:
        return AblatedLosses(base, dense, None)
    bar = progress_counter(len(remove), label, unit) if progress else None
    try:
        ablated = _hooks.replica_window_losses(model, tokens, remove, fill=fill, attention_mask=attention_mask,
                                               per_forward=per_forward, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    return AblatedLosses(base, dense, ablated)
