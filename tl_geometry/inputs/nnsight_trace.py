"""An nnsight model's attention patterns and values, saved in one trace, as the dict that
:func:`tl_geometry.analyze_heads` reads. ``v`` is ``v_proj``'s output split into heads, so an
attention module with any other submodule (a value norm) is refused rather than read wrongly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from .cache import CacheError, check_layer_indices
from .capture import attention_set_to
from .facts import model_facts
from .hf import from_hf
from .tokens import check_token_tensor, embedding_rows

__all__ = ["from_nnsight"]

#: Where the decoder layers live, relative to the Hugging Face model nnsight wraps.
_LAYER_PATHS = ("model.layers", "model.language_model.layers")
#: Submodules an attention module of a known family has; anything else (``v_norm``) may change v.
_KNOWN_PARTS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "rotary_emb"})
_OWN_TRACE = "save the attention weights and v_proj outputs in your own trace and pass them to from_hf"


def _hf_model(model: Any, nnsight: Any) -> torch.nn.Module:
    """The Hugging Face model an nnsight model wraps, its weights loaded."""
    if not isinstance(model, nnsight.Envoy):
        hint = (" A TransformerBridge caches hook_pattern and hook_v itself: use "
                "model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)."
                if hasattr(model, "run_with_cache") else
                " Wrap it: nnsight.LanguageModel(hf_model, tokenizer=tokenizer), or run it yourself "
                "and use tl_geometry.inputs.from_hf.")
        raise TypeError(f"from_nnsight takes an nnsight LanguageModel, got {type(model).__name__}.{hint}")
    if not getattr(model, "dispatched", True):
        model.dispatch()  # what the trace would do first: load the weights
    hf = getattr(model, "_module", None)
    if not isinstance(hf, torch.nn.Module) or not hasattr(hf, "config"):
        raise CacheError(f"from_nnsight reads nnsight models of Hugging Face transformers, got one "
                         f"around {type(hf).__name__}; {_OWN_TRACE}.")
    if hf.training:
        raise CacheError(f"{type(hf).__name__} is in training mode, where attention dropout changes "
                         "the pattern: call model.eval() first.")
    return hf


def _layer_stack(hf: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The decoder layers' path and modules, each with a ``self_attn`` of a known family."""
    for path in _LAYER_PATHS:
        stack: Any = hf
        for part in path.split("."):
            stack = getattr(stack, part, None)
        if isinstance(stack, torch.nn.ModuleList) and len(stack) and all(hasattr(b, "self_attn") for b in stack):
            for i, block in enumerate(stack):
                _check_attention(block.self_attn, f"{path}.{i}.self_attn")
            return path, stack
    raise CacheError(f"from_nnsight reads Llama/SmolLM2-, Qwen2- and Gemma-3-style models (model.layers[i]"
                     f".self_attn); {type(hf).__name__} has no such layers: {_OWN_TRACE}.")


def _check_attention(attn: Any, where: str) -> None:
    parts = dict(attn.named_children())
    missing = [name for name in ("q_proj", "k_proj", "v_proj", "o_proj") if name not in parts]
    if missing or not isinstance(getattr(attn, "head_dim", None), int):
        lacks = f"no {', '.join(missing)}" if missing else "no int head_dim"
        raise CacheError(f"{where} ({type(attn).__name__}) has {lacks}, so its values cannot be read "
                         f"from v_proj (fused projections?): {_OWN_TRACE}.")
    unknown = sorted(set(parts) - _KNOWN_PARTS)
    if unknown or getattr(attn, "is_kv_shared_layer", False):
        what = f"has {', '.join(unknown)}, which may change" if unknown else "reuses another layer's"
        raise CacheError(f"{where} ({type(attn).__name__}) {what} the values after v_proj, so v_proj's "
                         f"output would not be its v: {_OWN_TRACE}, with v as the model computes it.")


def _token_ids(model: Any, hf: Any, tokens: Any, attention_mask: Any) -> Tensor:
    """``tokens`` as ``[batch, pos]`` ids; text tokenized as :func:`~tl_geometry.text_windows` does."""
    if isinstance(tokens, Mapping):
        if "input_ids" not in tokens:
            raise CacheError(f"tokens is a mapping without input_ids (keys {sorted(tokens)}); pass "
                             "tokenizer(texts, return_tensors='pt') or the ids tensor.")
        if attention_mask is None:
            attention_mask = tokens.get("attention_mask")
        tokens = tokens["input_ids"]
    if isinstance(tokens, str) or (isinstance(tokens, (list, tuple)) and tokens
                                   and all(isinstance(t, str) for t in tokens)):
        # Each text without special tokens, after BOS where the model was trained with one.
        tokenizer = getattr(model, "tokenizer", None)
        if tokenizer is None:
            raise CacheError("The nnsight model has no tokenizer to read text with: pass token ids, "
                             "or wrap the model with LanguageModel(hf_model, tokenizer=tokenizer).")
        bos = model_facts(tokenizer).bos_to_prepend()
        rows = [([] if bos is None else [bos]) + list(tokenizer(text, add_special_tokens=False)
                                                      ["input_ids"])
                for text in ([tokens] if isinstance(tokens, str) else tokens)]
        lengths = sorted({len(row) for row in rows})
        if len(lengths) > 1:
            raise CacheError(f"The texts have {lengths[0]} to {lengths[-1]} tokens; a batch of them "
                             "would be padded: from_nnsight reads unpadded batches, so pass one text "
                             "at a time or texts of one length in tokens (e.g. "
                             "tl_geometry.text_windows(model.tokenizer, text)).")
        tokens = torch.tensor(rows, dtype=torch.long)
    if not isinstance(tokens, Tensor):
        raise CacheError(f"tokens must be text, a list of texts or a [batch, pos] tensor of token ids, "
                         f"got {type(tokens).__name__}.")
    check_token_tensor(tokens, "tokens", embedding_rows(hf), error=CacheError)
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask)
        if tuple(mask.shape) != tuple(tokens.shape):
            raise CacheError(f"attention_mask has shape {list(mask.shape)}; expected {list(tokens.shape)}, "
                             "the shape of tokens.")
        padded = (mask == 0).any(-1).nonzero().flatten().tolist()
        if padded:
            raise CacheError(f"attention_mask pads sequence(s) {padded[:8]}: from_nnsight reads unpadded "
                             "batches; pass sequences of one length (or one at a time), or use from_hf "
                             "and analyze_heads(cache, attention_mask=mask).")
    return tokens


def from_nnsight(
    model: Any, tokens: Int[Tensor, "batch pos"] | str | Sequence[str] | Mapping[str, Any], *,
    layers: Sequence[int] | None = None, attention_mask: Int[Tensor, "batch pos"] | None = None,
) -> dict[str, Tensor]:
    """The ``hook_pattern`` / ``hook_v`` dict of an nnsight model, from one trace over ``tokens``.

    ``model`` is an nnsight ``LanguageModel`` (or ``TransformersModel``) around a Hugging Face
    causal LM of the Llama / SmolLM2, Mistral, Qwen2 or Gemma-3 families (``model.layers[i]
    .self_attn`` with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``). One trace, with eager
    attention, saves for each of ``layers`` (default: all) the attention weights and ``v_proj``'s
    output, and stops after the last of them. ``tokens``: ``[batch, pos]`` token ids, a mapping
    with ``input_ids``, or text(s) (tokenized as :func:`~tl_geometry.text_windows` does); the
    batch must be unpadded. The model's attention implementation is restored after the trace; a
    model in training mode is refused. Errors (``ImportError``, ``TypeError``,
    :class:`~tl_geometry.CacheError`) name the fix.

    >>> from nnsight import LanguageModel                                    # doctest: +SKIP
    >>> lm = LanguageModel(hf_model, tokenizer=tokenizer)                    # doctest: +SKIP
    >>> cache = from_nnsight(lm, "The cat sat on the mat.", layers=[3, 5])   # doctest: +SKIP
    >>> result = tl_geometry.analyze_heads(cache)                            # doctest: +SKIP
    """
    try:
        import nnsight
    except ImportError as err:
        raise ImportError("from_nnsight needs nnsight, an optional dependency: pip install nnsight") from err
    hf = _hf_model(model, nnsight)
    path, stack = _layer_stack(hf)
    wanted = sorted(range(len(stack)) if layers is None else check_layer_indices(layers, len(stack)))
    ids = _token_ids(model, hf, tokens, attention_mask)

    saved: dict[int, tuple[Any, Any]] = {}
    envoy_stack: Any = model
    for part in path.split("."):
        envoy_stack = getattr(envoy_stack, part)
    with attention_set_to(hf, "eager"), torch.no_grad(), model.trace(ids, use_cache=False) as tracer:
        for layer in wanted:  # in the order the forward reaches them
            attn = envoy_stack[layer].self_attn
            saved[layer] = (attn.v_proj.output, attn.output)
        tracer.stop()

    patterns, values = [], []
    for layer in wanted:
        v, out = saved[layer]
        weights = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if not isinstance(weights, Tensor):
            raise CacheError(f"{path}.{layer}.self_attn returned no attention weights with eager attention "
                             f"(it does not follow transformers' attention interface): {_OWN_TRACE}.")
        attention: Any = stack[layer].self_attn
        d_head: int = attention.head_dim  # an int: _check_attention saw to it
        if v.ndim != 3 or v.shape[-1] % d_head:
            raise CacheError(f"{path}.{layer}.self_attn.v_proj gave shape {tuple(v.shape)}, not [batch, pos, "
                             f"kv_head·{d_head}]: {_OWN_TRACE}.")
        patterns.append(weights)
        values.append(v.unflatten(-1, (-1, d_head)))
    return from_hf(patterns, values, layers=wanted, values_layout="tl")
