"""Read and validate ``hook_pattern`` / ``hook_v`` from a TransformerLens cache or a dict.

Caches are read by exact hook name and by shape, never by model class, so an
``ActivationCache`` from TransformerLens 2.x, 3.x or 4.x and a plain ``dict`` of tensors all
work. Every "your cache is missing X / has the wrong shape" error of the toolkit lives here.
Nothing here writes to the caller's tensors: upcasts and cleaned copies are new tensors.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

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


CACHE_NAMES_FILTER = cache_names_filter


class CacheError(ValueError):
    """The cache cannot be analysed as given; the message names the problem and the fix."""


def _keys(cache: Any) -> list[str]:
    if not hasattr(cache, "keys") or not hasattr(cache, "__getitem__"):
        raise CacheError(
            f"Expected a TransformerLens ActivationCache or a dict of tensors, got "
            f"{type(cache).__name__}. {_FIX}"
        )
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
            raise CacheError(
                "The cache holds no 'blocks.{l}.attn.hook_pattern' (it has: "
                f"{have}{', ...' if len(keys) > 6 else ''}). {_FIX}"
            )
        layers = available
    else:
        if isinstance(layers, (int, str)) or not isinstance(layers, Sequence | range):
            raise CacheError(f"layers must be a list of layer indices, got {layers!r}.")
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers):
            raise CacheError(f"layers must hold non-negative int layer indices, got {list(layers)!r}.")
        layers = list(layers)
        if not layers:
            raise CacheError("layers is empty: pass None for every cached layer or a list of indices.")
        if len(set(layers)) != len(layers):
            raise CacheError(f"layers has duplicates: {layers}.")
    missing = [
        hook.format(layer=layer)
        for layer in layers
        for hook in (PATTERN_HOOK, VALUE_HOOK)
        if hook.format(layer=layer) not in keys
    ]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise CacheError(f"The cache is missing {shown}. {_FIX}")
    return layers


def _upcast(x: Tensor, name: str) -> Tensor:
    if not x.is_floating_point():
        raise CacheError(f"{name} has dtype {x.dtype}; expected a floating-point tensor.")
    # Half-precision caches are analysed in float32 or better (SPEC §1).
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def read_layer(cache: Any, layer: int) -> tuple[Tensor, Tensor]:
    """``pattern [batch, head, query, key]`` and ``v [batch, pos, kv_head, d_head]`` of a layer.

    A cache made with ``remove_batch_dim=True`` (3-D tensors) gets a batch of one. Shapes are
    checked against each other; half precision is upcast to float32 (new tensors).
    """
    pname, vname = PATTERN_HOOK.format(layer=layer), VALUE_HOOK.format(layer=layer)
    pattern, v = cache[pname], cache[vname]
    if not isinstance(pattern, Tensor) or not isinstance(v, Tensor):
        raise CacheError(f"{pname} and {vname} must be torch tensors.")
    if pattern.ndim == 3 and v.ndim == 3:
        pattern, v = pattern.unsqueeze(0), v.unsqueeze(0)
    if pattern.ndim != 4:
        raise CacheError(
            f"{pname} has shape {tuple(pattern.shape)}; expected [batch, head, query_pos, key_pos]."
        )
    if v.ndim != 4:
        hint = " (heads merged?) Cache the per-head hook_v." if v.ndim == 3 else ""
        raise CacheError(
            f"{vname} has shape {tuple(v.shape)}; expected [batch, pos, kv_head, d_head].{hint}"
        )
    batch, n_heads, n_query, n_key = pattern.shape
    if batch == 0 or n_key == 0:
        raise CacheError(f"{pname} is empty (shape {tuple(pattern.shape)}): nothing to analyse.")
    if n_query != n_key:
        raise CacheError(
            f"{pname} has {n_query} query and {n_key} key positions; tl_geometry analyses "
            "full causal self-attention patterns (query_pos == key_pos). Was the model run with "
            "a KV cache (past_key_values)? Re-run the whole sequence with run_with_cache."
        )
    if v.shape[0] != batch or v.shape[1] != n_key:
        raise CacheError(
            f"{vname} has shape {tuple(v.shape)} but {pname} has {tuple(pattern.shape)}: batch "
            "and positions must agree. Were they cached from different runs?"
        )
    n_kv = v.shape[2]
    if n_kv == 0 or n_heads % n_kv:
        raise CacheError(
            f"{pname} has {n_heads} query heads and {vname} has {n_kv} KV heads: the query heads "
            "must be a multiple of the KV heads (grouped-query attention)."
        )
    return _upcast(pattern, pname), _upcast(v, vname)


def check_attention_mask(mask: Tensor | None, batch: int, n_pos: int) -> Tensor:
    """Validate ``attention_mask`` (``[batch, pos]``, 1 = real token) and return it as bool."""
    if mask is None:
        return torch.ones(batch, n_pos, dtype=torch.bool)
    if not isinstance(mask, Tensor):
        try:
            mask = torch.as_tensor(mask)
        except (TypeError, ValueError, RuntimeError):
            raise CacheError(
                f"attention_mask must be a [batch, pos] tensor of 0/1, got {type(mask).__name__}."
            ) from None
    if mask.shape != (batch, n_pos):
        raise CacheError(
            f"attention_mask has shape {tuple(mask.shape)}; expected [batch, pos] = "
            f"[{batch}, {n_pos}], the tokenizer's attention_mask for the cached batch."
        )
    if mask.dtype != torch.bool:
        if ((mask != 0) & (mask != 1)).any():
            raise CacheError("attention_mask must hold only 0 (padding) and 1 (real token).")
        mask = mask != 0
    empty = (~mask.any(-1)).nonzero().flatten().tolist()
    if empty:
        raise CacheError(f"attention_mask marks every position of sequence(s) {empty} as padding.")
    return mask.cpu()


def clean_pattern(pattern: Tensor, mask: Tensor, name: str) -> Tensor:
    """Check the pattern on the positions that matter and zero the rest (a new tensor).

    Valid entries are causal keys of real tokens, seen from real queries. NaN or inf there is an
    error; probability mass on future keys or on keys the mask calls padding means the axes or
    the mask do not match the cache. NaN at padded queries (common for fully masked rows) is
    dropped.
    """
    n_pos = pattern.shape[-1]
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool, device=pattern.device).tril()
    mask = mask.to(pattern.device)
    rows = mask[:, None, :, None]
    valid = rows & causal & mask[:, None, None, :]
    bad = ~torch.isfinite(pattern) & valid
    if bad.any():
        b, h, q, k = bad.nonzero()[0].tolist()
        raise CacheError(
            f"{name} has {int(bad.sum())} NaN/inf entries at real positions (first at batch {b}, "
            f"head {h}, query {q}, key {k}). With a padded batch pass attention_mask; otherwise "
            "the forward pass itself overflowed (try float32 instead of float16)."
        )
    clean = torch.where(rows, pattern, 0.0)
    leaked = torch.where(rows & ~valid, clean.abs(), 0.0).amax()
    if leaked > 1e-4:
        where = "future keys" if torch.where(rows & ~causal, clean.abs(), 0).amax() > 1e-4 else "padding"
        fix = (
            "Its axes must be [batch, head, query_pos, key_pos] with a causal mask."
            if where == "future keys"
            else "Pass the attention_mask the model was run with (left and right padding both work)."
        )
        raise CacheError(f"{name} puts attention mass {float(leaked):.3g} on {where}. {fix}")
    if (clean < -1e-6).any():
        raise CacheError(f"{name} has negative entries: it must hold attention probabilities.")
    # Rows may sum to less than 1 (learned sink logits, sliding windows) but never to more.
    row_sum = clean.sum(-1).amax()
    if row_sum > 1.01:
        raise CacheError(
            f"{name} has a query row whose attention sums to {float(row_sum):.3g} > 1: it must hold "
            "probabilities normalised over keys, [batch, head, query_pos, key_pos]."
        )
    return torch.where(valid, clean, 0.0)


def check_values(v: Tensor, mask: Tensor, name: str) -> None:
    """NaN or inf in a real position's value vector is an error."""
    bad = ~torch.isfinite(v) & mask.to(v.device)[:, :, None, None]
    if bad.any():
        raise CacheError(f"{name} has {int(bad.sum())} NaN/inf entries at real positions.")


def warn_padding_suspected(pattern: Tensor, name: str) -> None:
    """Without a mask, query rows that hold no attention at all mean padding (or a broken run)."""
    dead = pattern.sum(-1).abs() < 1e-6
    if dead.any():
        warnings.warn(
            f"{name} has {int(dead.sum())} query rows with no attention mass. If the batch is "
            "padded, pass attention_mask so those positions are left out.",
            stacklevel=3,
        )
