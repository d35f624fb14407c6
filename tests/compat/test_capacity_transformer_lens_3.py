"""Top-N attention (docs/capacity.md) on a TransformerLens 3.x ``HookedTransformer``.

Runs in the TransformerLens 3.9 environment (``bash scripts/compat.sh``); under TransformerLens
4.x the whole module is skipped (the 4.x bridge is covered by ``tests/capacity/test_capacity.py``).
SmolLM2 is grouped-query: 9 query heads read 3 KV heads, so head 4 reads KV head 1.
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

from tl_geometry.capacity import retrieval_capacity, sparsify_pattern, top_n_attention  # noqa: E402

pytestmark = pytest.mark.real_model
LAYER, N = 5, 3


@pytest.fixture
def small(tl3):
    return tl3.tokens[:1, :20]


def _layer(model, tokens, hooks, attention_mask=None):
    """The pattern of ``LAYER`` before the hooks, and the v and z the next module sees."""
    seen = {}
    name = f"blocks.{LAYER}.attn.hook_"

    def grab(key):
        return lambda x, hook: seen.setdefault(key, x.clone())

    fwd = [(name + "pattern", grab("pattern")), *hooks, (name + "v", grab("v")), (name + "z", grab("z"))]
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    model.run_with_hooks(tokens, fwd_hooks=fwd, return_type=None, **kwargs)
    return seen


@pytest.mark.parametrize("mode", ["renormalize", "delete"])
def test_hook_z_is_sparsified_pattern_times_v(tl3, small, mode):
    """What HookedTransformer computes after the hook is z = sparsify(pattern) · v, with query
    head h reading KV head h // 3; the loss changes; the hooks are gone afterwards."""
    model = tl3.model
    with torch.no_grad():
        seen = _layer(model, small, top_n_attention(model, N, mode, layers=[LAYER]))
        clean = _layer(model, small, [])
    expected = sparsify_pattern(seen["pattern"], N, mode)
    v = seen["v"]
    kv = torch.arange(model.cfg.n_heads) // (model.cfg.n_heads // v.shape[2])
    z = torch.einsum("bhqk,bkhe->bqhe", expected, v[:, :, kv])
    torch.testing.assert_close(seen["z"], z, rtol=1e-5, atol=1e-5)
    assert (seen["z"] - clean["z"]).abs().max() > 1e-3
    assert not any(hp.fwd_hooks for hp in model.hook_dict.values())


def test_left_padding_and_dense_limit(tl3, small):
    """Left padding: z at real positions is recomputed from the sparsified pattern; N ≥ T gives
    exactly the dense loss."""
    model = tl3.model
    tokens = torch.cat([small, small])
    mask = torch.ones_like(tokens)
    mask[0, :5] = 0
    with torch.no_grad():
        seen = _layer(model, tokens, top_n_attention(model, N, layers=[LAYER]), attention_mask=mask)
    real = mask.bool()
    expected = sparsify_pattern(seen["pattern"], N)
    v = seen["v"]
    kv = torch.arange(model.cfg.n_heads) // (model.cfg.n_heads // v.shape[2])
    z = torch.einsum("bhqk,bkhe->bqhe", expected, v[:, :, kv])
    torch.testing.assert_close(seen["z"][real], z[real], rtol=1e-5, atol=1e-5)
    cap = retrieval_capacity(model, small, (1, small.shape[1]))
    assert cap.loss[1].item() == cap.dense_loss and cap.loss[0].item() > cap.dense_loss
