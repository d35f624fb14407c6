"""Read and validate ``hook_pattern`` / ``hook_v`` from a TransformerLens cache or a dict.

Caches are read by exact hook name and by shape, never by model class (a TransformerLens
``ActivationCache`` or a plain ``dict``); every "your cache is missing X" error lives here.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

PATTERN_HOOK = "blocks.{layer}.attn.hook_pattern"
VALUE_HOOK = "blocks.{layer}.attn.hook_v"
_PATTERN_RE = re.compile(r"^blocks\.(\d+)\.attn\.hook_pattern$")
_FIX = (
    "Cache them with model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER) "
    "(that keeps only hook_pattern and hook_v), or pass a dict with these exact names."
)


def cache_names_filter(name: str) -> bool:
    """``names_filter`` for ``run_with_cache`` keeping exactly what tl_geometry reads."""
    return name.endswith(("attn.hook_pattern", "attn.hook_v"))


#: :func:`cache_names_filter`, the ``names_filter`` that keeps only ``hook_pattern`` and ``hook_v``.
CACHE_NAMES_FILTER = cache_names_filter


def first_few(values: Sequence[Any]) -> str:
    """The first 8 of ``values``, then ``…`` where more follow: indices named in a message."""
    return f"{list(values[:8])}{' …' if len(values) > 8 else ''}"


class CacheError(ValueError):
    """The cache cannot be analysed as given; the message names the problem and the fix."""


def _keys(cache: Any) -> list[str]:
    if not hasattr(cache, "keys") or not hasattr(cache, "__getitem__"):
        raise CacheError("Expected a TransformerLens ActivationCache or a dict of tensors, got "
                         f"{type(cache).__name__}. {_FIX}")
    return [str(k) for k in cache.keys()]  # noqa: SIM118 (duck-typed: only keys() is required)


def cached_layers(cache: Mapping[str, Tensor] | Any) -> list[int]:
    """Layers whose ``hook_pattern`` is in the cache, sorted."""
    return sorted(int(m.group(1)) for k in _keys(cache) if (m := _PATTERN_RE.match(k)))


def resolve_layers(cache: Any, layers: Sequence[int] | None) -> list[int]:
    """The layers to analyse: all cached ones by default; each must have pattern and v."""
    keys = set(_keys(cache))
    available = cached_layers(cache)
    if layers is None:
        if not available:
            have = ", ".join(sorted(keys)[:6]) or "nothing"
            raise CacheError("The cache holds no 'blocks.{l}.attn.hook_pattern' (it has: "
                             f"{have}{', ...' if len(keys) > 6 else ''}). {_FIX}")
        layers = available
    else:
        layers = check_layer_indices(layers)
    missing = [name for layer in layers for hook in (PATTERN_HOOK, VALUE_HOOK)
               if (name := hook.format(layer=layer)) not in keys]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise CacheError(f"The cache is missing {shown}. {_FIX}")
    return layers


def check_layer_indices(layers: Any, n_layers: int | None = None) -> list[int]:
    """Validate a list of layer indices (Python or NumPy ints; no bools, floats, strings, repeats)."""
    if isinstance(layers, (int, str, bytes)) or not isinstance(layers, (Sequence, range, np.ndarray)):
        raise CacheError(f"layers must be a list of layer indices, got {layers!r}.")
    values = list(layers)
    if any(isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 0
           for x in values):
        raise CacheError(f"layers must hold non-negative int layer indices, got {values!r}.")
    values = [int(x) for x in values]
    if not values:
        raise CacheError("layers is empty: pass None for every layer or a list of indices.")
    if len(set(values)) != len(values):
        raise CacheError(f"layers has duplicates: {values}; give each layer once.")
    if n_layers is not None and max(values) >= n_layers:
        raise CacheError(f"layers must be indices below {n_layers} (the model's layers), got {values}.")
    return values


#: Floating dtypes the analysis reads; half precision is upcast (SPEC §1: float32 or better).
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _checked(x: Tensor, name: str, upcast: bool) -> Tensor:
    if x.is_meta:
        raise CacheError(f"{name} is on the meta device and holds no values: cache a real forward pass.")
    if x.dtype not in _DTYPES:
        raise CacheError(f"{name} has dtype {x.dtype}; expected a floating-point tensor (float16, "
                         "bfloat16, float32 or float64; cast it with .float()).")
    # Half-precision caches are analysed in float32 or better (SPEC §1).
    return x.float() if upcast and x.dtype in (torch.float16, torch.bfloat16) else x


def read_layer(cache: Any, layer: int, *, upcast: bool = True) -> tuple[Tensor, Tensor]:
    """``pattern [batch, head, query, key]`` and ``v [batch, pos, kv_head, d_head]`` of a layer,
    shapes and dtypes checked (3-D tensors get a batch of one; ``upcast``: half precision to
    float32)."""
    pname, vname = PATTERN_HOOK.format(layer=layer), VALUE_HOOK.format(layer=layer)
    pattern, v = cache[pname], cache[vname]
    if not isinstance(pattern, Tensor) or not isinstance(v, Tensor):
        raise CacheError(f"{pname} and {vname} must be torch tensors.")
    if pattern.ndim == 3 and v.ndim == 3:
        pattern, v = pattern.unsqueeze(0), v.unsqueeze(0)
    if pattern.ndim != 4:
        raise CacheError(f"{pname} has shape {tuple(pattern.shape)}; expected [batch, head, "
                         "query_pos, key_pos].")
    if v.ndim != 4:
        hint = " (heads merged?) Cache the per-head hook_v." if v.ndim == 3 else ""
        raise CacheError(f"{vname} has shape {tuple(v.shape)}; expected [batch, pos, kv_head, "
                         f"d_head].{hint}")
    batch, n_heads, n_query, n_key = pattern.shape
    if batch == 0 or n_key == 0 or n_heads == 0:
        raise CacheError(f"{pname} is empty (shape {tuple(pattern.shape)}): nothing to analyse.")
    if n_query != n_key:
        raise CacheError(f"{pname} has {n_query} query and {n_key} key positions; tl_geometry "
                         "analyses full causal self-attention patterns (query_pos == key_pos). Was "
                         "the model run with a KV cache (past_key_values)? Re-run the whole "
                         "sequence with run_with_cache.")
    if v.shape[0] != batch or v.shape[1] != n_key:
        raise CacheError(f"{vname} has shape {tuple(v.shape)} but {pname} has "
                         f"{tuple(pattern.shape)}: batch and positions must agree. Were they "
                         "cached from different runs?")
    n_kv = v.shape[2]
    if n_kv == 0 or n_heads % n_kv:
        raise CacheError(
            f"{pname} has {n_heads} query heads and {vname} has {n_kv} KV heads: the query heads "
            "must be a multiple of the KV heads (grouped-query attention)."
        )
    if v.shape[3] == 0:
        raise CacheError(f"{vname} has d_head = 0 (shape {tuple(v.shape)}): there is no value to analyse.")
    if pattern.device != v.device:
        raise CacheError(f"{pname} is on {pattern.device} and {vname} on {v.device}: move both to one device.")
    return _checked(pattern, pname, upcast), _checked(v, vname, upcast)


def check_attention_mask(mask: Any, batch: int, n_pos: int, device: Any = "cpu") -> Tensor:
    """Validate ``attention_mask`` (``[batch, pos]``, 1 = real token); a bool tensor on ``device``."""
    if mask is None:
        return torch.ones(batch, n_pos, dtype=torch.bool, device=device)
    if not isinstance(mask, Tensor):
        try:
            mask = torch.as_tensor(mask)
        except (TypeError, ValueError, RuntimeError):
            raise CacheError("attention_mask must be a [batch, pos] tensor of 0/1, got "
                             f"{type(mask).__name__}.") from None
    if mask.shape != (batch, n_pos):
        raise CacheError(f"attention_mask has shape {tuple(mask.shape)}; expected [batch, pos] = "
                         f"[{batch}, {n_pos}], the tokenizer's attention_mask for the cached batch.")
    if mask.dtype != torch.bool:
        if ((mask != 0) & (mask != 1)).any():
            raise CacheError("attention_mask must hold only 0 (padding) and 1 (real token).")
        mask = mask != 0
    empty = (~mask.any(-1)).nonzero().flatten().tolist()
    if empty:
        raise CacheError(f"attention_mask marks every position of sequence(s) {empty} as padding.")
    # A hole (a 0 between two 1s of one row) is refused: the forward passes disagree on the
    # positions there. Padding at either end of a row is fine.
    first = mask.to(torch.int8).argmax(-1)
    last = n_pos - 1 - mask.flip(-1).to(torch.int8).argmax(-1)
    holes = (last - first + 1 != mask.sum(-1)) & mask.any(-1)
    if holes.any():
        rows = holes.nonzero().flatten().tolist()
        b = rows[0]
        inside = (~mask[b]).nonzero().flatten()
        p = int(inside[(inside > first[b]) & (inside < last[b])][0])
        raise CacheError(f"attention_mask has padding inside sequence(s) {first_few(rows)} (a 0 "
                         f"between 1s, e.g. sequence {b} at position {p}): padding must be "
                         "contiguous at the start or end of each row; split the sequence or drop "
                         "the hole.")
    return mask.to(device)


def check_cache_tokens(tokens: Any, batch: int, n_pos: int) -> Tensor | None:
    """``tokens`` once it is ``None`` or the ``[batch, pos]`` integer token ids of the cached
    sequences; a :class:`CacheError` naming the fix otherwise."""
    if tokens is not None and (not isinstance(tokens, Tensor) or tuple(tokens.shape) != (batch, n_pos)
                               or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool):
        raise CacheError(f"tokens must be the [batch, pos] = [{batch}, {n_pos}] integer token ids the cache "
                         f"was made from, got {getattr(tokens, 'shape', type(tokens).__name__)}; pass "
                         "those ids, or tokens=None (no id is then read: the local sinks' token is NaN).")
    return tokens


def warn_pad_tokens(tokens: Any, model: Any, shape: tuple[int, int, int]) -> None:
    """Warn when ``tokens`` hold runs of the tokenizer's pad token at a sequence's ends: without
    ``attention_mask`` they would be analysed as real tokens."""
    if check_cache_tokens(tokens, shape[0], shape[2]) is None:
        return
    tokenizer = getattr(model, "tokenizer", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        return
    is_pad = tokens.cpu() == pad
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos == pad:  # a BOS that doubles as the pad token is the sink, not padding
        is_pad[:, 0] = False
    trailing = is_pad.flip(-1).to(torch.int8).cummin(-1).values.flip(-1).bool()
    leading = is_pad.to(torch.int8).cummin(-1).values.bool()
    padded = trailing | leading
    if padded.any():
        rows = padded.any(-1).nonzero().flatten().tolist()
        warnings.warn(
            f"tokens hold {int(padded.sum())} pad tokens (id {pad}) at the ends of sequence(s) "
            f"{first_few(rows)} but no attention_mask was given: pads are "
            "then analysed as real tokens. Build mask = (tokens != pad_id) (keeping BOS), run the "
            "forward pass with attention_mask=mask and pass the same mask here; or use "
            "tl_geometry.analyze_model(model, texts), which pads and masks for you.",
            stacklevel=3,
        )
