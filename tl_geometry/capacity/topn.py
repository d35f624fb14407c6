"""Top-N attention sparsification as TransformerLens hooks on ``hook_pattern`` (SPEC §10).

Each query row of ``blocks.{l}.attn.hook_pattern`` keeps its ``N`` largest weights (ties → lower
index, SPEC §2), renormalised or not; ``z = pattern · v`` then reads only those, one query head
at a time, also under GQA / MQA. ``N`` is one number or a per-head policy (:mod:`.policy`).
Every hook returns a new tensor: writing into the activation in place would also rewrite any
copy the caller caches from the same hook point.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, get_args

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..forward import hooks as _hooks
from ..functional.selection import top_n_ranks
from ..inputs.facts import model_facts
from .policy import MAX_N, TopNPolicy, as_policy

PATTERN_HOOK = "blocks.{layer}.attn.hook_pattern"
SparsifyMode = Literal["renormalize", "delete"]
#: What happens to the weights a top-N pattern drops: the kept ones renormalised to sum to
#: one, or the dropped ones set to zero and the rest left as they are.
SPARSIFY_MODES: tuple[str, ...] = get_args(SparsifyMode)


def check_sparsify_mode(mode: str) -> None:
    if mode not in SPARSIFY_MODES:
        raise ValueError(f"mode must be one of {SPARSIFY_MODES}, got {mode!r}.")


def check_n(n: Any, name: str = "n") -> int:
    """``N`` as an int in ``1 … MAX_N``: a bool, float, str, ``None`` or tensor is refused, not
    coerced silently."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"{name} must be an int ≥ 1 (keys kept per query), got {n!r} "
                         f"({type(n).__name__}).")
    if n < 1:
        raise ValueError(f"{name} must be ≥ 1 (keys kept per query), got {n}; N = 0 would remove "
                         "every key. Use ablate_heads to remove a head's output instead.")
    if n > MAX_N:
        raise ValueError(f"{name} = {n} is too large: N must be at most 2**63 - 1. Any N at "
                         "least the number of keys keeps every key.")
    return n


def check_n_limit(n: Any, rows: torch.Size) -> Tensor:
    """``n`` as a tensor: an int (:func:`check_n`) or integers ``≥ 1`` broadcasting to ``rows``."""
    if not isinstance(n, Tensor):
        return torch.tensor(check_n(n))
    if n.dtype == torch.bool or n.is_floating_point() or n.is_complex():
        raise ValueError(f"n must be an int or an integer tensor (keys kept per query), got a "
                         f"{n.dtype} tensor; a fractional N would be truncated silently.")
    if n.is_meta:
        raise ValueError("n is a meta tensor (no values); pass an int or a tensor with data.")
    if n.numel() and int(n.min()) < 1:
        raise ValueError(f"n must hold values ≥ 1 (keys kept per query), got {int(n.min())}; "
                         "N = 0 would remove every key.")
    try:
        torch.broadcast_shapes(n.shape, rows)
    except RuntimeError:
        raise ValueError(f"n has shape {tuple(n.shape)}, which does not broadcast against the "
                         f"rows {tuple(rows)}; pass an int or one N per row (a replica).") from None
    return n


def check_weights(pattern: Any, name: str = "pattern") -> None:
    """Refuse weights a NaN, ±inf or negative entry of which would be ranked and renormalised
    into a silent wrong answer (and non-float or rank < 2 tensors)."""
    if not isinstance(pattern, Tensor) or not pattern.is_floating_point() or pattern.ndim < 2:
        what = (f"a {pattern.dtype} tensor of shape {tuple(pattern.shape)}"
                if isinstance(pattern, Tensor) else type(pattern).__name__)
        raise ValueError(f"{name} must be a float tensor [..., query, key] of attention weights, "
                         f"got {what}.")
    if pattern.is_meta:
        raise ValueError(f"{name} is a meta tensor (no values); pass the real attention weights.")
    if not bool(torch.isfinite(pattern).all()):
        raise ValueError(f"{name} holds NaN or ±inf weights; attention weights must be finite.")
    if bool((pattern < 0).any()):
        raise ValueError(f"{name} holds negative weights (min {float(pattern.min()):.3g}); "
                         "attention weights are ≥ 0. Pass the softmax output (hook_pattern), "
                         "not the scores.")


def check_pattern_hooks(model: Any, mask: Tensor) -> None:
    """The model must offer ``hooks(fwd_hooks=...)`` and the ``hook_pattern`` of every layer
    with a head in ``mask``."""
    if not callable(getattr(model, "hooks", None)):
        raise ValueError(
            f"{type(model).__name__} has no hooks(fwd_hooks=...) context manager; top-N attention "
            "needs a TransformerLens model (TransformerBridge or HookedTransformer)."
        )
    hook_dict = getattr(model, "hook_dict", None)
    if hook_dict is None:
        return
    names = [PATTERN_HOOK.format(layer=layer) for layer in _layers(mask)]
    missing = [name for name in names if name not in hook_dict]
    if missing:
        raise ValueError(
            f"The model exposes no {missing[0]} (missing for {len(missing)} layer(s)); top-N "
            "attention rewrites each head's pattern [batch, head, query, key]. Use a "
            "TransformerLens 4.x TransformerBridge or a HookedTransformer."
        )


def _layers(mask: Tensor) -> list[int]:
    """The layers with a head in the ``[layer, head]`` (or ``[replica, layer, head]``) mask."""
    return mask.reshape(-1, *mask.shape[-2:]).any(dim=(0, 2)).nonzero().flatten().tolist()


def scope_mask(
    n_layers: int, n_heads: int, layers: Iterable[int] | None = None,
    heads: Iterable[tuple[int, int]] | Bool[Tensor, "layer head"] | None = None,
) -> Bool[Tensor, "layer head"]:
    """``[layer, head]`` mask of the heads to sparsify: all (default), whole ``layers``, or
    ``(layer, head)`` pairs / a bool mask (``heads``); not both."""
    if layers is not None and heads is not None:
        raise ValueError("Pass layers or heads, not both: layers sparsifies every head of those "
                         "layers, heads only the listed (layer, head) pairs.")
    if heads is not None:
        mask = _hooks.head_mask(heads, n_layers, n_heads)
    elif layers is not None:
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
            raise ValueError(f"layers must be layer indices, e.g. [0, 5], got {layers!r}.")
        layers = list(layers)
        if len(set(layers)) != len(layers):  # as analyze_heads: a repeat is a typo, not a scope
            raise ValueError(f"layers has duplicates: {layers}; give each layer once.")
        mask = torch.zeros(n_layers, n_heads, dtype=torch.bool)
        for i, layer in enumerate(layers):
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
                raise ValueError(f"layers[{i}] = {layer!r} is not a layer of the model "
                                 f"(0..{n_layers - 1}).")
            mask[layer] = True
    else:
        mask = torch.ones(n_layers, n_heads, dtype=torch.bool)
    if not mask.any():
        raise ValueError("The scope is empty: no head to sparsify.")
    return mask


def sparsify_pattern(
    pattern: Float[Tensor, "*batch query key"],
    n: int | Int[Tensor, "*nbatch"],
    mode: SparsifyMode = "renormalize",
) -> Float[Tensor, "*batch query key"]:
    """Keep each query row's top-``n`` weights (ties → lower index), renormalised or not.

    Only causal keys (``key ≤ query``, aligned at the end) compete; masked keys carry weight 0
    and are never kept over a valid key with positive weight. ``renormalize`` divides the kept
    weights by their sum; ``delete`` leaves them. A row that loses no positive weight (e.g. one
    with ``≤ n`` valid keys) is returned bit for bit unchanged. ``n`` may be an integer tensor
    broadcasting against the rows (one ``N`` per replica). ``ValueError`` for an ``n`` that is
    not an int in ``1 … 2**63 - 1`` (or a tensor of such), and for NaN, infinite, negative or
    meta weights.

    >>> sparsify_pattern(torch.tensor([[1.0, 0.0], [0.25, 0.75]]), 1).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    >>> sparsify_pattern(torch.tensor([[1.0, 0.0], [0.25, 0.75]]), 1, "delete").tolist()
    [[1.0, 0.0], [0.0, 0.75]]
    """
    check_weights(pattern)
    limit = check_n_limit(n, pattern.shape[:-1])
    check_sparsify_mode(mode)
    return _sparsify(pattern, limit, mode)


def _sparsify(pattern: Tensor, n: Tensor, mode: SparsifyMode) -> Tensor:
    """:func:`sparsify_pattern` unchecked: the hooks' path, where a check per forward would
    cost a device sync."""
    n_query, n_key = pattern.shape[-2:]
    causal = torch.ones(n_query, n_key, dtype=torch.bool, device=pattern.device).tril(n_key - n_query)
    ranks = top_n_ranks(pattern, causal)
    limit = torch.as_tensor(n, device=pattern.device)
    keep = ranks < limit.unsqueeze(-1)
    kept = torch.where(keep, pattern, torch.zeros((), dtype=pattern.dtype, device=pattern.device))
    dropped = (~keep & (pattern != 0)).any(-1, keepdim=True)
    if mode == "renormalize":
        kept = kept / kept.sum(-1, keepdim=True)
    return torch.where(dropped, kept, pattern)


def replica_pattern_hook(
    layer: int, n: Int[Tensor, "replica ..."], where: Bool[Tensor, "replica head"], mode: SparsifyMode,
    n_heads: int,
) -> Callable[..., Tensor]:
    """Hook for ``R`` stacked copies of the input: in copy ``r`` the heads ``where[r]`` keep their
    top-``n[r]`` keys (``n [R]``), or head ``h`` its top-``n[r, h]`` (``n [R, head]``, a policy).
    Only the copies with a head in this layer are sorted; no head loop."""
    name = PATTERN_HOOK.format(layer=layer)
    touched = where.any(1).nonzero().flatten()

    def hook(pattern: Tensor, hook: Any = None) -> Tensor:
        if pattern.ndim != 4 or pattern.shape[1] != n_heads:
            raise ValueError(f"{name} has shape {tuple(pattern.shape)}; expected [batch, head={n_heads}, "
                             "query, key]. The model's hook_pattern must hold every query head's weights.")
        n_rep = where.shape[0]
        stacked = pattern.reshape(n_rep, pattern.shape[0] // n_rep, *pattern.shape[1:])
        index = touched.to(pattern.device)
        part = stacked.index_select(0, index)
        limits = n.to(pattern.device).index_select(0, index)
        # One N per copy, or per (copy, head); heads left alone (N = 0) are never chosen below.
        limits = limits[:, None, None, None] if limits.ndim == 1 else limits.clamp_min(1)[:, None, :, None]
        new = _sparsify(part, limits, mode)
        chosen = where.to(pattern.device).index_select(0, index)[:, None, :, None, None]
        part = torch.where(chosen, new, part)
        return stacked.index_copy(0, index, part).reshape(pattern.shape)

    return hook


def pattern_hooks(n: Tensor, masks: Bool[Tensor, "replica layer head"], mode: SparsifyMode,
                   n_heads: int) -> _hooks.HookList:
    """One :func:`replica_pattern_hook` per layer with a head in ``masks``; ``n`` is ``[R]``
    or, per head, ``[R, layer, head]``."""
    return [(PATTERN_HOOK.format(layer=layer),
             replica_pattern_hook(layer, n[:, layer] if n.ndim == 3 else n, masks[:, layer], mode, n_heads))
            for layer in _layers(masks)]


class TopNAttention(_hooks.HookContext):
    """``(hook_name, fn)`` pairs that sparsify attention to the top ``n`` keys, usable as::

        model.run_with_hooks(tokens, fwd_hooks=sparsified, return_type="loss")
        with sparsified: loss = model(tokens, return_type="loss")    # hooks removed on any exit

    Attributes: ``model``, ``n`` (an int, or the :class:`~.policy.TopNPolicy`), ``mode``,
    ``mask`` (``[layer, head]`` bool: the heads sparsified) and ``layers``.
    """

    _made_by = "top_n_attention(model, n)"

    def __init__(self, model: Any, n: int | TopNPolicy, mode: SparsifyMode, mask: Tensor) -> None:
        limit = n.n[None] if isinstance(n, TopNPolicy) else torch.tensor([n])
        super().__init__(pattern_hooks(limit, mask[None], mode, model_facts(model).shape()[1]))
        self.layers = _layers(mask)
        self.model, self.n, self.mode, self.mask = model, n, mode, mask
        self._contexts: list[Any] = []

    def __repr__(self) -> str:
        n = self.n if isinstance(self.n, int) else "policy"
        return (f"TopNAttention(n={n}, mode={self.mode!r}, layers={self.layers}, "
                f"heads={int(self.mask.sum())})")


def top_n_attention(
    model: Any,
    n: int | TopNPolicy | Int[Tensor, "layer head"] | Mapping[tuple[int, int], int],
    mode: SparsifyMode = "renormalize",
    *,
    layers: Iterable[int] | None = None,
    heads: Iterable[tuple[int, int]] | Bool[Tensor, "layer head"] | None = None,
) -> TopNAttention:
    """Hooks that keep only each query's top-``n`` attention weights (:func:`sparsify_pattern`).

    ``n`` is one ``N`` for every head in scope, or a per-head policy (SPEC §10): a
    :class:`~tl_geometry.capacity.TopNPolicy`, an integer ``[n_layers, n_heads]`` tensor or a
    ``{(layer, head): N}`` dict (heads not listed, or with ``N = 0``, keep every key), which is
    its own scope. A uniform ``N`` acts on every head (default), every head of ``layers``, or the
    ``(layer, head)`` pairs / bool mask ``heads``; heads outside the scope are left bit for bit
    unchanged, and ``N`` ≥ the sequence length changes nothing. The hooks are removed when the
    ``with`` block or ``run_with_hooks`` call ends, also on an exception.

    Examples:
        >>> with tl_geometry.capacity.top_n_attention(model, 8, "renormalize", layers=[0, 1]):  # doctest: +SKIP
        ...     loss = model(tokens, return_type="loss")
        >>> policy = tl_geometry.capacity.TopNPolicy.from_result(result, eps=0.05)          # doctest: +SKIP
        >>> with tl_geometry.capacity.top_n_attention(model, policy):                       # doctest: +SKIP
        ...     loss = model(tokens, return_type="loss")
    """
    check_sparsify_mode(mode)
    n_layers, n_heads = model_facts(model).shape()
    limit: int | TopNPolicy
    if isinstance(n, (TopNPolicy, Tensor, Mapping)):
        if layers is not None or heads is not None:
            raise ValueError("A per-head policy is its own scope: pass layers / heads only with a "
                             "uniform N (leave a head out of the policy, or give it N = 0, to keep "
                             "it dense).")
        limit = as_policy(n, n_layers, n_heads)
        mask = limit.mask
        if not mask.any():
            raise ValueError("The policy sparsifies no head (every N is 0: every key kept).")
    else:
        limit = check_n(n)  # an int ≥ 1: a bool, float, str or None is refused
        mask = scope_mask(n_layers, n_heads, layers, heads)
    check_pattern_hooks(model, mask)
    return TopNAttention(model, limit, mode, mask)

