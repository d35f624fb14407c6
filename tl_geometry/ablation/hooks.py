"""Head ablation as TransformerLens hooks on ``hook_z`` (SPEC §7), and what every ablation sweep
does first (:func:`prepare_ablation`) and last (:func:`ablated_losses`).

A query head's output before ``W_O`` is ``z[..., head, :]`` at ``blocks.{l}.attn.hook_z``;
replacing that slice removes exactly one query head, also under grouped-query attention, where
``hook_v`` is shared by several query heads (ablating it would remove the whole group). Every
hook returns a new tensor: writing in place would also rewrite any copy the caller caches from
the same hook point.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, get_args

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..forward.hooks import HookContext, HookList, check_tokens, head_mask, model_device
from ..forward.losses import WindowLosses, model_loss, stacked_window_losses, window_losses
from ..inputs.cache import check_attention_mask
from ..inputs.facts import model_facts
from ..progress import check_progress, progress_counter

Z_HOOK = "blocks.{layer}.attn.hook_z"
Mode = Literal["zero", "mean"]
#: How an ablated head's ``hook_z`` is replaced: by zeros, or by its mean over the valid
#: positions of a reference batch.
MODES: tuple[str, ...] = get_args(Mode)


def check_hooks(model: Any, layers: Iterable[int]) -> None:
    """The model must offer ``hooks(fwd_hooks=...)`` and ``blocks.{l}.attn.hook_z`` per layer."""
    if not callable(getattr(model, "hooks", None)):
        raise ValueError(
            f"{type(model).__name__} has no hooks(fwd_hooks=...) context manager; ablation needs a "
            "TransformerLens model (TransformerBridge or HookedTransformer)."
        )
    hook_dict = getattr(model, "hook_dict", None)
    if hook_dict is None:  # a duck-typed model: its hooks() will complain about unknown names
        return
    missing = [Z_HOOK.format(layer=layer) for layer in layers if Z_HOOK.format(layer=layer) not in hook_dict]
    if missing:
        raise ValueError(
            f"The model exposes no {missing[0]} (missing for {len(missing)} layer(s)); ablation acts "
            "on each head's output hook_z [batch, pos, head, d_head]. Use a TransformerLens 4.x "
            "TransformerBridge or a HookedTransformer, which both name it so."
        )


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")


def prepare_ablation(
    model: Any, tokens: Any, mode: str, reference_tokens: Any, reference_attention_mask: Any,
    progress: Any, check_z: bool = True,
) -> tuple[Tensor, int, int, bool]:
    """A sweep's common inputs checked in one order (``mode``, ``progress``, ``tokens``, the
    reference batch, the model's shape and, with ``check_z``, its ``hook_z`` on every layer):
    ``(tokens, n_layers, n_heads, progress)``."""
    check_mode(mode)
    progress = check_progress(progress)
    tokens = check_tokens(tokens, model=model)
    if mode != "mean" and (reference_tokens is not None or reference_attention_mask is not None):
        raise ValueError('reference_tokens / reference_attention_mask are only used with mode="mean".')
    if reference_tokens is None and reference_attention_mask is not None:
        raise ValueError("reference_attention_mask was given without reference_tokens; pass both "
                         "(without them the means come from tokens and attention_mask).")
    n_layers, n_heads = model_facts(model).shape()
    if check_z:
        check_hooks(model, range(n_layers))
    return tokens, n_layers, n_heads, progress


def positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    """``value`` must be an int ≥ 1 (not a bool), or ``None`` when ``allow_none``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")


def _check_z(z: Tensor, n_heads: int, name: str) -> None:
    if z.ndim != 4 or z.shape[2] != n_heads:
        raise ValueError(
            f"{name} has shape {tuple(z.shape)}; expected [batch, pos, head={n_heads}, d_head]. "
            "The model's hook_z must hold every query head's output separately."
        )


@torch.no_grad()
def mean_z(
    model: Any, tokens: Int[Tensor, "batch pos"], layers: Sequence[int],
    attention_mask: Tensor | None = None,
) -> dict[int, Float[Tensor, "head d_head"]]:
    """Per layer, the mean of ``z`` over the valid positions of a reference batch (float32),
    summed inside the hooks: no cache is built."""
    tokens = check_tokens(tokens, "reference_tokens", model)
    valid = check_attention_mask(attention_mask, *tokens.shape)
    _, n_heads = model_facts(model).shape()
    device = model_device(model)
    keep = valid.to(device)[:, :, None, None]
    sums: dict[int, Tensor] = {}

    def capture(layer: int) -> Callable[..., None]:
        def hook(z: Tensor, hook: Any = None) -> None:
            _check_z(z, n_heads, Z_HOOK.format(layer=layer))
            # where, not a 0/1 weight: z at padded positions may be NaN (fully masked rows).
            sums[layer] = torch.where(keep, z.float(), 0.0).sum(dim=(0, 1))

        return hook

    kwargs = {} if attention_mask is None else {"attention_mask": valid.long().to(device)}
    fwd = [(Z_HOOK.format(layer=layer), capture(layer)) for layer in layers]
    with model.hooks(fwd_hooks=fwd):
        model(tokens.to(device), return_type=None, **kwargs)
    return {layer: sums[layer] / valid.sum() for layer in layers}


def replica_hook(
    layer: int, remove: Bool[Tensor, "replica head"], fill: Float[Tensor, "head d_head"] | None,
    n_heads: int,
) -> Callable[..., Tensor]:
    """Hook for ``R`` stacked copies of the input: copy ``r`` has the heads ``remove[r]``
    replaced by ``fill`` (zeros when ``None``); no head loop."""
    name = Z_HOOK.format(layer=layer)
    n_rep = remove.shape[0]

    def hook(z: Tensor, hook: Any = None) -> Tensor:
        _check_z(z, n_heads, name)
        stacked = z.reshape(n_rep, z.shape[0] // n_rep, *z.shape[1:])  # [replica, batch, pos, head, d]
        where = remove.to(z.device)[:, None, None, :, None]
        new = torch.zeros((), dtype=z.dtype, device=z.device) if fill is None else fill.to(z)
        return torch.where(where, new, stacked).reshape(z.shape)

    return hook


def z_hooks(remove: Bool[Tensor, "replica layer head"], fill: dict[int, Tensor] | None,
            n_heads: int) -> HookList:
    """One :func:`replica_hook` per layer with a head in ``remove``."""
    layers = remove.any(dim=(0, 2)).nonzero().flatten().tolist()
    return [(Z_HOOK.format(layer=layer),
             replica_hook(layer, remove[:, layer], None if fill is None else fill[layer], n_heads))
            for layer in layers]


class HeadAblation(HookContext):
    """``(hook_name, fn)`` pairs that ablate some heads, for ``run_with_hooks(fwd_hooks=...)``
    or ``with ablation: ...`` (hooks removed on exit). Attributes: ``model``, ``heads`` (sorted
    pairs), ``mode``, ``mask`` (``[layer, head]``) and ``fill`` (``{layer: [head, d_head]}``)."""

    _made_by = "ablate_heads(model, heads)"

    def __init__(self, model: Any, mask: Tensor, mode: str, fill: dict[int, Tensor]) -> None:
        super().__init__(z_hooks(mask[None], fill or None, model_facts(model).shape()[1]))
        self.model, self.mask, self.mode, self.fill = model, mask, mode, fill
        self.heads = [tuple(x) for x in mask.nonzero().tolist()]
        self._contexts: list[Any] = []

    def __repr__(self) -> str:
        return f"HeadAblation(mode={self.mode!r}, heads={self.heads})"


def ablate_heads(
    model: Any,
    heads: Iterable[tuple[int, int]] | Bool[Tensor, "layer head"],
    mode: Mode = "zero",
    reference_tokens: Int[Tensor, "batch pos"] | None = None,
    *,
    reference_attention_mask: Tensor | None = None,
) -> HeadAblation:
    """Hooks that replace the output ``z[..., h, :]`` of exactly the listed heads (SPEC §7).

    ``mode="zero"`` sets ``z_h = 0``; ``mode="mean"`` sets ``z_h`` to its mean over the valid
    positions of ``reference_tokens`` (``reference_attention_mask`` marks padding). ``heads``:
    ``(layer, head)`` pairs or a ``[n_layers, n_heads]`` bool mask; none at all gives a
    ``UserWarning`` and hooks that change nothing. Every other query head, including the ones
    sharing its KV head under GQA, is left bit for bit unchanged; the hooks are removed when the
    ``with`` block or ``run_with_hooks`` call ends.

    Examples:
        >>> with tl_geometry.ablation.ablate_heads(model, [(3, 4), (5, 0)]):      # doctest: +SKIP
        ...     loss = model(tokens, return_type="loss")
        >>> model.run_with_hooks(tokens, fwd_hooks=tl_geometry.ablation.ablate_heads(
        ...     model, [(0, 3)], "mean", reference_tokens=tokens), return_type="loss")  # doctest: +SKIP
    """
    check_mode(mode)
    n_layers, n_heads = model_facts(model).shape()
    mask = head_mask(heads, n_layers, n_heads)
    if not mask.any():
        # Not an error: a removal loop legitimately starts at zero heads. But a forgotten or
        # filtered-empty list would otherwise pass silently as "ablation changed nothing".
        warnings.warn(
            "ablate_heads got no heads (an empty list or an all-False mask): the ablation does "
            "nothing and the model runs unchanged. Pass (layer, head) pairs, e.g. [(3, 4)].",
            UserWarning, stacklevel=2,
        )
    layers = mask.any(1).nonzero().flatten().tolist()
    check_hooks(model, layers)
    fill: dict[int, Tensor] = {}
    if mode == "mean":
        if reference_tokens is None:
            raise ValueError('mode="mean" needs reference_tokens: the batch whose mean z replaces each head.')
        fill = mean_z(model, reference_tokens, layers, reference_attention_mask)
    elif reference_tokens is not None or reference_attention_mask is not None:
        raise ValueError('reference_tokens are only used with mode="mean".')
    return HeadAblation(model, mask, mode, fill)


@torch.no_grad()
def replica_window_losses(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    remove: Bool[Tensor, "replica layer head"],
    *,
    fill: dict[int, Tensor] | None = None,
    attention_mask: Tensor | None = None,
    per_forward: int | None = None,
    progress: Any = None,
) -> WindowLosses:
    """Per-window next-token losses with heads ``remove[r]`` ablated in replica ``r``, in
    stacked forwards of ``per_forward`` replicas
    (:func:`~tl_geometry.forward.losses.stacked_window_losses`; ``progress``: a bar or None)."""
    _, n_heads = model_facts(model).shape()

    def hooks_for(start: int, stop: int) -> HookList:
        return z_hooks(remove[start:stop], fill, n_heads)

    return stacked_window_losses(model, tokens, remove.shape[0], hooks_for,
                                 attention_mask=attention_mask, per_forward=per_forward,
                                 progress=progress)


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
) -> tuple[float, WindowLosses, WindowLosses | None]:
    """The dense loss (the model's own ``return_type="loss"``), its per-window losses and those
    of every replica ``r`` with heads ``remove[r]`` ablated (None where nothing is), by zeros or
    each head's mean ``z`` over ``reference_tokens`` (default: ``tokens``); a ``label`` bar
    counts the replicas in ``unit``."""
    fill = None
    if mode == "mean" and len(remove):  # first: mean_z checks the reference batch itself
        if reference_tokens is None:
            reference_tokens, reference_attention_mask = tokens, attention_mask
        fill = mean_z(model, reference_tokens, range(remove.shape[1]), reference_attention_mask)
    base = model_loss(model, tokens, attention_mask)
    dense = window_losses(model, tokens, attention_mask)
    if len(remove) == 0:
        return base, dense, None
    bar = progress_counter(len(remove), label, unit) if progress else None
    try:
        ablated = replica_window_losses(model, tokens, remove, fill=fill, attention_mask=attention_mask,
                                        per_forward=per_forward, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    return base, dense, ablated
