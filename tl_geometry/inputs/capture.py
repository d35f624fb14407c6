"""Run a model's Hugging Face forward with SDPA attention and hand over each layer's q, k, v.

Instead of the ``[batch, head, query, key]`` pattern, each layer's post-rotary (and post-q/k-norm)
queries and keys and its values are captured as the attention function receives them, with the
layer's scale, sliding window, softcap and sinks; :func:`tl_geometry.functional.attention_rows`
recomputes any rows from them in float64. A custom attention function, registered with
transformers' ``AttentionInterface`` for one forward of the *base* model (no LM head, no logits),
hands the layer to the callback and delegates to transformers' SDPA attention.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .tokens import check_token_tensor, embedding_rows

_names = itertools.count()


@dataclass(frozen=True)
class AttentionParams:
    """One layer's attention parameters, as its attention function received them: ``scale``
    multiplies ``⟨q, k⟩``; ``window`` (key ``i`` visible to query ``t`` iff ``t − window < i ≤
    t``; ``None`` on global layers); ``softcap`` caps the scaled logits as ``softcap · tanh(x /
    softcap)``; ``sinks``, one extra softmax logit per query head (GPT-OSS)."""

    scale: float
    window: int | None
    softcap: float | None
    sinks: Tensor | None
    n_heads: int
    n_kv_heads: int

    def row_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``attention_rows`` / ``attention_row_blocks`` for this layer.

        >>> p = AttentionParams(0.125, 512, None, None, n_heads=4, n_kv_heads=1)
        >>> p.row_kwargs()
        {'scale': 0.125, 'window': 512, 'softcap': None, 'sinks': None}
        """
        return {"scale": self.scale, "window": self.window, "softcap": self.softcap,
                "sinks": self.sinks}


@dataclass(frozen=True)
class LayerCapture:
    """One layer's attention inputs, as the attention multiplies them: ``q`` ``[batch, pos, head,
    d]``, ``k`` and ``v`` ``[batch, pos, kv_head, d]`` (the layout of ``hook_rot_q`` /
    ``hook_rot_k`` / ``hook_v``). Views of the forward's own: clone what you keep."""

    layer: int
    q: Tensor
    k: Tensor
    v: Tensor
    params: AttentionParams
    logsumexp: Tensor | None = None
    """``[batch, head, pos]`` float32: each query's ``log Σ_i exp(scale·⟨q, k_i⟩)`` over the keys it
    sees, where ``capture_attention(..., logsumexp=True)`` asked and the kernel gives it (else
    ``None``): any key's weight is then ``exp(scale·⟨q, k⟩ − logsumexp)``."""


def hf_model_of(model: Any) -> Any:
    """The Hugging Face model: ``model`` itself, or a ``TransformerBridge``'s ``original_model``."""
    return getattr(model, "original_model", model)


@contextlib.contextmanager
def _original_modules(module: torch.nn.Module) -> Iterator[None]:
    """Every bridge component under ``module`` swapped for the HF module it wraps, then restored."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []

    def unwrap(parent: torch.nn.Module) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            original = getattr(child, "original_component", None)
            if isinstance(original, torch.nn.Module) and original is not child:
                swapped.append((parent, name, child))
                parent._modules[name] = original
                child = original
            unwrap(child)

    try:
        unwrap(module)
        yield
    finally:
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child


@contextlib.contextmanager
def attention_set_to(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Every config of ``model`` (its modules' and their sub-configs) set to the attention
    implementation ``name``, then restored."""
    found: dict[int, Any] = {}
    pending = [getattr(m, "config", None) for m in model.modules()]
    while pending:
        config = pending.pop()
        if config is None or id(config) in found or not hasattr(config, "_attn_implementation"):
            continue
        found[id(config)] = config
        pending.extend(getattr(config, key, None) for key in getattr(config, "sub_configs", {}))
    configs = list(found.values())
    saved = [config._attn_implementation_internal for config in configs]
    try:
        # The internal attribute: the public setter would also rewrite sub-configs' choices.
        for config in configs:
            config._attn_implementation_internal = name
        yield
    finally:
        for config, implementation in zip(configs, saved):
            config._attn_implementation_internal = implementation


@contextlib.contextmanager
def _attention_implementation(model: torch.nn.Module, function: Callable[..., Any],
                              skipped: set[int]) -> Iterator[None]:
    """``function`` (with SDPA's masks, bar those :func:`_window_mask` skips) as every config's
    attention, then undone."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"tl_geometry_capture_{next(_names)}"
    sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, lambda *args, **kwargs: _window_mask(sdpa_mask, skipped, *args, **kwargs))
    try:
        with attention_set_to(model, name):
            yield
    finally:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


def _window_mask(sdpa_mask: Callable[..., Any], skipped: set[int], *args: Any, **kwargs: Any) -> Any:
    """SDPA's mask; ``None`` for a plain sliding-window causal mask without padding, its window
    added to ``skipped`` so that the layer runs by query blocks (:func:`_by_query_blocks`)."""
    window = kwargs.get("local_size")
    padding = kwargs.get("attention_mask")
    plain = (not args and kwargs.get("allow_is_causal_skip", False)
             and kwargs.get("q_length") == kwargs.get("kv_length")
             and isinstance(kwargs.get("q_offset", 0), int) and kwargs.get("q_offset", 0) == 0
             and isinstance(kwargs.get("kv_offset", 0), int) and kwargs.get("kv_offset", 0) == 0
             and (padding is None or bool(padding.all())))
    if not (plain and isinstance(window, int) and window > 0):
        return sdpa_mask(*args, **kwargs)
    skipped.add(window)
    return None


def _by_query_blocks(attend: Callable[..., Any], module: torch.nn.Module, query: Tensor, key: Tensor,
                     value: Tensor, window: int, **kwargs: Any) -> tuple[Tensor, None]:
    """``attend``'s output ``[batch, pos, head, d]`` of a sliding-window layer, in blocks of
    ``window`` queries against the keys they see (a band mask of ``window × (2·window − 1)``)."""
    n_pos = query.shape[2]
    parts = []
    for start in range(0, n_pos, window):
        stop, lo = min(n_pos, start + window), max(0, start - window + 1)
        t = torch.arange(start, stop, device=query.device)[:, None]
        i = torch.arange(lo, stop, device=query.device)[None, :]
        band = ((i <= t) & (i > t - window))[None, None]
        out, _ = attend(module, query[:, :, start:stop], key[:, :, lo:stop], value[:, :, lo:stop], band, **kwargs)
        parts.append(out)
    return torch.cat(parts, dim=1), None


#: The CPU kernel that SDPA runs a causal float32 layer on, which also returns each query's
#: log-sum-exp (``None`` where this torch has no such operator).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _with_logsumexp(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                    params: AttentionParams, kwargs: dict[str, Any]) -> tuple[Tensor, Tensor] | None:
    """The layer's output ``[batch, pos, head, d]`` and each query's log-sum-exp, from the CPU
    kernel SDPA runs a plain causal float32 layer on (the same output); else ``None``."""
    n_pos = query.shape[2]
    plain = (mask is None and query.device.type == "cpu"
             and query.dtype == key.dtype == value.dtype == torch.float32
             and params.softcap is None and params.sinks is None
             and (params.window is None or params.window >= n_pos)
             and n_pos > 1 and key.shape[2] == n_pos and key.shape[-1] == value.shape[-1] == query.shape[-1]
             and not kwargs.get("dropout") and kwargs.get("position_bias") is None
             and kwargs.get("is_causal", getattr(module, "is_causal", True)) is True
             and query.shape[1] % key.shape[1] == 0
             # The kernel reads each vector as contiguous and does not check it (SDPA does).
             and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1)
    if _FLASH_CPU is None or not plain:
        return None
    try:
        out, lse = _FLASH_CPU(query, key, value, 0.0, True, scale=params.scale)
    except RuntimeError:  # a private operator: a torch whose kernel refuses these inputs gets SDPA
        return None
    return out.transpose(1, 2).contiguous(), lse


def _delegate(module: torch.nn.Module, softcap: float | None, sinks: Tensor | None) -> Callable[..., Any]:
    """The attention that computes the layer's output: SDPA, or the model's eager attention
    where SDPA cannot express the layer (softcapping, sinks), which then holds ``[query, key]``."""
    if softcap is None and sinks is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(f"{type(module).__name__} uses softcapping or attention sinks but "
                                  "its module has no eager_attention_forward to compute them.")

    def eager_with_additive_mask(module: Any, query: Tensor, key: Tensor, value: Tensor,
                                 mask: Tensor | None, **kwargs: Any) -> Any:
        # SDPA's mask (boolean, True = visible; or None = plain causal) as the additive float
        # mask that eager attention adds to its logits.
        if mask is None:
            n_query, n_key = query.shape[2], key.shape[2]
            mask = torch.ones(n_query, n_key, dtype=torch.bool, device=query.device)
            mask = mask.tril(n_key - n_query)[None, None]
        if mask.dtype == torch.bool:
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            mask = torch.where(mask, zero, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, mask, **kwargs)

    return eager_with_additive_mask


def model_windows(model: Any) -> list[int | None] | None:
    """The sliding window of every layer, read from the model's config without a forward; ``None``
    when it declares none. From the HF (text) config: ``layer_types`` (``"sliding_attention"``
    takes ``sliding_window``), else ``sliding_window`` for every layer (Mistral); else a
    TransformerLens config's ``attn_types`` (``"local"`` takes ``window_size``).

    >>> from types import SimpleNamespace as NS
    >>> model_windows(NS(config=NS(layer_types=["sliding_attention", "full_attention"], sliding_window=4)))
    [4, None]
    """
    config = text_config(hf_model_of(model))
    if config is not None:
        window = getattr(config, "sliding_window", None)
        kinds = getattr(config, "layer_types", None)
        if kinds is not None:
            windows = [int(window) if kind == "sliding_attention" and window else None for kind in kinds]
            return windows if any(w is not None for w in windows) else None
        n_layers = getattr(config, "num_hidden_layers", None)
        if window and isinstance(n_layers, int) and getattr(config, "use_sliding_window", True) is not False:
            return [int(window)] * n_layers
    cfg = getattr(model, "cfg", None)
    kinds, size = getattr(cfg, "attn_types", None), getattr(cfg, "window_size", None)
    if kinds is not None and size:
        return [int(size) if kind == "local" else None for kind in kinds]
    return None


def text_config(hf_model: Any) -> Any:
    """The (text) config of a Hugging Face model, or ``None``."""
    config = getattr(hf_model, "config", None)
    if config is not None and callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config()
    return config


def _params(module: Any, query: Tensor, key: Tensor, kwargs: dict[str, Any]) -> AttentionParams:
    """The layer's parameters from what its attention function was given."""
    scaling = kwargs.get("scaling")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    softcap = kwargs.get("softcap", getattr(module, "attn_logit_softcapping", None))
    sinks = kwargs.get("s_aux", getattr(module, "sinks", None))
    return AttentionParams(
        scale=float(scaling) if scaling is not None else query.shape[-1] ** -0.5,
        window=int(window) if window else None,
        softcap=float(softcap) if softcap else None,
        sinks=sinks.detach() if isinstance(sinks, Tensor) else None,
        n_heads=query.shape[1],
        n_kv_heads=key.shape[1],
    )


def capture_attention(model: Any, tokens: Tensor, on_layer: Callable[[LayerCapture], object], *,
                      attention_mask: Tensor | None = None, logsumexp: bool = False) -> None:
    """Run the base model on ``tokens`` ``[batch, pos]`` with SDPA; call ``on_layer`` per layer.

    ``on_layer`` runs inside the forward as soon as the layer's q/k/v exist: peak memory holds
    one layer's q/k/v, never a ``[query, key]`` pattern or logits. ``model`` is a transformers
    causal LM or a ``TransformerBridge`` around one (its hooks do not fire), left as it was;
    ``attention_mask`` ``[batch, pos]`` (1 on real tokens) is passed to the model (recompute rows
    with ``key_mask=attention_mask.bool()``). ``logsumexp=True`` also hands over
    :attr:`LayerCapture.logsumexp` where the layer's kernel gives it (``on_layer`` then runs after
    the attention). Bad ``tokens``, ``attention_mask`` or ``logsumexp`` raise a ``ValueError``
    naming the fix before the forward.

    Example::

        rows = {}
        def on_layer(c):
            last = torch.full((c.q.shape[0], 1), c.q.shape[1] - 1)
            rows[c.layer] = attention_rows(c.q, c.k, last, **c.params.row_kwargs())
        capture_attention(model, tokens, on_layer)
    """
    hf_model = hf_model_of(model)
    base = getattr(hf_model, "base_model", hf_model)  # the decoder stack, without the LM head
    if not isinstance(logsumexp, (bool, np.bool_)):
        raise ValueError(f"logsumexp must be True or False, got {logsumexp!r} ({type(logsumexp).__name__}); "
                         "pass logsumexp=True to hand each query's log-sum-exp to the callback.")
    check_token_tensor(tokens, "tokens", embedding_rows(base))
    if attention_mask is not None and (not isinstance(attention_mask, Tensor)
                                       or tuple(attention_mask.shape) != tuple(tokens.shape)):
        got = list(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a [batch, pos] tensor shaped like tokens "
                         f"({list(tokens.shape)}), 1 on real tokens; got {got}.")
    skipped: set[int] = set()  # the windows whose masks were not formed (_window_mask)

    def attention(module: Any, query: Tensor, key: Tensor, value: Tensor,
                  mask: Tensor | None, **kwargs: Any) -> Any:
        # query [batch, head, pos, d], key/value [batch, kv_head, pos, d] (transformers' layout).
        params = _params(module, query, key, kwargs)
        layer = getattr(module, "layer_idx", None)
        done = _with_logsumexp(module, query, key, value, mask, params, kwargs) if logsumexp else None
        on_layer(LayerCapture(
            layer=int(layer) if layer is not None else -1,
            q=query.transpose(1, 2), k=key.transpose(1, 2), v=value.transpose(1, 2),
            params=params, logsumexp=None if done is None else done[1],
        ))
        if done is not None:
            return done[0], None
        attend = _delegate(module, params.softcap, params.sinks)
        if mask is None and params.window in skipped and params.window < query.shape[2]:
            return _by_query_blocks(attend, module, query, key, value, params.window, **kwargs)
        return attend(module, query, key, value, mask, **kwargs)

    with (_original_modules(hf_model), _attention_implementation(hf_model, attention, skipped),
          torch.no_grad()):
        device = base.get_input_embeddings().weight.device  # the first layer's, under a device map
        mask = attention_mask.to(device) if attention_mask is not None else None
        base(input_ids=tokens.to(device), attention_mask=mask, use_cache=False)


def capture_all(model: Any, tokens: Tensor, *, attention_mask: Tensor | None = None) -> list[LayerCapture]:
    """Every layer's :class:`LayerCapture` (cloned), in layer order: for small inputs and tests."""
    layers: list[LayerCapture] = []

    def keep(c: LayerCapture) -> None:
        layers.append(LayerCapture(c.layer, c.q.clone(), c.k.clone(), c.v.clone(), c.params))

    capture_attention(model, tokens, keep, attention_mask=attention_mask)
    return sorted(layers, key=lambda c: c.layer)
