"""The checks that open every ablation sweep, in one place.

:func:`head_sensitivity`, :func:`ablation_vs_random` and :func:`sparsification_curve` take the
same model, tokens, ``mode``, reference batch and ``progress``; :func:`prepare_ablation` checks
them in one order, with one set of messages, and returns what the sweep goes on with.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor

from ..forward.hooks import check_tokens, model_shape
from ..progress import check_progress
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
    n_layers, n_heads = model_shape(model)
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
