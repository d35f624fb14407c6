"""tl_geometry on TransformerLens 3.x: a HookedTransformer cache analyses like a bridge cache.

Runs in the TransformerLens 3.9 environment (``bash scripts/compat.sh``); under TransformerLens
4.x the whole module is skipped. The 4.x side comes from the main environment (``tl4``).
"""

from __future__ import annotations

from importlib.metadata import version

import pytest

TL_VERSION = version("transformer-lens")
if int(TL_VERSION.split(".")[0]) >= 4:
    pytest.skip(
        f"TransformerLens {TL_VERSION}: the 3.x compatibility tests run in .venv-tl3 "
        "(bash scripts/compat.sh)",
        allow_module_level=True,
    )

import torch  # noqa: E402
from compat_inputs import ANALYSIS, N_SEQS, SEQ_LEN  # noqa: E402

import tl_geometry  # noqa: E402
from tl_geometry.ablation import ablate_heads, head_sensitivity  # noqa: E402

pytestmark = pytest.mark.real_model
# SmolLM2: 9 query heads read 3 KV heads, so heads 3, 4, 5 share KV head 1 (GQA).
LAYER, HEAD, SIBLINGS = 5, 4, (3, 5)


@pytest.fixture
def small(tl3):
    """A short batch for the ablation tests' many forwards."""
    return tl3.tokens[:1, :20]


def test_environment_is_transformer_lens_3():
    from transformer_lens import HookedTransformer

    assert TL_VERSION.startswith("3.")
    assert HookedTransformer is not None


def test_hooked_transformer_matches_hf(tl3):
    """Hand-made config + TransformerLens's Llama conversion reproduce the model."""
    assert tl3.model.cfg.n_key_value_heads == 3 and tl3.model.cfg.n_heads == 9
    # center_unembed shifts each position's logits by a constant: compare log-probabilities.
    torch.testing.assert_close(tl3.log_probs, tl3.hf_log_probs, rtol=0, atol=5e-4)


def test_hooked_cache_equals_bridge_cache(tl3, tl4):
    assert tl4.transformer_lens.startswith("4.")
    assert torch.equal(tl3.tokens, tl4.tokens) and tl3.tokens.shape == (N_SEQS, SEQ_LEN)
    torch.testing.assert_close(tl3.hf_log_probs, tl4.log_probs, rtol=0, atol=5e-4)
    for name, bridge in tl4.cache.items():
        hooked = tl3.cache[name]
        assert hooked.shape == bridge.shape, name  # hook_v keeps the 3 KV heads on both lines
        torch.testing.assert_close(hooked, bridge, rtol=1e-4, atol=1e-5, msg=name)


def test_analysis_equal_on_both_lines(tl3, tl4):
    """analyze_heads on the HookedTransformer cache = on the bridge cache, within float tolerance.

    The two forwards differ by ~1e-5 (float32, different kernels). Counts, votes and labels
    are exact; continuous fields agree to 1e-4. A precision/recall/inversion instance whose
    distances tie within 1e-5 may flip, which moves a mean by a step of 1/instances: at most
    a few such (layer, head, N) entries are allowed, and none of them by more than 0.05 in P, R, F.
    """
    ours = tl_geometry.analyze_heads(tl3.cache, **ANALYSIS)
    theirs = tl4.analysis
    assert ours.labels == theirs.labels
    assert torch.equal(ours.vote_counts, theirs.vote_counts)
    assert torch.equal(ours.group_counts, theirs.group_counts)
    torch.testing.assert_close(ours.sink, theirs.sink, rtol=1e-4, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(ours.margin, theirs.margin, rtol=1e-3, atol=1e-4, equal_nan=True)
    assert torch.equal(ours.scores.isnan(), theirs.scores.isnan())
    # The truncation figures of SPEC §10 (the last two metrics) are sums of α: they carry the
    # forwards' ~1e-5 everywhere, so they are held to 1e-3 instead of 1e-6.
    n_sep = ours.scores.shape[1] - 2
    a, b = ours.scores[:, :n_sep], theirs.scores[:, :n_sep]
    close = torch.isclose(a, b, rtol=1e-6, atol=1e-6) | a.isnan()
    assert close.float().mean() > 0.995, f"{(~close).sum()} of {close.numel()} entries differ"
    a, b = ours.scores[:, n_sep:], theirs.scores[:, n_sep:]
    close = torch.isclose(a, b, rtol=1e-3, atol=1e-3) | a.isnan()
    assert close.float().mean() > 0.99, f"{(~close).sum()} of {close.numel()} truncation entries differ"
    for metric in ("precision", "recall", "f_score"):
        for group in ("top", "random", "sink_removed"):
            diff = (ours.metric(metric, group) - theirs.metric(metric, group)).abs().nan_to_num(0)
            assert diff.max() < 0.05, (metric, group, diff.max())


def _z_with(model, tokens, hooks, layer):
    """``hook_z`` of ``layer`` as the next layer sees it, under ``hooks`` (captured after them)."""
    seen = {}

    def capture(z, hook):
        seen["z"] = z.detach().clone()

    name = f"blocks.{layer}.attn.hook_z"
    loss = model.run_with_hooks(tokens, fwd_hooks=[*hooks, (name, capture)], return_type="loss")
    return seen["z"], float(loss)


def test_ablate_heads_zero_on_hooked_transformer(tl3, small):
    """Only head (5, 4) of hook_z changes, not its GQA siblings; the loss changes; hooks go away."""
    model, tokens = tl3.model, small
    with torch.no_grad():
        clean_z, clean_loss = _z_with(model, tokens, [], LAYER)
        ablation = ablate_heads(model, [(LAYER, HEAD)])
        z, loss = _z_with(model, tokens, ablation, LAYER)
        assert torch.all(z[:, :, HEAD] == 0)
        others = [h for h in range(model.cfg.n_heads) if h != HEAD]
        assert torch.equal(z[:, :, others], clean_z[:, :, others])  # siblings 3 and 5 included
        assert abs(loss - clean_loss) > 1e-4
        with ablation:  # the context-manager form gives the same loss
            assert float(model(tokens, return_type="loss")) == pytest.approx(loss, abs=1e-6)
        assert float(model(tokens, return_type="loss")) == pytest.approx(clean_loss, abs=1e-6)
    assert not any(hp.fwd_hooks for hp in model.hook_dict.values())


def test_ablate_heads_mean_on_hooked_transformer(tl3, small):
    model, tokens = tl3.model, small
    with torch.no_grad():
        clean_z, _ = _z_with(model, tokens, [], LAYER)
        z, _ = _z_with(model, tokens, ablate_heads(model, [(LAYER, HEAD)], "mean", reference_tokens=tokens),
                       LAYER)
    mean = clean_z[:, :, HEAD].mean(dim=(0, 1))
    torch.testing.assert_close(z[:, :, HEAD], mean.expand_as(z[:, :, HEAD]), rtol=1e-4, atol=1e-5)
    assert torch.equal(z[:, :, list(SIBLINGS)], clean_z[:, :, list(SIBLINGS)])


def test_head_sensitivity_on_hooked_transformer(tl3, small):
    """The batched sweep (one replica per head) equals one ablated forward per head."""
    model, tokens = tl3.model, small
    heads = [(0, 0), (LAYER, HEAD), (29, 8)]
    with torch.no_grad():
        sens = head_sensitivity(model, tokens, heads=heads, progress=False)
        for layer, head in heads:
            want = float(model.run_with_hooks(tokens, fwd_hooks=ablate_heads(model, [(layer, head)]),
                                              return_type="loss"))
            assert float(sens.loss[layer, head]) == pytest.approx(want, abs=1e-4)
    assert sens.loss.isnan().sum() == model.cfg.n_layers * model.cfg.n_heads - len(heads)


def test_fold_value_biases_changes_hook_v():
    """The pitfall in docs/pitfalls.md: folding value biases moves b_V into b_O.

    Same function (logits equal), same pattern, but hook_v differs by b_V, so the geometry of
    v (and every metric built on it) changes. Checked on a tiny random model with value biases.
    """
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    torch.manual_seed(0)
    cfg = HookedTransformerConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, d_mlp=32, n_ctx=12,
                                  d_vocab=30, act_fn="gelu", normalization_type="LN", device="cpu")
    source = HookedTransformer(cfg)
    for name, param in source.named_parameters():  # random weights and biases, b_V included
        torch.nn.init.normal_(param, std=0.5 if name.endswith("b_V") else 0.2)
    state = source.state_dict()
    kept, folded = HookedTransformer(cfg), HookedTransformer(cfg)
    options = dict(fold_ln=False, center_writing_weights=False, center_unembed=False)
    kept.load_and_process_state_dict({k: v.clone() for k, v in state.items()}, fold_value_biases=False,
                                     **options)
    folded.load_and_process_state_dict({k: v.clone() for k, v in state.items()}, fold_value_biases=True,
                                       **options)
    tokens = torch.randint(0, 30, (2, 12))
    with torch.no_grad():
        logits_kept, cache_kept = kept.run_with_cache(tokens)
        logits_folded, cache_folded = folded.run_with_cache(tokens)
    torch.testing.assert_close(logits_kept, logits_folded, rtol=1e-4, atol=1e-4)
    pattern, v = "blocks.0.attn.hook_pattern", "blocks.0.attn.hook_v"
    torch.testing.assert_close(cache_kept[pattern], cache_folded[pattern])
    torch.testing.assert_close(cache_kept[v] - cache_folded[v], state["blocks.0.attn.b_V"].expand_as(cache_kept[v]))
    a = tl_geometry.analyze_heads(cache_kept, n_values=(2, 4), random_samples=2)
    b = tl_geometry.analyze_heads(cache_folded, n_values=(2, 4), random_samples=2)
    assert not torch.allclose(a.sink_norm_ratio, b.sink_norm_ratio)


def test_bridge_loader_works_on_transformer_lens_3(tl3, tl4):
    """tl_geometry's own loader (a TransformerBridge) also works on 3.9: the declared range.

    Last in the file: wrapping changes ``tl3.hf_model`` in place.
    """
    from tl_geometry.inputs.models import _bridge_from_hf

    bridge = _bridge_from_hf("smollm2-135m", tl3.hf_model, tl3.tokenizer, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(tl3.tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    torch.testing.assert_close(logits.log_softmax(-1), tl3.hf_log_probs, rtol=0, atol=5e-4)
    result = tl_geometry.analyze_heads(cache, **ANALYSIS)
    assert result.labels == tl4.analysis.labels
    torch.testing.assert_close(result.sink, tl4.analysis.sink, rtol=1e-4, atol=1e-5, equal_nan=True)
