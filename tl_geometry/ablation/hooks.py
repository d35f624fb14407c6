"""Head ablation as TransformerLens hooks on ``hook_z`` (SPEC §7), and the batched loss engine.

A query head's output before ``W_O`` is ``z[..., head, :]`` at ``blocks.{l}.attn.hook_z``
(``[batch, pos, head, d_head]``). Replacing that slice removes exactly one query head, also under
grouped-query attention, where ``hook_v`` holds one KV head shared by several query heads
(ablating ``hook_v`` would remove the whole group).

Every hook returns a new tensor (``torch.where`` / a clone): writing into the hook's activation
in place would also rewrite any copy the caller caches from the same hook point.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NamedTuple, get_args

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..inputs.cache import check_attention_mask
from ..inputs.tokens import check_token_ids, model_vocabulary

Z_HOOK = "blocks.{layer}.attn.hook_z"
Mode = Literal["zero", "mean"]
MODES: tuple[str, ...] = get_args(Mode)
HookList = list[tuple[str, Callable[..., Tensor]]]

#: Memory that one batched forward may use for its replicas (logits dominate: 3 copies of
#: ``[batch, pos, d_vocab]`` float32 per replica). Pass ``batch_heads`` / ``batch_size`` to override.
MEMORY_BUDGET_BYTES = 2 * 2**30


# --- validation -------------------------------------------------------------------------------
def model_shape(model: Any) -> tuple[int, int]:
    """``(n_layers, n_heads)`` from ``model.cfg``, with an error naming the fix."""
    cfg = getattr(model, "cfg", None)
    n_layers, n_heads = getattr(cfg, "n_layers", None), getattr(cfg, "n_heads", None)
    if not isinstance(n_layers, int) or not isinstance(n_heads, int):
        raise ValueError(
            "model.cfg must give n_layers and n_heads: pass a TransformerLens TransformerBridge "
            "(tl_geometry.load_model) or HookedTransformer."
        )
    return n_layers, n_heads


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


def check_tokens(tokens: Any, name: str = "tokens", model: Any = None) -> Tensor:
    """``tokens`` must be ``[batch, pos]`` integer ids with data, at least one sequence of two
    tokens, and (with ``model``) ids inside its vocabulary: the check ``analyze_model`` makes, so
    no entry point fails with an ``IndexError`` from the embedding."""
    if not isinstance(tokens, Tensor) or tokens.ndim != 2 or tokens.is_floating_point():
        shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(
            f"{name} must be [batch, pos] integer token ids (e.g. tl_geometry.text_windows(model)), "
            f"got {shape}."
        )
    if tokens.shape[0] < 1 or tokens.shape[1] < 2:
        raise ValueError(f"{name} needs at least one sequence of ≥ 2 tokens, got {tuple(tokens.shape)}.")
    check_token_ids(tokens, model_vocabulary(model), name)
    return tokens


def check_reference(mode: str, reference_tokens: Any, reference_attention_mask: Any) -> None:
    """``reference_*`` only make sense with ``mode="mean"``, and the mask only with its tokens."""
    if mode != "mean" and (reference_tokens is not None or reference_attention_mask is not None):
        raise ValueError('reference_tokens / reference_attention_mask are only used with mode="mean".')
    if reference_tokens is None and reference_attention_mask is not None:
        raise ValueError("reference_attention_mask was given without reference_tokens; pass both "
                         "(without them the means come from tokens and attention_mask).")


def head_mask(heads: Any, n_layers: int, n_heads: int) -> Bool[Tensor, "layer head"]:
    """``[layer, head]`` bool mask from ``(layer, head)`` pairs or from a bool mask itself.

    Pairs are checked for shape, range and duplicates, with the offending entry in the message.
    """
    if isinstance(heads, Tensor) and heads.dtype == torch.bool:
        if heads.shape != (n_layers, n_heads):
            raise ValueError(f"A head mask must be [n_layers, n_heads] = [{n_layers}, {n_heads}], "
                             f"got {tuple(heads.shape)}.")
        return heads.detach().cpu().clone()
    if isinstance(heads, Tensor):
        heads = heads.tolist()
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Iterable):
        raise ValueError(f"heads must be (layer, head) pairs, e.g. [(3, 4), (5, 0)], got {heads!r}.")
    mask = torch.zeros(n_layers, n_heads, dtype=torch.bool)
    for i, pair in enumerate(heads):
        if (not isinstance(pair, Sequence) or isinstance(pair, str) or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
            raise ValueError(f"heads[{i}] = {pair!r} is not a (layer, head) pair of ints.")
        layer, head = pair
        if not 0 <= layer < n_layers:
            raise ValueError(f"heads[{i}] = {tuple(pair)}: layer {layer} is out of range; "
                             f"the model has {n_layers} layers (0..{n_layers - 1}).")
        if not 0 <= head < n_heads:
            raise ValueError(f"heads[{i}] = {tuple(pair)}: head {head} is out of range; "
                             f"the model has {n_heads} query heads per layer (0..{n_heads - 1}).")
        if mask[layer, head]:
            raise ValueError(f"heads[{i}] = {tuple(pair)} is listed twice.")
        mask[layer, head] = True
    return mask


def _check_z(z: Tensor, n_heads: int, name: str) -> None:
    if z.ndim != 4 or z.shape[2] != n_heads:
        raise ValueError(
            f"{name} has shape {tuple(z.shape)}; expected [batch, pos, head={n_heads}, d_head]. "
            "The model's hook_z must hold every query head's output separately."
        )


def model_device(model: Any) -> torch.device:
    return torch.device(getattr(getattr(model, "cfg", None), "device", None) or "cpu")


# --- mean of z over a reference batch ---------------------------------------------------------
@torch.no_grad()
def mean_z(
    model: Any, tokens: Int[Tensor, "batch pos"], layers: Sequence[int],
    attention_mask: Tensor | None = None,
) -> dict[int, Float[Tensor, "head d_head"]]:
    """Per layer, the mean of ``z`` over the valid positions of a reference batch (float32).

    Only sums and counts are kept inside the hook, so no cache is built.
    """
    tokens = check_tokens(tokens, "reference_tokens", model)
    valid = check_attention_mask(attention_mask, *tokens.shape)
    _, n_heads = model_shape(model)
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


# --- hooks --------------------------------------------------------------------------------------
def replica_hook(
    layer: int, remove: Bool[Tensor, "replica head"], fill: Float[Tensor, "head d_head"] | None,
    n_heads: int,
) -> Callable[..., Tensor]:
    """Hook for a batch made of ``R`` stacked copies of the input: copy ``r`` has the heads
    ``remove[r]`` replaced by ``fill`` (zeros when ``None``). One ``torch.where``, no head loop."""
    name = Z_HOOK.format(layer=layer)
    n_rep = remove.shape[0]

    def hook(z: Tensor, hook: Any = None) -> Tensor:
        _check_z(z, n_heads, name)
        stacked = z.reshape(n_rep, z.shape[0] // n_rep, *z.shape[1:])  # [replica, batch, pos, head, d]
        where = remove.to(z.device)[:, None, None, :, None]
        new = torch.zeros((), dtype=z.dtype, device=z.device) if fill is None else fill.to(z)
        return torch.where(where, new, stacked).reshape(z.shape)

    return hook


class HookContext(list):
    """``(hook_name, fn)`` pairs that also work as a context manager on their model.

    A list for ``model.run_with_hooks(tokens, fwd_hooks=...)``; ``with ...:`` adds the hooks and
    removes them on any exit, exception included. Re-entrant: each ``with`` removes its own.
    """

    model: Any
    _contexts: list[Any]
    #: The call that makes one, for the error message.
    _made_by = "..."

    @property
    def hooks(self) -> HookList:
        """The ``(hook_name, fn)`` pairs as a plain list."""
        return list(self)

    def __enter__(self) -> Any:
        context = self.model.hooks(fwd_hooks=list(self))
        context.__enter__()
        self._contexts.append(context)
        return self

    def __exit__(self, *exc: Any) -> Any:
        if not self._contexts:
            name = type(self).__name__
            raise RuntimeError(
                f"{name}.__exit__ was called without a matching __enter__: none of its hooks are "
                f"active. Use it as `with {self._made_by}: ...`, or pass it to "
                "model.run_with_hooks(tokens, fwd_hooks=...)."
            )
        return self._contexts.pop().__exit__(*exc)


class HeadAblation(HookContext):
    """``(hook_name, fn)`` pairs that ablate some heads, usable three ways::

        model.run_with_hooks(tokens, fwd_hooks=ablation, return_type="loss")
        with ablation: loss = model(tokens, return_type="loss")    # hooks removed on exit
        with model.hooks(fwd_hooks=ablation): ...

    Attributes: ``model``, ``heads`` (sorted ``(layer, head)`` pairs), ``mode``, ``mask``
    (``[layer, head]`` bool) and ``fill`` (``{layer: [head, d_head]}`` means, empty for zero).
    """

    _made_by = "ablate_heads(model, heads)"

    def __init__(self, model: Any, mask: Tensor, mode: str, fill: dict[int, Tensor]) -> None:
        _, n_heads = model_shape(model)
        layers = mask.any(1).nonzero().flatten().tolist()
        super().__init__(
            (Z_HOOK.format(layer=layer),
             replica_hook(layer, mask[layer][None], fill.get(layer), n_heads))
            for layer in layers
        )
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

    ``mode="zero"`` sets ``z_h = 0``; ``mode="mean"`` sets ``z_h = mean of z_h`` over the valid
    positions of ``reference_tokens`` (one forward, no cache; ``reference_attention_mask`` marks
    padding). One hook per layer that has a listed head; every other query head, including the
    ones sharing its KV head under GQA, is left bit for bit unchanged. The caller's tensors and
    the model are not modified: the hooks return new tensors and are removed when the ``with``
    block or ``run_with_hooks`` call ends.

    Args:
        heads: ``(layer, head)`` pairs (query-head indices) or a ``[n_layers, n_heads]`` bool mask.
            No heads at all (``[]``, an all-False mask) gives a ``UserWarning`` and hooks that
            change nothing.

    Examples:
        >>> with tl_geometry.ablate_heads(model, [(3, 4), (5, 0)]):      # doctest: +SKIP
        ...     loss = model(tokens, return_type="loss")
        >>> model.run_with_hooks(tokens, fwd_hooks=tl_geometry.ablate_heads(
        ...     model, [(0, 3)], "mean", reference_tokens=tokens), return_type="loss")  # doctest: +SKIP
    """
    check_mode(mode)
    n_layers, n_heads = model_shape(model)
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


# --- batched losses -----------------------------------------------------------------------------
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
        w = self.weight.double()
        return torch.where(w > 0, self.loss * w, 0.0).sum(-1) / w.sum()


@torch.no_grad()
def replica_losses(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    remove: Bool[Tensor, "replica layer head"],
    *,
    fill: dict[int, Tensor] | None = None,
    attention_mask: Tensor | None = None,
    per_forward: int | None = None,
    progress: Any = None,
) -> Float[Tensor, " replica"]:
    """Mean next-token loss of the model with heads ``remove[r]`` ablated, for every ``r``.

    ``per_forward`` copies of the batch go through one forward (stacked along the batch axis),
    each with its own heads replaced inside one hook per layer; the loss of copy ``r`` is the
    mean over its valid predictions of the per-token loss, summed in float64. ``progress`` (a
    tqdm bar or ``None``) is advanced by the number of replicas done.
    """
    return replica_window_losses(model, tokens, remove, fill=fill, attention_mask=attention_mask,
                                 per_forward=per_forward, progress=progress).total


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
    """:func:`replica_losses` per window: the loss of every replica on every window of
    ``tokens`` (:class:`WindowLosses`), from the same batched forwards."""
    _, n_heads = model_shape(model)

    def hooks_for(start: int, stop: int) -> HookList:
        chunk = remove[start:stop]
        layers = chunk.any(dim=(0, 2)).nonzero().flatten().tolist()
        return [(Z_HOOK.format(layer=layer),
                 replica_hook(layer, chunk[:, layer], None if fill is None else fill[layer], n_heads))
                for layer in layers]

    return stacked_window_losses(model, tokens, remove.shape[0], hooks_for,
                                 attention_mask=attention_mask, per_forward=per_forward,
                                 progress=progress)


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
    """Mean next-token loss of ``n_rep`` replicas of the batch, ``per_forward`` per forward pass.

    Replicas are stacked along the batch axis; ``hooks_for(start, stop)`` gives the hooks that
    treat replicas ``start:stop`` (each hook tells its replicas apart by batch row). The loss of
    a replica is the mean over its valid predictions of the per-token loss, summed in float64.
    ``progress`` (a tqdm bar or ``None``) is advanced by the number of replicas done. Per
    window: :func:`stacked_window_losses`.
    """
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
