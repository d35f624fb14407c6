"""``tl_geometry.inputs.from_nnsight`` (run in a process of its own by test_nnsight_input.py: importing
nnsight patches ``object``): one nnsight trace gives the dict that analyze_heads reads.

On the real SmolLM2 (9 query heads sharing 3 KV heads) it gives the TransformerLens bridge's
hook_pattern / hook_v and the same analysis; on tiny random Qwen2 (grouped-query attention, value
biases) and Gemma-3 (q/k norms, sliding windows) models it gives a plain Hugging Face forward's
tensors; the caller's model keeps its attention implementation; and each refusal names the fix.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

# Before nnsight: importing it adds a `save` method to `object`, after which beartype (the run-time
# shape checks of this test session) can no longer be imported.
import beartype  # noqa: F401
import pytest
import torch
from shared_checks import assert_same_analysis, own_model_snippet

import tl_geometry
from tl_geometry import CacheError
from tl_geometry.inputs import from_hf, from_nnsight

nnsight = pytest.importorskip("nnsight")

DOCS = Path(__file__).resolve().parent.parent / "docs"
QUIET = {"n_values": (2, 4), "random_samples": 2}


def _language_model(hf, tokenizer):
    """``nnsight.LanguageModel`` (deprecated in favour of ``TransformersModel`` by nnsight 0.8)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return nnsight.LanguageModel(hf, tokenizer=tokenizer)


def _implementations(hf) -> list:
    return [config._attn_implementation_internal
            for config in {id(m.config): m.config for m in hf.modules() if hasattr(m, "config")}.values()]


# --- the real SmolLM2 -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_nnsight():
    """SmolLM2 as a plain transformers model (the session bridge replaces its attention modules),
    switched to SDPA so that from_nnsight has to switch it to eager and back."""
    from tl_geometry.inputs.models import load_hf_model

    hf, tokenizer = load_hf_model("smollm2-135m")
    hf.set_attn_implementation("sdpa")
    return _language_model(hf, tokenizer)


@pytest.mark.real_model
def test_smollm2_gives_the_bridge_cache_and_its_analysis(smol_nnsight, smollm2):
    ids = smollm2.tokens[:2, :24]
    cache = from_nnsight(smol_nnsight, ids)
    assert smol_nnsight.attn_implementation == "sdpa"  # restored
    with torch.no_grad():
        _, bridge = smollm2.model.run_with_cache(ids, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    assert sorted(cache) == sorted(bridge.keys()) and len(cache) == 2 * 30
    assert cache["blocks.0.attn.hook_v"].shape == (2, 24, 3, 64)  # 3 KV heads for 9 query heads
    for name, tensor in cache.items():
        # Two forwards computed apart (eager HF attention and the bridge's) agree to round-off;
        # a head out of place would be off by O(1).
        torch.testing.assert_close(tensor, bridge[name], rtol=1e-4, atol=1e-5, msg=name)
        assert not tensor.requires_grad
    layers = [0, 14, 29]
    ours = tl_geometry.analyze_heads(from_nnsight(smol_nnsight, ids, layers=layers), **QUIET)
    theirs = tl_geometry.analyze_heads(bridge, layers=layers, **QUIET)
    assert ours.layers == tuple(layers)
    assert_same_analysis(ours, theirs, tol=1e-5)
    assert ours.labels == theirs.labels


@pytest.mark.real_model
def test_smollm2_text_starts_with_bos_as_text_windows_does(smol_nnsight):
    tokenizer = smol_nnsight.tokenizer
    text = "The cat sat on the mat."
    ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
    from_text = from_nnsight(smol_nnsight, [text, text], layers=[1])
    from_ids = from_nnsight(smol_nnsight, {"input_ids": torch.tensor([ids, ids])}, layers=[1])
    assert from_text.keys() == from_ids.keys() == {"blocks.1.attn.hook_pattern", "blocks.1.attn.hook_v"}
    for name in from_text:
        assert torch.equal(from_text[name], from_ids[name])


@pytest.mark.real_model
@pytest.mark.filterwarnings("ignore:N = .* cannot be evaluated:UserWarning")  # the snippet's default N
def test_the_docs_snippet_runs(smol_nnsight, smollm2):
    namespace = {"hf": smol_nnsight._module, "tokenizer": smol_nnsight.tokenizer, "tokens": smollm2.tokens[:1, :16]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        exec(own_model_snippet("An nnsight model"), namespace)
    assert namespace["result"].layers == (3, 5)
    assert smol_nnsight.attn_implementation == "sdpa"


# --- tiny random models ---------------------------------------------------------------------------
def _tokenizer():
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(tokenizer_models.WordLevel({f"t{i}": i for i in range(63)} | {"<unk>": 63}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>")
    tokenizer.tl_geometry_bos = False  # trained without BOS: text is read as it is
    return tokenizer


def _tiny(kind: str):
    """3 layers, 4 query heads sharing 2 KV heads; SDPA attention, as transformers loads by default."""
    import transformers

    common = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    torch.manual_seed(0)
    if kind == "qwen2":  # value biases
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    if kind == "gemma3":  # q/k norms, a 4-token sliding window on two layers
        config = transformers.Gemma3TextConfig(**common, sliding_window=4, query_pre_attn_scalar=8,
                                               layer_types=["sliding_attention"] * 2 + ["full_attention"])
        return transformers.Gemma3ForCausalLM(config).eval()
    if kind == "gemma3-multimodal":  # the layers at model.language_model.layers, beside a vision tower
        vision = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "image_size": 16, "patch_size": 8}
        config = transformers.Gemma3Config(text_config={**common, "query_pre_attn_scalar": 8},
                                           vision_config=vision, mm_tokens_per_image=1, image_token_index=63,
                                           boi_token_index=61, eoi_token_index=62)
        return transformers.Gemma3ForConditionalGeneration(config).eval()
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2,
                                                                    n_head=4)).eval()
    raise AssertionError(kind)


IDS = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))  # no image token


def _plain_forward(hf, ids):
    """output_attentions with eager attention, and v_proj's output from forward hooks."""
    values: dict = {}
    layers = getattr(hf.model, "language_model", hf.model).layers
    handles = [block.self_attn.v_proj.register_forward_hook(
        lambda module, inputs, output, layer=layer: values.__setitem__(layer, output))
        for layer, block in enumerate(layers)]
    before = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = hf(ids, output_attentions=True, use_cache=False)
    finally:
        hf.set_attn_implementation(before)
        for handle in handles:
            handle.remove()
    d_head = layers[0].self_attn.head_dim
    return from_hf(out.attentions, [values[layer].unflatten(-1, (-1, d_head)) for layer in range(len(layers))],
                   values_layout="tl")


@pytest.mark.parametrize("kind", ["qwen2", "gemma3", "gemma3-multimodal"])
def test_tiny_models_give_the_plain_forwards_tensors(kind):
    hf = _tiny(kind)
    lm = nnsight.TransformersModel(hf, tokenizer=_tokenizer())
    before = _implementations(hf)
    assert "sdpa" in before and "eager" not in before
    cache = from_nnsight(lm, IDS)
    assert _implementations(hf) == before
    want = _plain_forward(hf, IDS)
    assert cache.keys() == want.keys()
    for name, tensor in cache.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-6, atol=1e-7, msg=name)
    assert cache["blocks.0.attn.hook_pattern"].shape == (2, 4, 9, 9)
    assert cache["blocks.0.attn.hook_v"].shape == (2, 9, 2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weak sinks and short windows of random weights
        assert_same_analysis(tl_geometry.analyze_heads(cache, **QUIET), tl_geometry.analyze_heads(want, **QUIET))
    if kind == "gemma3":  # the sliding window shows in the pattern: query 8 sees keys 5..8
        assert (cache["blocks.0.attn.hook_pattern"][:, :, 8, :5] == 0).all()


def test_only_the_layers_asked_for_are_kept_and_the_rest_never_runs():
    hf = _tiny("qwen2")
    lm = nnsight.TransformersModel(hf, tokenizer=_tokenizer())
    ran = []
    handle = hf.model.layers[2].register_forward_hook(lambda *args: ran.append(2))
    try:
        cache = from_nnsight(lm, IDS, layers=[1, 0])
    finally:
        handle.remove()
    assert sorted(cache) == ["blocks.0.attn.hook_pattern", "blocks.0.attn.hook_v",
                             "blocks.1.attn.hook_pattern", "blocks.1.attn.hook_v"]
    assert ran == []  # the trace stops after layer 1's attention


def test_an_undispatched_model_is_loaded_and_keeps_its_attention(tmp_path):
    hf, tokenizer = _tiny("qwen2"), _tokenizer()
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    lm = nnsight.TransformersModel(str(tmp_path), task="text-generation", tokenizer=tokenizer)
    assert not lm.dispatched
    cache = from_nnsight(lm, "t1 t2 t3 t4")  # the tiny tokenizer has no BOS
    assert lm.dispatched and lm.attn_implementation == "sdpa"
    assert cache["blocks.2.attn.hook_v"].shape == (1, 4, 2, 8)


def test_an_error_in_the_forward_restores_the_attention_implementation():
    hf = _tiny("qwen2")
    lm = nnsight.TransformersModel(hf, tokenizer=_tokenizer())
    handle = hf.model.layers[0].register_forward_hook(lambda *args: 1 / 0)
    try:
        with pytest.raises(ZeroDivisionError):
            from_nnsight(lm, IDS)
    finally:
        handle.remove()
    assert hf.config._attn_implementation == "sdpa"


# --- refusals -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_lm():
    return nnsight.TransformersModel(_tiny("qwen2"), tokenizer=_tokenizer())


@pytest.mark.parametrize("tokens, kwargs, match", [
    pytest.param(IDS, {"attention_mask": torch.tensor([[0] + [1] * 8, [1] * 9])},
                 r"attention_mask pads sequence\(s\) \[0\].*unpadded.*analyze_heads\(cache, attention_mask=mask\)",
                 id="padded-mask"),
    pytest.param({"input_ids": IDS, "attention_mask": torch.ones(2, 9).tril()}, {},
                 r"attention_mask pads sequence\(s\) \[0, 1\]", id="padded-encoding"),
    pytest.param(["t1 t2", "t1 t2 t3"], {}, r"texts have 2 to 3 tokens.*padded.*one text at a time", id="texts"),
    pytest.param(IDS, {"attention_mask": torch.ones(2, 8)}, r"attention_mask has shape \[2, 8\]; expected \[2, 9\]",
                 id="mask-shape"),
    pytest.param(IDS[0], {}, r"\[batch, pos\] integer token ids.*shape \[9\].*tokens\[None\]", id="1-d"),
    pytest.param(IDS.float(), {}, r"integer token ids, got dtype torch.float32.*tokens.long\(\)", id="float"),
    pytest.param(IDS + 64, {}, r"token ids from \d+ to \d+, outside the model.s vocabulary \[0, 64\)", id="vocabulary"),
    pytest.param([1, 2, 3], {}, r"text, a list of texts or a \[batch, pos\] tensor.*got list", id="int-list"),
    pytest.param({"ids": IDS}, {}, r"mapping without input_ids", id="no-input-ids"),
    pytest.param(IDS, {"layers": [3]}, r"indices below 3", id="layer-range"),
    pytest.param(IDS, {"layers": 1}, r"layers must be a list", id="layer-int"),
])
def test_bad_inputs_are_refused_with_the_fix(tiny_lm, tokens, kwargs, match):
    with pytest.raises(CacheError, match=match):
        from_nnsight(tiny_lm, tokens, **kwargs)
    assert tiny_lm.attn_implementation == "sdpa"


def test_a_model_that_is_not_an_nnsight_one_is_refused(smollm2):
    hf = _tiny("qwen2")
    with pytest.raises(TypeError, match=r"takes an nnsight LanguageModel, got Qwen2ForCausalLM.*"
                                         r"LanguageModel\(hf_model, tokenizer=tokenizer\).*from_hf"):
        from_nnsight(hf, IDS)
    with pytest.raises(TypeError, match=r"got TransformerBridge.*run_with_cache"):
        from_nnsight(smollm2.model, IDS)


def test_other_structures_are_refused():
    gpt2 = nnsight.TransformersModel(_tiny("gpt2"), tokenizer=_tokenizer())
    with pytest.raises(CacheError, match=r"Llama/SmolLM2-, Qwen2- and Gemma-3-style.*GPT2LMHeadModel has no "
                                         r"such layers.*from_hf"):
        from_nnsight(gpt2, IDS)


def test_a_value_norm_or_missing_weights_or_training_mode_is_refused():
    hf = _tiny("qwen2")
    hf.model.layers[1].self_attn.v_norm = torch.nn.Identity()  # as Gemma-3n normalises v after v_proj
    with pytest.raises(CacheError, match=r"model.layers.1.self_attn \(Qwen2Attention\) has v_norm, which may "
                                         r"change the values after v_proj"):
        from_nnsight(nnsight.TransformersModel(hf, tokenizer=_tokenizer()), IDS)

    hf = _tiny("qwen2")
    attention = type(hf.model.layers[1].self_attn)

    class NoWeights(attention):  # an attention module that never hands its weights out
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)[0], None

    hf.model.layers[1].self_attn.__class__ = NoWeights
    lm = nnsight.TransformersModel(hf, tokenizer=_tokenizer())
    with pytest.raises(CacheError, match=r"model.layers.1.self_attn returned no attention weights"):
        from_nnsight(lm, IDS)
    assert hf.config._attn_implementation == "sdpa"

    hf.train()
    with pytest.raises(CacheError, match=r"training mode.*model.eval\(\)"):
        from_nnsight(lm, IDS)


def test_without_nnsight_the_error_names_pip_install(monkeypatch, tiny_lm):
    monkeypatch.setitem(sys.modules, "nnsight", None)
    with pytest.raises(ImportError, match=r"pip install nnsight"):
        from_nnsight(tiny_lm, IDS)
