"""A TransformerLens 3.x ``HookedTransformer`` of an HF Llama model, built offline.

``HookedTransformer.from_pretrained`` reads the model's config from the hub; here the config is
written by hand from the loaded HF model's own config (mirroring the ``LlamaForCausalLM`` branch
of TransformerLens 3.9's ``get_pretrained_model_config``) and the weights go through
TransformerLens's own Llama conversion, so nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import torch


def hooked_config(hf_config: Any, *, dtype: torch.dtype = torch.float32):
    """``HookedTransformerConfig`` of a Llama-architecture HF config (GQA kept as GQA)."""
    from transformer_lens import HookedTransformerConfig

    n_heads, n_kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    d_head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
    # transformers 5 moved rope_theta into rope_parameters.
    rope = getattr(hf_config, "rope_theta", None) or (hf_config.rope_parameters or {})["rope_theta"]
    return HookedTransformerConfig(
        d_model=hf_config.hidden_size,
        d_head=d_head,
        n_heads=n_heads,
        n_key_value_heads=n_kv if n_kv != n_heads else None,
        d_mlp=hf_config.intermediate_size,
        n_layers=hf_config.num_hidden_layers,
        n_ctx=hf_config.max_position_embeddings,
        eps=hf_config.rms_norm_eps,
        d_vocab=hf_config.vocab_size,
        act_fn=hf_config.hidden_act,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_adjacent_pairs=False,
        rotary_dim=d_head,
        rotary_base=rope,
        final_rms=True,
        gated_mlp=True,
        original_architecture="LlamaForCausalLM",
        tokenizer_name=None,
        dtype=dtype,
        device="cpu",
    )


def hooked_llama(hf_model: Any, tokenizer: Any, *, fold_value_biases: bool = True):
    """The HF Llama model as a ``HookedTransformer`` with ``from_pretrained``'s default processing.

    ``fold_ln``, ``center_writing_weights``, ``center_unembed`` and ``fold_value_biases`` are on,
    as ``from_pretrained`` sets them: what a TransformerLens 3.x user's cache comes from. None of
    them changes ``hook_pattern``; for Llama (no value biases) none changes ``hook_v`` either. The
    HF model is not modified (the converted weights are copied before processing).
    """
    from transformer_lens import HookedTransformer
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights

    cfg = hooked_config(hf_model.config)
    state = {k: v.detach().clone() for k, v in convert_llama_weights(hf_model, cfg).items()}
    model = HookedTransformer(cfg, tokenizer=tokenizer)
    model.load_and_process_state_dict(
        state, fold_ln=True, center_writing_weights=True, center_unembed=True,
        fold_value_biases=fold_value_biases,
    )
    return model.eval()
