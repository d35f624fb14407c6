"""What the token-level views read: token strings, one layer's heads from a cache (through
:func:`~tl_geometry.inputs.cache.read_layer`, never written to), cropping."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..functional.heads import kv_head_index, value_norms
from ..inputs.cache import CacheError, read_layer, resolve_layers


@dataclass(frozen=True)
class HeadRows:
    """One layer, one sequence, the chosen heads: attention and value norms of their KV heads."""

    layer: int
    heads: list[int]
    pattern: Float[Tensor, "head query key"]
    norms: Float[Tensor, "head key"]  # ‖v_j‖ of the KV head each query head reads

    def contributions(self, query: int) -> Float[Tensor, "head key"]:
        """``α_j ‖v_j‖`` of ``query`` for every head (SPEC §1: ‖y_j‖ = α_j ‖v_j‖)."""
        return self.pattern[:, query, :] * self.norms


def head_rows(cache: Any, layer: int, heads: int | Sequence[int] | None, batch: int) -> HeadRows:
    """Read ``layer``'s pattern and value norms for ``heads`` (None: all) of sequence ``batch``."""
    (layer,) = resolve_layers(cache, [layer])  # "the cache is missing ..." with the fix
    pattern, v = read_layer(cache, layer)
    n_batch, n_heads = pattern.shape[:2]
    if not -n_batch <= batch < n_batch:
        raise CacheError(f"batch={batch} is out of range: the cache holds {n_batch} sequence(s).")
    chosen = list(range(n_heads)) if heads is None else [heads] if isinstance(heads, int) else list(heads)
    bad = [h for h in chosen if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < n_heads]
    if bad or not chosen:
        raise CacheError(f"heads must be indices in 0..{n_heads - 1} of layer {layer}, got {chosen!r}.")
    index = torch.tensor(chosen)
    kv = kv_head_index(n_heads, v.shape[2])[index]  # GQA: an index, never an expanded copy
    norms = value_norms(v[batch].float())[:, kv].T  # [pos, kv] → [head, key]
    return HeadRows(layer, chosen, pattern[batch, index].float(), norms)


def str_tokens(tokens: Any, model: Any, batch: int, n_pos: int) -> list[str]:
    """Display strings of one sequence's tokens: ``tokens`` as given (strings), or ids
    (``[pos]`` or ``[batch, pos]``) decoded with ``model``'s tokenizer (or ``model`` itself);
    without ``tokens``, the positions ``0, 1, 2, ...``."""
    if tokens is None:
        return [str(i) for i in range(n_pos)]
    if isinstance(tokens, Sequence) and tokens and all(isinstance(t, str) for t in tokens):
        out = list(tokens)
    else:
        ids = torch.as_tensor(tokens)
        ids = ids[batch] if ids.ndim == 2 else ids
        tokenizer = getattr(model, "tokenizer", None) or model
        if tokenizer is None or not hasattr(tokenizer, "decode"):
            raise ValueError("Token ids need model= (or a tokenizer) to be shown as text; or pass str tokens.")
        out = [tokenizer.decode([i]) for i in ids.tolist()]
    if len(out) != n_pos:
        raise ValueError(f"Got {len(out)} tokens for a cache of {n_pos} positions.")
    return out


def window(query: int, max_tokens: int, sink: int = 0) -> tuple[list[int], int]:
    """Positions shown for ``query``: all of ``0..query`` when they fit in ``max_tokens``; else
    the sink and the last ``max_tokens - 1`` positions up to the query. Also returns how many
    positions were cropped (between the sink and the window)."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2 (the sink and the query), got {max_tokens}.")
    if query + 1 <= max_tokens:
        return list(range(query + 1)), 0
    start = query - max_tokens + 2
    return [sink, *range(start, query + 1)], start - sink - 1


def prepare(cache: Any, layer: int, heads: int | Sequence[int] | None, tokens: Any, model: Any, batch: int,
            query: int, max_tokens: int) -> tuple[HeadRows, int, int, list[int], int, list[str]]:
    """What a token-level view reads: the head rows, the number of positions, the query, the
    positions shown, how many are cropped, and the token strings."""
    rows = head_rows(cache, layer, heads, batch)
    n_pos = rows.pattern.shape[-1]
    if isinstance(query, bool) or not isinstance(query, int) or not -n_pos <= query < n_pos:
        raise ValueError(f"query must be a position in 0..{n_pos - 1} (or negative from the end), got {query!r}.")
    q = query % n_pos  # negative counts from the end
    kept, cropped = window(q, max_tokens)
    return rows, n_pos, q, kept, cropped, str_tokens(tokens, model, batch, n_pos)


def heads_phrase(heads: Sequence[int]) -> str:
    """``head 8``, ``heads 0 and 3``, ``heads 0, 1 and 3``."""
    if len(heads) == 1:
        return f"head {heads[0]}"
    return "heads " + ", ".join(map(str, heads[:-1])) + f" and {heads[-1]}"


def crop_note(cropped: int, kept: list[int], n_pos: int) -> list[str]:
    """The note of a cropped view (none where nothing was cropped)."""
    if not cropped:
        return []
    return [f"Long sequence: showing the sink (position {kept[0]}) and positions {kept[1]}–{kept[-1]} "
            f"of {n_pos}; the {cropped} positions in between are cropped. Raise max_tokens to see more."]
