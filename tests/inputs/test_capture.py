"""Capturing q/k/v from an SDPA forward (``inputs.capture``) and recomputing the pattern.

Real models: rows recomputed from the captured q and k match the bridge's ``hook_pattern``
(eager attention, float32) to 1e-5, Gemma-3's sliding window included, and the captured v is
``hook_v``. Tiny random models (no weights to load) check the architectures the real ones do
not have: logit softcapping (Gemma-2) and attention sinks (GPT-OSS), against the eager
attention weights of the same model, and that the model is left as it was.
"""

from __future__ import annotations

import pytest
import torch

import tl_geometry
from tl_geometry.functional import attention_row_blocks, attention_rows
from tl_geometry.inputs.capture import capture_all, capture_attention

TOLERANCE = 1e-5


def _all_queries(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)


def _state(hf_model) -> tuple:
    """What capturing must leave unchanged: the module tree and every attention setting."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    modules = tuple((name, id(m)) for name, m in hf_model.named_modules())
    configs = tuple(getattr(m, "config", None) for m in hf_model.modules())
    implementations = tuple(getattr(c, "_attn_implementation", None) for c in configs)
    return (modules, implementations, tuple(AttentionInterface._global_mapping),
            tuple(AttentionMaskInterface._global_mapping))


def _max_row_error(captures, cache) -> float:
    worst = 0.0
    for c in captures:
        tokens_like = c.q[..., 0, 0]
        rows = attention_rows(c.q, c.k, _all_queries(tokens_like), **c.params.row_kwargs())
        pattern = cache[f"blocks.{c.layer}.attn.hook_pattern"]
        worst = max(worst, (rows - pattern.double()).abs().max().item())
    return worst


@pytest.mark.real_model
def test_captured_rows_match_hook_pattern_and_v_matches_hook_v(real):
    before = _state(real.model.original_model)
    captures = capture_all(real.model, real.tokens)
    assert _state(real.model.original_model) == before
    config = real.model.original_model.config
    assert [c.layer for c in captures] == list(range(config.num_hidden_layers))
    assert _max_row_error(captures, real.cache) < TOLERANCE
    for c in captures:
        assert c.q.shape[2] == config.num_attention_heads and c.k.shape == c.v.shape
        assert (c.params.n_heads, c.params.n_kv_heads) == (c.q.shape[2], c.k.shape[2])
        hook_v = real.cache[f"blocks.{c.layer}.attn.hook_v"]
        # Layer 0 reads the embeddings: bit for bit. Later layers read a residual that SDPA
        # and the bridge's eager attention rounded differently.
        if c.layer == 0:
            assert torch.equal(c.v, hook_v)
        torch.testing.assert_close(c.v, hook_v, rtol=1e-4, atol=1e-4 * hook_v.abs().max().item())


@pytest.mark.real_model
def test_scale_of_each_architecture(real):
    config = real.model.original_model.config
    captures = capture_all(real.model, real.tokens[:1, :8])
    expected = (config.query_pre_attn_scalar ** -0.5 if real.name == "gemma3-270m"
                else config.head_dim ** -0.5)
    assert {c.params.scale for c in captures} == {expected}
    assert {(c.params.softcap, c.params.sinks) for c in captures} == {(None, None)}


@pytest.mark.real_model
def test_gemma3_beyond_its_sliding_window(gemma3):
    """600 tokens: the local layers' 512-key window cuts the rows of the last 88 queries."""
    model = gemma3.model
    config = model.original_model.config
    tokens = tl_geometry.text_windows(model.tokenizer, n_seqs=1, seq_len=600)
    local = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
    layers = [0, local[-1] + 1, local[-1]]  # a local layer, a global one, the last local one
    assert config.sliding_window == 512 and config.layer_types[layers[1]] == "full_attention"
    names = {f"blocks.{i}.attn.hook_pattern" for i in layers}
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    seen: dict[int, float] = {}

    def on_layer(c):
        assert c.params.window == (512 if c.layer in local else None)
        if c.layer not in layers:
            return
        pattern = cache[f"blocks.{c.layer}.attn.hook_pattern"].double()
        worst = 0.0
        for start, rows in attention_row_blocks(c.q, c.k, block=128, **c.params.row_kwargs()):
            worst = max(worst, (rows - pattern[:, :, start:start + 128]).abs().max().item())
        seen[c.layer] = worst
        if c.params.window is not None:  # the window matters: without it, the rows differ
            kwargs = {**c.params.row_kwargs(), "window": None}
            unwindowed = attention_rows(c.q, c.k, torch.tensor([[599]]), **kwargs)
            assert (unwindowed[..., 0, :] - pattern[:, :, 599]).abs().max() > 1e-3

    capture_attention(model, tokens, on_layer)
    assert set(seen) == set(layers) and max(seen.values()) < TOLERANCE, seen


@pytest.mark.real_model
def test_the_model_is_restored_when_the_callback_raises(smollm2):
    hf_model = smollm2.model.original_model
    before = _state(hf_model)

    def fail(c):
        raise RuntimeError("analysis failed")

    with pytest.raises(RuntimeError, match="analysis failed"):
        capture_attention(smollm2.model, smollm2.tokens[:1, :6], fail)
    assert _state(hf_model) == before
    with torch.no_grad():  # and the bridge still computes what it did
        logits = smollm2.model(smollm2.tokens)
    torch.testing.assert_close(logits, smollm2.hf_logits, rtol=1e-4, atol=1e-4)


# --- tiny random models: softcapping and sinks --------------------------------------------------

def _tiny(kind: str):
    """A two-layer random model with eager attention, one local and one global layer."""
    transformers = pytest.importorskip("transformers")
    common = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]}
    if kind == "gemma2":
        config = transformers.Gemma2Config(**common, attn_logit_softcapping=0.5,
                                           query_pre_attn_scalar=16, final_logit_softcapping=None)
        model_class = transformers.Gemma2ForCausalLM
    elif kind == "gpt_oss":
        config = transformers.GptOssConfig(**common, num_local_experts=2, num_experts_per_tok=1)
        model_class = transformers.GptOssForCausalLM
    else:
        config = transformers.LlamaConfig(**{k: v for k, v in common.items()
                                             if k not in ("sliding_window", "layer_types")})
        model_class = transformers.LlamaForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_class(config).eval()
    if kind == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 2)
    return model


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_oss"])
def test_tiny_models_match_their_eager_attention_weights(kind):
    model = _tiny(kind)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    before = _state(model)
    captures = capture_all(model, tokens)
    assert _state(model) == before
    with torch.no_grad():
        eager = model(tokens, output_attentions=True).attentions
    for c in captures:
        rows = attention_rows(c.q, c.k, _all_queries(tokens), **c.params.row_kwargs())
        torch.testing.assert_close(rows, eager[c.layer].double(), rtol=0, atol=1e-6)
        assert c.params.window == (3 if c.layer == 0 and kind != "llama" else None)
        assert (c.params.softcap == 0.5) == (kind == "gemma2")
        assert (c.params.sinks is not None) == (kind == "gpt_oss")
    if kind == "gemma2":
        assert captures[0].params.scale == 16 ** -0.5


def test_padding_mask_is_passed_to_the_model_and_to_the_rows():
    model = _tiny("llama")
    tokens = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    captures = capture_all(model, tokens, attention_mask=mask)
    with torch.no_grad():
        eager = model(tokens, attention_mask=mask, output_attentions=True).attentions
    queries = torch.tensor([[3, 4, 5, 6]] * 2)  # real tokens in both sequences
    for c in captures:
        rows = attention_rows(c.q, c.k, queries, key_mask=mask.bool(), **c.params.row_kwargs())
        torch.testing.assert_close(rows, eager[c.layer][:, :, 3:].double(), rtol=0, atol=1e-6)
        assert (rows[1, :, :, :3] == 0).all()


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("padded", [False, True])
def test_a_sliding_window_layer_runs_by_query_blocks_without_a_sequence_mask(kind, padded, monkeypatch):
    """Without padding, the sliding-window layer gets no [query, key] mask and runs in blocks of
    ``window`` queries against the keys each block sees (softcap and sinks included); with
    padding, SDPA's own mask. The model's output is its eager forward's either way."""
    from tl_geometry.inputs import capture

    model = _tiny(kind)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.long)
    if padded:
        mask[1, :2] = 0
    blocked = []
    by_blocks = capture._by_query_blocks
    monkeypatch.setattr(capture, "_by_query_blocks", lambda *a, **k: (blocked.append(a[5]), by_blocks(*a, **k))[1])
    final = []
    hook = model.model.norm.register_forward_hook(lambda module, inputs, out: final.append(out))
    try:
        capture_attention(model, tokens, lambda c: None, attention_mask=mask)
    finally:
        hook.remove()
    with torch.no_grad():
        want = model.model(tokens, attention_mask=mask).last_hidden_state
    assert blocked == ([] if padded else [3])
    real = mask.bool()
    torch.testing.assert_close(final[0][real], want[real], rtol=1e-5, atol=1e-5)
