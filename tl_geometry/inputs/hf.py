"""Plain Hugging Face (or nnsight) tensors as the dict that :func:`tl_geometry.analyze_heads`
reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

from torch import Tensor

from .cache import PATTERN_HOOK, VALUE_HOOK, CacheError, check_layer_indices

__all__ = ["from_hf"]

#: How ``values`` are laid out: ``"hf"`` ``[batch, kv_head, pos, d_head]`` (transformers' cache and
#: split ``v_proj`` outputs), ``"tl"`` ``[batch, pos, kv_head, d_head]`` (``hook_v``).
ValuesLayout = Literal["hf", "tl"]

_VALUES_FIX = (
    "Pass one [batch, kv_head, pos, d_head] tensor per layer, e.g. "
    "tuple(layer.values for layer in outputs.past_key_values.layers) from a forward with "
    "use_cache=True"
)


def _per_layer(x: Any, name: str) -> list[Any]:
    if isinstance(x, Tensor):
        raise CacheError(f"{name} is one tensor of shape {tuple(x.shape)}; from_hf takes one "
                         "tensor per layer (a tuple or list), as transformers returns them. For a "
                         f"single layer pass ({name},) and layers=[its index].")
    if hasattr(x, "layers") and not isinstance(x, (list, tuple)):  # a transformers Cache object
        raise CacheError(f"{name} is a {type(x).__name__}, not a tuple of tensors. {_VALUES_FIX}.")
    if not isinstance(x, (list, tuple)):
        raise CacheError(f"{name} must be a tuple or list with one tensor per layer, got {type(x).__name__}.")
    return list(x)


def from_hf(attentions: Sequence[Tensor], values: Sequence[Tensor], *,
            layers: Sequence[int] | None = None,
            values_layout: ValuesLayout | None = None) -> dict[str, Tensor]:
    """The ``hook_pattern`` / ``hook_v`` dict of Hugging Face attentions and value states.

    ``attentions``: one ``[batch, head, query, key]`` tensor per layer, as a forward with
    ``output_attentions=True`` (eager attention) returns them. ``values``: one ``[batch, kv_head,
    pos, d_head]`` tensor per layer, after any value bias and before ``W_O``. Element ``i`` of
    both is layer ``layers[i]`` (default ``0, 1, 2, ...``). Each value becomes the view
    ``value.permute(0, 2, 1, 3)``; nothing is copied. ``values_layout``: ``"hf"`` (the above),
    ``"tl"`` (already ``[batch, pos, kv_head, d_head]``), or ``None`` (default): ``"hf"`` where
    the shape says so, refused where it fits both (as many positions as KV heads).

    >>> out = hf_model(tokens, output_attentions=True, use_cache=True)        # doctest: +SKIP
    >>> values = tuple(layer.values for layer in out.past_key_values.layers)  # doctest: +SKIP
    >>> result = tl_geometry.analyze_heads(from_hf(out.attentions, values))   # doctest: +SKIP
    """
    if values_layout is not None and values_layout not in get_args(ValuesLayout):
        raise CacheError(f"values_layout must be 'hf' ([batch, kv_head, pos, d_head], transformers' layout), "
                         f"'tl' ([batch, pos, kv_head, d_head], hook_v's) or None (read from the shape), "
                         f"got {values_layout!r}.")
    attentions = _per_layer(attentions, "attentions")
    values = _per_layer(values, "values")
    if not attentions:
        raise CacheError(
            "attentions is empty. Run the Hugging Face model with output_attentions=True and "
            "attn_implementation=\"eager\" (a model wrapped by TransformerLens returns none: use "
            "its run_with_cache instead)."
        )
    if len(values) != len(attentions):
        raise CacheError(f"Got {len(attentions)} attention tensors and {len(values)} value "
                         "tensors: give one of each per layer, from the same forward.")
    indices = list(range(len(attentions))) if layers is None else check_layer_indices(layers)
    if len(indices) != len(attentions):
        raise CacheError(f"layers lists {len(indices)} layer(s) for {len(attentions)} attention "
                         "tensors: give one index per tensor, in the same order.")
    out: dict[str, Tensor] = {}
    for i, (layer, pattern, value) in enumerate(zip(indices, attentions, values)):
        out[PATTERN_HOOK.format(layer=layer)] = _check_pattern(pattern, i)
        out[VALUE_HOOK.format(layer=layer)] = _value_view(value, pattern, i, values_layout)
    return out


def _check_pattern(pattern: Any, i: int) -> Tensor:
    if pattern is None:
        raise CacheError(f"attentions[{i}] is None: the model did not return its attention "
                         "weights. Load it with attn_implementation=\"eager\" (SDPA and flash "
                         "attention never form them) and run it with output_attentions=True.")
    if isinstance(pattern, (list, tuple)):
        raise CacheError(f"attentions[{i}] is a {type(pattern).__name__}, not a tensor. With "
                         "generate(), outputs.attentions holds one tuple per generated token: run "
                         "one forward over the whole sequence instead.")
    if not isinstance(pattern, Tensor):
        raise CacheError(f"attentions[{i}] must be a torch tensor, got {type(pattern).__name__}.")
    if pattern.ndim != 4:
        raise CacheError(f"attentions[{i}] has shape {tuple(pattern.shape)}; expected [batch, "
                         "head, query, key], as output_attentions=True returns it (add a batch "
                         "axis with .unsqueeze(0)).")
    if pattern.shape[-2] != pattern.shape[-1]:
        raise CacheError(f"attentions[{i}] has {pattern.shape[-2]} queries and {pattern.shape[-1]} "
                         "keys: tl_geometry reads full self-attention patterns. Run the whole "
                         "sequence in one forward, without past_key_values from an earlier one.")
    return pattern


def _value_view(value: Any, pattern: Tensor, i: int, layout: ValuesLayout | None = None) -> Tensor:
    """``values[i]`` as ``[batch, pos, kv_head, d_head]``: permuted from the layout named, or,
    with none named, from the layout its shape leaves (refused where both fit)."""
    if not isinstance(value, Tensor):
        pair = isinstance(value, (list, tuple)) and len(value) == 2
        hint = (" It looks like a (key, value) pair of the legacy past_key_values format: pass "
                "tuple(v for k, v in past_key_values).") if pair else f" {_VALUES_FIX}."
        raise CacheError(f"values[{i}] must be a torch tensor, got {type(value).__name__}.{hint}")
    batch, n_heads, _, n_pos = pattern.shape
    if value.ndim == 3:
        raise CacheError(f"values[{i}] has shape {tuple(value.shape)}, heads merged (a v_proj "
                         "output?); split them into [batch, kv_head, pos, d_head] with "
                         "v.unflatten(-1, (n_kv_heads, -1)).transpose(1, 2).")
    if value.ndim != 4:
        raise CacheError(f"values[{i}] has shape {tuple(value.shape)}; expected [batch, kv_head, pos, d_head].")
    if value.shape[0] != batch:
        raise CacheError(f"values[{i}] has batch {value.shape[0]} and attentions[{i}] has batch "
                         f"{batch}: take both from the same forward.")
    if layout == "tl":
        if value.shape[1] != n_pos:
            raise CacheError(f"values[{i}] has shape {tuple(value.shape)}; values_layout='tl' "
                             f"expects [batch, pos, kv_head, d_head] with pos = {n_pos}, the keys "
                             f"of attentions[{i}]. Are they [batch, kv_head, pos, d_head]? Then "
                             "pass values_layout='hf'.")
        _check_kv_heads(n_heads, value.shape[2], i, "axis 2")
        return value
    if value.shape[2] != n_pos:
        swapped = layout is None and value.shape[1] == n_pos and n_heads % value.shape[2] == 0
        hint = (" It looks like [batch, pos, kv_head, d_head] already: pass values_layout='tl', or "
                "v.transpose(1, 2)." if swapped else
                " Were they taken from another forward? A sliding-window layer's cache keeps only "
                "the last window of values: take that layer's values from a hook on v_proj.")
        raise CacheError(f"values[{i}] has shape {tuple(value.shape)}; expected [batch, kv_head, "
                         f"pos, d_head] with pos = {n_pos}, the keys of attentions[{i}].{hint}")
    n_kv = value.shape[1]
    _check_kv_heads(n_heads, n_kv, i, "axis 1")
    if layout is None and n_pos > 1 and value.shape[1] == n_pos:
        # [batch, T, T, d_head] is [batch, kv_head, pos, d_head] and [batch, pos, kv_head,
        # d_head] alike: read the wrong way, every head would get another head's values.
        raise CacheError(f"values[{i}] has shape {tuple(value.shape)}: with {n_pos} positions and "
                         f"{n_kv} KV heads it fits both [batch, kv_head, pos, d_head] "
                         "(transformers' cache, a split v_proj output) and [batch, pos, kv_head, "
                         "d_head] (TransformerLens's hook_v). Name the layout: values_layout='hf' "
                         "or values_layout='tl'.")
    return value.permute(0, 2, 1, 3)


def _check_kv_heads(n_heads: int, n_kv: int, i: int, axis: str) -> None:
    """The query heads are a multiple of the KV heads (grouped-query attention)."""
    if n_kv == 0 or n_heads % n_kv:
        raise CacheError(f"attentions[{i}] has {n_heads} heads and values[{i}] has {n_kv} KV heads "
                         f"({axis}): the query heads must be a multiple of the KV heads. Is {axis} "
                         "of the values the KV heads?")
