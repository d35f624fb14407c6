"""Head ablation, sensitivity and sparsification (SPEC §7).

Fast tests use ``TinyLM``: a two-layer causal LM with grouped-query attention built on
TransformerLens' ``HookedRootModule``, so it has the same hook names as a real model
(``blocks.{l}.attn.hook_z`` / ``hook_pattern`` / ``hook_v``). Real-model tests use the session
fixtures and small inputs.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities.lm_utils import lm_cross_entropy_loss

import tl_geometry

try:  # TransformerLens 4.x moved it; 3.x has it in hook_points only
    from transformer_lens import HookedRootModule
except ImportError:
    from transformer_lens.hook_points import HookedRootModule

from tl_geometry.ablation import (
    Ordering,
    attention_entropy,
    critical_heads,
    heads_kept,
    random_order,
    taxonomy_order,
    weight_norm_order,
    weight_norms,
)

# --- a tiny hooked model ------------------------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv: int, d_head: int, gen: torch.Generator):
        super().__init__()
        self.W_Q = nn.Parameter(torch.randn(n_heads, d_model, d_head, generator=gen) / d_model**0.5)
        self.W_K = nn.Parameter(torch.randn(n_kv, d_model, d_head, generator=gen) / d_model**0.5)
        self.W_V = nn.Parameter(torch.randn(n_kv, d_model, d_head, generator=gen) / d_model**0.5)
        self.W_O = nn.Parameter(torch.randn(n_heads, d_head, d_model, generator=gen) / d_head**0.5)
        self.kv = torch.arange(n_heads) // (n_heads // n_kv)
        self.hook_v, self.hook_pattern, self.hook_z = HookPoint(), HookPoint(), HookPoint()

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        q = torch.einsum("bpd,hde->bphe", x, self.W_Q)
        k = torch.einsum("bpd,hde->bphe", x, self.W_K)[:, :, self.kv]
        v = self.hook_v(torch.einsum("bpd,hde->bphe", x, self.W_V))
        scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / q.shape[-1] ** 0.5
        n = x.shape[1]
        allowed = torch.ones(n, n, dtype=torch.bool).tril() & (valid[:, None, None, :] | torch.eye(n, dtype=torch.bool))
        pattern = self.hook_pattern(scores.masked_fill(~allowed, -torch.inf).softmax(-1))
        z = self.hook_z(torch.einsum("bhqk,bkhe->bqhe", pattern, v[:, :, self.kv]))
        return torch.einsum("bqhe,hed->bqd", z, self.W_O)


class _Block(nn.Module):
    def __init__(self, cfg: SimpleNamespace, gen: torch.Generator):
        super().__init__()
        self.attn = _Attention(cfg.d_model, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, gen)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_mlp), nn.GELU(), nn.Linear(cfg.d_mlp, cfg.d_model))


class TinyLM(HookedRootModule):
    """Causal LM, 3 layers × 4 query heads sharing 2 KV heads; TransformerLens forward signature."""

    def __init__(self, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.cfg = SimpleNamespace(n_layers=3, n_heads=4, n_key_value_heads=2, d_head=8, d_model=16,
                                   d_mlp=32, d_vocab=40, device="cpu")
        self.embed = nn.Parameter(torch.randn(self.cfg.d_vocab, self.cfg.d_model, generator=gen))
        self.blocks = nn.ModuleList(_Block(self.cfg, gen) for _ in range(self.cfg.n_layers))
        for block in self.blocks:  # deterministic MLP weights too
            for p in block.mlp.parameters():
                p.data = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
        self.unembed = nn.Parameter(torch.randn(self.cfg.d_model, self.cfg.d_vocab, generator=gen) / 4)
        self.setup()

    @property
    def W_V(self) -> torch.Tensor:
        return torch.stack([b.attn.W_V for b in self.blocks])

    @property
    def W_O(self) -> torch.Tensor:
        return torch.stack([b.attn.W_O for b in self.blocks])

    def forward(self, tokens, return_type="logits", loss_per_token=False, attention_mask=None):
        valid = torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        x = self.embed[tokens]
        for block in self.blocks:
            x = x + block.attn(nn.functional.layer_norm(x, x.shape[-1:]), valid)
            x = x + block.mlp(nn.functional.layer_norm(x, x.shape[-1:]))
        logits = x @ self.unembed
        if return_type is None:
            return None
        if return_type == "loss":
            return lm_cross_entropy_loss(logits, tokens, attention_mask, loss_per_token)
        return logits


@pytest.fixture(scope="module")
def tiny() -> TinyLM:
    return TinyLM().eval()


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(1))


def _z(model, tokens, layer, fwd_hooks=(), **kwargs):
    """hook_z of ``layer`` as the next module sees it (after the given hooks)."""
    seen = {}
    name = f"blocks.{layer}.attn.hook_z"
    capture = (name, lambda z, hook: seen.setdefault("z", z.clone()))
    with torch.no_grad(), model.hooks(fwd_hooks=[*fwd_hooks, capture]):
        model(tokens, **kwargs)
    return seen["z"]


def _loss(model, tokens, **kwargs):
    with torch.no_grad():
        return float(model(tokens, return_type="loss", **kwargs))


# --- ablate_heads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_ablation_changes_only_that_query_head(tiny, tokens, mode):
    ref = tokens if mode == "mean" else None
    ablation = tl_geometry.ablation.ablate_heads(tiny, [(1, 2)], mode, reference_tokens=ref)
    before, after = _z(tiny, tokens, 1), _z(tiny, tokens, 1, ablation)
    others = [0, 1, 3]  # head 3 shares head 2's KV head
    assert torch.equal(after[:, :, others], before[:, :, others])
    expected = torch.zeros(8) if mode == "zero" else before[:, :, 2].mean(dim=(0, 1))
    torch.testing.assert_close(after[:, :, 2], expected.expand_as(after[:, :, 2]), rtol=0, atol=1e-6)
    assert not torch.equal(_z(tiny, tokens, 2, ablation), _z(tiny, tokens, 2))  # the effect propagates


def test_ablation_is_a_hook_list_and_a_context_manager(tiny, tokens):
    ablation = tl_geometry.ablation.ablate_heads(tiny, [(0, 1), (2, 3), (0, 0)])
    assert [name for name, _ in ablation] == ["blocks.0.attn.hook_z", "blocks.2.attn.hook_z"]  # one per layer
    assert ablation.heads == [(0, 0), (0, 1), (2, 3)]
    base = _loss(tiny, tokens)
    with torch.no_grad():
        hooked = float(tiny.run_with_hooks(tokens, fwd_hooks=ablation, return_type="loss"))
    with ablation:
        inside = _loss(tiny, tokens)
    assert inside == hooked != base
    assert all(not hp._forward_hooks for hp in tiny.hook_dict.values())  # hooks gone after exit
    assert _loss(tiny, tokens) == base
    with pytest.raises(RuntimeError), ablation:  # removed on error too
        raise RuntimeError
    assert all(not hp._forward_hooks for hp in tiny.hook_dict.values())


def test_mean_ablation_with_padding_uses_valid_positions_only(tiny, tokens):
    mask = torch.ones_like(tokens)
    mask[0, 8:] = 0  # right padding
    mask[1, :3] = 0  # left padding
    valid = mask.bool()
    ablation = tl_geometry.ablation.ablate_heads(tiny, [(2, 0)], "mean", reference_tokens=tokens,
                                        reference_attention_mask=mask)
    before = _z(tiny, tokens, 2, attention_mask=mask)
    after = _z(tiny, tokens, 2, ablation, attention_mask=mask)
    torch.testing.assert_close(after[valid][:, 0].mean(0), before[valid][:, 0].mean(0), rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, :, 0].mean(dim=(0, 1)), before[valid][:, 0].mean(0), atol=1e-3)


def test_callers_tensors_are_not_mutated(tiny, tokens):
    kept = {}
    name = "blocks.1.attn.hook_z"
    tokens_copy = tokens.clone()
    mask = torch.ones_like(tokens)
    # The caller's hook runs before the ablation and keeps the activation itself, no clone.
    ablation = tl_geometry.ablation.ablate_heads(tiny, [(1, 0), (1, 3)], "mean", reference_tokens=tokens,
                                        reference_attention_mask=mask)
    with torch.no_grad(), tiny.hooks(fwd_hooks=[(name, lambda z, hook: kept.setdefault("z", z))]), ablation:
        tiny(tokens, attention_mask=mask)
    assert kept["z"][:, :, 0].abs().sum() > 0 and torch.equal(kept["z"], _z(tiny, tokens, 1))
    assert torch.equal(tokens, tokens_copy) and mask.all()
    head_list = [(1, 0)]
    tl_geometry.ablation.head_sensitivity(tiny, tokens, heads=head_list, progress=False)
    assert head_list == [(1, 0)]


@pytest.mark.parametrize(
    ("heads", "match"),
    [
        ([(3, 0)], "layer 3 is out of range; the model has 3 layers"),
        ([(0, 4)], "head 4 is out of range"),
        ([(0, 1), (0, 1)], "listed twice"),
        ([(0, 1.0)], "not a \\(layer, head\\) pair"),
        ([0, 1], "not a \\(layer, head\\) pair"),
        ("0.1", "must be \\(layer, head\\) pairs"),
        (torch.zeros(2, 4, dtype=torch.bool), "must be \\[n_layers, n_heads\\]"),
    ],
)
def test_bad_heads(tiny, heads, match):
    with pytest.raises(ValueError, match=match):
        tl_geometry.ablation.ablate_heads(tiny, heads)


def test_bad_mode_reference_and_model(tiny, tokens):
    with pytest.raises(ValueError, match=r"mode must be one of"):
        tl_geometry.ablation.ablate_heads(tiny, [(0, 0)], "resample")
    with pytest.raises(ValueError, match="needs reference_tokens"):
        tl_geometry.ablation.ablate_heads(tiny, [(0, 0)], "mean")
    with pytest.raises(ValueError, match="only used with mode=\"mean\""):
        tl_geometry.ablation.ablate_heads(tiny, [(0, 0)], reference_tokens=tokens)
    with pytest.raises(ValueError, match="reference_tokens must be \\[batch, pos\\] integer"):
        tl_geometry.ablation.ablate_heads(tiny, [(0, 0)], "mean", reference_tokens=tokens.float())
    with pytest.raises(ValueError, match=r"model\.cfg must give n_layers"):
        tl_geometry.ablation.ablate_heads(object(), [(0, 0)])
    no_hooks = SimpleNamespace(cfg=tiny.cfg)
    with pytest.raises(ValueError, match=r"no hooks\(fwd_hooks=\.\.\.\)"):
        tl_geometry.ablation.ablate_heads(no_hooks, [(0, 0)])
    renamed = SimpleNamespace(cfg=tiny.cfg, hooks=tiny.hooks,
                              hook_dict={k: v for k, v in tiny.hook_dict.items() if "hook_z" not in k})
    with pytest.raises(ValueError, match=r"exposes no blocks\.1\.attn\.hook_z"):
        tl_geometry.ablation.ablate_heads(renamed, [(1, 0)])


# --- head_sensitivity and critical_heads ------------------------------------------------------


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_batched_sensitivity_equals_one_head_at_a_time(tiny, tokens, mode):
    mask = torch.ones_like(tokens)
    mask[2, :4] = 0
    heads = [(0, 1), (1, 2), (1, 3), (2, 0), (2, 3)]
    sens = tl_geometry.ablation.head_sensitivity(tiny, tokens, mode, attention_mask=mask, heads=heads,
                                        batch_heads=2, progress=False)
    ref = tokens if mode == "mean" else None
    for layer, head in heads:  # the obviously correct reference: one forward per head
        with tl_geometry.ablation.ablate_heads(tiny, [(layer, head)], mode, reference_tokens=ref,
                                      reference_attention_mask=mask if ref is not None else None):
            expected = _loss(tiny, tokens, attention_mask=mask)
        assert sens.loss[layer, head].item() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert sens.loss.isnan().sum() == 12 - len(heads)
    assert sens.base_loss == _loss(tiny, tokens, attention_mask=mask)  # the model's own loss
    assert sens.metadata["forwards"] == 3


def test_sensitivity_table(tiny, tokens):
    sens = tl_geometry.ablation.head_sensitivity(tiny, tokens, progress=False)
    table = sens.to_pandas()
    assert list(table.columns) == ["layer", "head", "loss", "loss_increase", "loss_increase_se", "ci_low",
                                   "ci_high", "critical", "criticality", "outlier"]
    assert len(table) == 12 and not table["loss"].isna().any()
    torch.testing.assert_close(torch.tensor(table["loss_increase"].values).reshape(3, 4),
                               sens.loss - sens.base_loss)
    assert sens.top(3)["loss_increase"].is_monotonic_decreasing
    assert tl_geometry.ablation.head_sensitivity(tiny, tokens, batch_heads=12, progress=False).loss.allclose(sens.loss)


def _fake_sensitivity(increase, window_spread, base_loss=3.0, n_windows=4):
    """A HeadSensitivity whose head ``(l, h)`` raises the loss of every window by ``increase[l, h]``
    give or take ``window_spread[l, h]`` (alternating signs: the mean change is ``increase``)."""
    increase = torch.as_tensor(increase, dtype=torch.float64)
    spread = torch.as_tensor(window_spread, dtype=torch.float64)
    signs = torch.tensor([(-1.0) ** b for b in range(n_windows)], dtype=torch.float64)
    base_windows = torch.full((n_windows,), base_loss, dtype=torch.float64)
    window_loss = base_windows + increase[..., None] + spread[..., None] * signs
    return tl_geometry.ablation.HeadSensitivity(base_loss, base_loss + increase, "zero", {}, window_loss,
                                       base_windows, torch.full((n_windows,), 10.0))


def test_critical_rule_reads_the_whole_interval():
    # dense loss 3 → threshold max(0.1, 0.15) = 0.15 nats.
    increase = [[0.20, 0.20, 0.14, 0.01], [1.00, -0.5, 0.16, float("nan")]]
    spread = [[0.01, 0.50, 0.00, 0.00], [0.01, 0.01, 0.01, 0.00]]
    sens = _fake_sensitivity(increase, spread)
    # sd of (±spread) over 4 windows = spread·sqrt(4/3); SE = sd / 2; t(0.975, 3) = 3.182.
    se = torch.tensor(spread, dtype=torch.float64) * (4 / 3) ** 0.5 / 2
    torch.testing.assert_close(sens.loss_increase_se[:, :3], se[:, :3])
    # SPEC §7: critical where the interval's lower end reaches 0.15 ((0, 0): 0.2 − 3.182 · 0.0058
    # = 0.18; (1, 0)), largest first. (0, 1) is large but its interval reaches below 0, and (1, 2)
    # is above 0.15 but its lower end, 0.142, is not: undecided. (0, 2), (0, 3), (1, 1): the
    # whole interval below 0.15, not critical; (1, 3): not scored.
    assert critical_heads(sens) == [(1, 0), (0, 0)]
    assert sens.criticality() == [["critical", "undecided", "not critical", "not critical"],
                                  ["critical", "not critical", "undecided", "not scored"]]
    low, high = sens.interval()
    assert low[1, 2] < 0.15 < increase[1][2] < high[1, 2]
    assert sens.to_pandas()["criticality"].tolist() == [c for row in sens.criticality() for c in row]
    # The MAD flag is reported, not the criterion: an outlier of the sweep that is small in nats
    # is not critical.
    flat = _fake_sensitivity([[0.010, 0.011, 0.012, 0.09]], [[0.001] * 4])
    assert flat.outliers() == [(0, 3)] and flat.critical() == []
    table = flat.to_pandas()
    assert table["outlier"].tolist() == [False, False, False, True] and not table["critical"].any()
    # A larger dense loss raises the threshold: 5 % of 4.4 is 0.22.
    assert critical_heads(_fake_sensitivity(increase, spread, base_loss=4.4)) == [(1, 0)]
    assert critical_heads(sens, min_nats=0.5) == [(1, 0)]
    with pytest.raises(ValueError, match="min_nats must be a number"):
        critical_heads(sens, min_nats=-1)
    with pytest.raises(ValueError, match="level must be in"):
        critical_heads(sens, level=95)
    with pytest.raises(ValueError, match="takes a HeadSensitivity"):
        critical_heads(torch.zeros(3, 4))
    from tl_geometry.ablation import mad_outliers

    x = torch.tensor([[0.01, 0.02, 0.015, 0.012], [0.011, 2.0, 0.013, 0.5], [float("nan"), 0.014, -3.0, 0.016]])
    assert mad_outliers(x) == [(1, 1), (1, 3)] and mad_outliers(x, k=1e6) == []
    with pytest.raises(ValueError, match="k must be a number"):
        mad_outliers(x, k=-1)


def test_no_window_spread_without_windows():
    one = _fake_sensitivity([[1.0, 2.0]], [[0.0, 0.0]], n_windows=1)
    assert one.loss_increase_se.isnan().all() and one.critical() == []  # no SE: nothing is critical
    bare = tl_geometry.ablation.HeadSensitivity(3.0, torch.tensor([[4.0, 5.0]], dtype=torch.float64))
    assert bare.loss_increase_se.isnan().all() and bare.critical() == [] and bare.n_windows == 0


def test_sensitivity_standard_errors_match_per_window_references(tiny, tokens):
    """Each window's loss from the batched sweep equals an ablated forward on that window alone,
    and the SE is the sample sd of the paired per-window changes over sqrt(n) (equal windows)."""
    heads = [(0, 1), (2, 3)]
    sens = tl_geometry.ablation.head_sensitivity(tiny, tokens, heads=heads, batch_heads=2, progress=False)
    n = tokens.shape[0]
    dense = torch.tensor([_loss(tiny, tokens[b: b + 1]) for b in range(n)], dtype=torch.float64)
    torch.testing.assert_close(sens.base_window_loss, dense, rtol=1e-6, atol=1e-7)
    for layer, head in heads:
        with tl_geometry.ablation.ablate_heads(tiny, [(layer, head)]):
            ablated = torch.tensor([_loss(tiny, tokens[b: b + 1]) for b in range(n)], dtype=torch.float64)
        torch.testing.assert_close(sens.window_loss[layer, head], ablated, rtol=1e-6, atol=1e-7)
        d = ablated - dense
        assert sens.loss_increase[layer, head].item() == pytest.approx(d.mean().item(), abs=1e-6)
        assert sens.loss_increase_se[layer, head].item() == pytest.approx(d.std().item() / n ** 0.5, rel=1e-4)
    assert sens.loss_increase_se.isnan().sum() == 12 - len(heads)


def test_padded_windows_weight_the_standard_error(tiny, tokens):
    from tl_geometry.functional.uncertainty import paired_window_se

    mask = torch.ones_like(tokens)
    mask[0, 6:] = 0  # window 0 has 5 predictions, the others 11
    sens = tl_geometry.ablation.head_sensitivity(tiny, tokens, attention_mask=mask, heads=[(1, 2)], progress=False)
    assert sens.window_weight.tolist() == [5.0, 11.0, 11.0]
    d = sens.window_loss[1, 2] - sens.base_window_loss
    w = sens.window_weight
    assert sens.loss_increase[1, 2].item() == pytest.approx(((w * d).sum() / w.sum()).item(), abs=1e-6)
    mean = (w * d).sum() / w.sum()
    expected = (3 / 2 * (w**2 * (d - mean) ** 2).sum()).sqrt() / w.sum()
    assert sens.loss_increase_se[1, 2].item() == pytest.approx(expected.item(), rel=1e-9)
    assert paired_window_se(torch.tensor([1.0, 5.0]), torch.tensor([0.0, 3.0])).isnan()  # one used window


def test_one_window_warns(tiny, tokens):
    with pytest.warns(UserWarning, match="no standard error"):
        sens = tl_geometry.ablation.head_sensitivity(tiny, tokens[:1], heads=[(0, 0)], progress=False)
    assert sens.critical() == []


def test_sensitivity_bad_input(tiny, tokens):
    with pytest.raises(ValueError, match="batch_heads must be a positive int"):
        tl_geometry.ablation.head_sensitivity(tiny, tokens, batch_heads=0, progress=False)
    with pytest.raises(ValueError, match="tokens must be \\[batch, pos\\] integer"):
        tl_geometry.ablation.head_sensitivity(tiny, tokens[0], progress=False)
    with pytest.raises(ValueError, match=r"mode must be one of"):
        tl_geometry.ablation.head_sensitivity(tiny, tokens, "max", progress=False)
    with pytest.raises(ValueError, match="heads is empty"):
        tl_geometry.ablation.head_sensitivity(tiny, tokens, heads=[], progress=False)
    with pytest.raises(ValueError, match='only used with mode="mean"'):  # not silently ignored
        tl_geometry.ablation.head_sensitivity(tiny, tokens, reference_tokens=tokens, progress=False)
    with pytest.raises(ValueError, match="without reference_tokens"):
        tl_geometry.ablation.sparsification_curve(tiny, tokens, random_order(3, 4, 0), mode="mean",
                                         reference_attention_mask=torch.ones_like(tokens), progress=False)
    lonely = torch.zeros_like(tokens)
    lonely[:, 0] = 1  # one real token per sequence: no next-token prediction to score
    with pytest.raises(ValueError, match="no next-token prediction"):
        tl_geometry.ablation.head_sensitivity(tiny, tokens, attention_mask=lonely, progress=False)
    with pytest.raises(ValueError, match="attention_mask has shape"):  # before any forward
        tl_geometry.ablation.head_sensitivity(tiny, tokens, attention_mask=lonely[:, 1:], progress=False)


# --- a set of heads against random sets ----------------------------------------------------------


def test_random_head_sets_keep_the_size_and_the_layers():
    from tl_geometry.ablation import random_head_sets

    chosen = torch.zeros(3, 4, dtype=torch.bool)
    chosen[0, 1] = chosen[2, 0] = chosen[2, 3] = True
    anywhere = random_head_sets(chosen, 200, seed=1)
    assert anywhere.shape == (200, 3, 4) and (anywhere.sum(dim=(1, 2)) == 3).all()
    assert not (anywhere.sum(-1) == chosen.sum(-1)).all(-1).all()  # not tied to the layers
    assert anywhere.double().mean(0).min() > 0.1  # every head gets drawn (expected 0.25)
    same = random_head_sets(chosen, 200, same_layers=True, seed=1)
    assert (same.sum(-1) == chosen.sum(-1)).all()  # per layer: 1, 0, 2 heads
    assert torch.equal(same, random_head_sets(chosen, 200, same_layers=True, seed=1))  # seeded
    assert not torch.equal(same, random_head_sets(chosen, 200, same_layers=True, seed=2))


def test_p_value_and_z_arithmetic():
    from tl_geometry.ablation import AblationVsRandom
    from tl_geometry.functional.uncertainty import empirical_p, null_z

    null = torch.tensor([0.1, 0.6, 0.5, 0.2])
    assert empirical_p(0.5, null) == pytest.approx(3 / 5)  # 0.6 and 0.5 are ≥ 0.5, plus the set itself
    assert empirical_p(0.7, null) == pytest.approx(1 / 5)  # never 0
    mean, sd, z = null_z(0.9, null)
    assert mean == pytest.approx(0.35) and sd == pytest.approx(null.double().std().item())
    assert z == pytest.approx((0.9 - 0.35) / sd)
    assert math.isnan(null_z(1.0, torch.tensor([0.2]))[2]) and math.isnan(null_z(1.0, torch.ones(3))[2])
    cmp = AblationVsRandom([(0, 1)], 2.0, 2.9, 0.05, torch.zeros(4, 2, 3, dtype=torch.bool),
                           2.0 + null.double(), torch.full((4,), 0.01, dtype=torch.float64))
    assert cmp.loss_increase == pytest.approx(0.9) and cmp.p_value == pytest.approx(0.2)
    assert cmp.random_mean == pytest.approx(0.35) and cmp.z == pytest.approx(z)
    table = cmp.to_pandas()
    assert table["set"].tolist() == ["chosen"] + ["random"] * 4 and table["sample"].isna().tolist()[0]


def test_ablation_vs_random_matches_one_ablation_per_set(tiny, tokens):
    cmp = tl_geometry.ablation.ablation_vs_random(tiny, tokens, [(0, 1), (2, 2)], n_random=5, seed=7, batch_size=2,
                                         progress=False)
    base = _loss(tiny, tokens)
    assert cmp.base_loss == base and cmp.n_random == 5 and cmp.metadata["n_windows"] == 3
    with tl_geometry.ablation.ablate_heads(tiny, [(0, 1), (2, 2)]):
        assert cmp.loss == pytest.approx(_loss(tiny, tokens), rel=1e-6)
    for r in (0, 4):  # the reference: one ablated forward per random set
        with tl_geometry.ablation.ablate_heads(tiny, cmp.random_sets[r]):
            assert cmp.random_loss[r].item() == pytest.approx(_loss(tiny, tokens), rel=1e-6)
    assert cmp.p_value == (1 + int((cmp.random_increase >= cmp.loss_increase).sum())) / 6
    assert math.isfinite(cmp.loss_increase_se) and cmp.loss_increase_se > 0
    again = tl_geometry.ablation.ablation_vs_random(tiny, tokens, [(0, 1), (2, 2)], n_random=5, seed=7, progress=False)
    assert torch.equal(again.random_sets, cmp.random_sets)
    assert torch.allclose(again.random_loss, cmp.random_loss, rtol=1e-6)
    with pytest.raises(ValueError, match="heads is empty"):
        tl_geometry.ablation.ablation_vs_random(tiny, tokens, [], progress=False)
    with pytest.raises(ValueError, match="n_random must be a positive int"):
        tl_geometry.ablation.ablation_vs_random(tiny, tokens, [(0, 0)], n_random=0, progress=False)
    with pytest.raises(ValueError, match="out of range"):
        tl_geometry.ablation.ablation_vs_random(tiny, tokens, [(5, 0)], progress=False)


# --- orderings and sparsification ---------------------------------------------------------------


def test_weight_norm_order_uses_the_kv_head(tiny):
    norms = weight_norms(tiny)
    for layer, head in [(0, 0), (1, 3), (2, 2)]:
        attn = tiny.blocks[layer].attn
        expected = attn.W_V[head // 2].norm() * attn.W_O[head].norm()
        assert norms[layer, head].item() == pytest.approx(expected.item(), rel=1e-6)
    order = weight_norm_order(tiny).heads
    values = [norms[layer, head].item() for layer, head in order]
    assert values == sorted(values) and len(set(order)) == 12


def test_entropy_matches_cached_patterns(tiny, tokens):
    entropy = attention_entropy(tiny, tokens)
    with torch.no_grad():
        _, cache = tiny.run_with_cache(tokens)
    for layer in range(3):
        p = cache[f"blocks.{layer}.attn.hook_pattern"].double()[:, :, 1:]  # queries t ≥ 1
        expected = -(p * p.clamp_min(1e-300).log()).sum(-1).mean(dim=(0, 2))
        torch.testing.assert_close(entropy[layer], expected)
    order = tl_geometry.ablation.head_orderings(tiny, tokens, which=["entropy"], progress=False)[0]
    assert entropy[order.heads[0]] == entropy.max() and entropy[order.heads[-1]] == entropy.min()


def test_taxonomy_order_groups_classes_then_f_gain(tiny, tokens):
    analysis = tl_geometry.analyze_model(tiny, tokens, n_values=(2,), random_samples=4)
    order = taxonomy_order(analysis)
    rank = {"Mixer": 0, "Reset": 1, "Retriever": 2}
    keys = [(rank[analysis.labels[l][h]], torch.nan_to_num(analysis.f_gain[l, h, 0], nan=math.inf).item())
            for l, h in order.heads]
    assert keys == sorted(keys) and len(set(order.heads)) == 12
    with pytest.raises(ValueError, match="has no N=4"):
        taxonomy_order(analysis, n=4)


def test_head_orderings_all(tiny, tokens):
    orders = tl_geometry.ablation.head_orderings(tiny, tokens, seeds=(0, 1, 2), progress=False)
    assert [o.name for o in orders] == ["taxonomy", "weight_norm", "entropy", "random", "random", "random", "oracle"]
    assert [o.seed for o in orders if o.name == "random"] == [0, 1, 2]
    assert random_order(3, 4, 1) == orders[4] and random_order(3, 4, 1) != random_order(3, 4, 2)
    oracle = orders[-1]
    sens = tl_geometry.ablation.head_sensitivity(tiny, tokens, progress=False)
    increases = [sens.loss_increase[l, h].item() for l, h in oracle.heads]
    assert increases == sorted(increases)
    with pytest.raises(ValueError, match="Unknown ordering"):
        tl_geometry.ablation.head_orderings(tiny, tokens, which=["magnitude"])


def test_sparsification_curve(tiny, tokens):
    orders = [random_order(3, 4, s) for s in (0, 1)] + [weight_norm_order(tiny)]
    curve = tl_geometry.ablation.sparsification_curve(tiny, tokens, orders, (1.0, 0.75, 0.5, 0.0),
                                             batch_size=3, progress=False)
    table = curve.to_pandas()
    assert list(table.columns) == ["ordering", "seed", "retention", "n_removed", "loss", "perplexity",
                                   "loss_increase", "loss_increase_se"]
    assert table["n_removed"].tolist() == [0, 3, 6, 12] * 3
    assert table["seed"].isna().tolist() == [False] * 8 + [True] * 4
    base = _loss(tiny, tokens)
    assert (table.loc[table["retention"] == 1.0, "loss"] == base).all()  # exactly the model's loss
    assert table["perplexity"].tolist() == [math.exp(x) for x in table["loss"]]
    for _, row in table[table["n_removed"] > 0].iterrows():  # batched == one ablation at a time
        order = next(o for o in orders if o.name == row["ordering"] and (o.seed == row["seed"] or o.seed is None))
        with tl_geometry.ablation.ablate_heads(tiny, list(order.heads[: row["n_removed"]])):
            assert row["loss"] == pytest.approx(_loss(tiny, tokens), rel=1e-6)
    summary = curve.summary()
    assert list(summary.index) == ["random", "weight_norm"] and "±" in summary.loc["random", 0.5]
    # Each loss change carries its SE over the 3 windows: the sd of the paired per-window changes / √3.
    n = tokens.shape[0]
    dense = torch.tensor([_loss(tiny, tokens[b: b + 1]) for b in range(n)], dtype=torch.float64)
    assert (table.loc[table["n_removed"] == 0, "loss_increase_se"] == 0).all()
    for i, row in table[table["n_removed"] > 0].head(2).iterrows():
        order = next(o for o in orders if o.name == row["ordering"] and (o.seed == row["seed"] or o.seed is None))
        with tl_geometry.ablation.ablate_heads(tiny, list(order.heads[: row["n_removed"]])):
            ablated = torch.tensor([_loss(tiny, tokens[b: b + 1]) for b in range(n)], dtype=torch.float64)
        torch.testing.assert_close(curve.window_loss[i], ablated, rtol=1e-6, atol=1e-7)
        d = ablated - dense
        assert row["loss_increase"] == pytest.approx(row["loss"] - base)
        assert row["loss_increase_se"] == pytest.approx(d.std().item() / n ** 0.5, rel=1e-4)
    assert heads_kept(0.75, 270) == 203 and heads_kept(0.25, 270) == 68 and heads_kept(0.5, 3) == 2


def test_sparsification_accepts_dicts_and_checks_orders(tiny, tokens):
    full = [(l, h) for l in range(3) for h in range(4)]
    curve = tl_geometry.ablation.sparsification_curve(tiny, tokens, {"layer-major": full}, (0.5,), mode="mean",
                                             progress=False)
    with tl_geometry.ablation.ablate_heads(tiny, full[:6], "mean", reference_tokens=tokens):
        assert curve.rows[0]["loss"] == pytest.approx(_loss(tiny, tokens), rel=1e-6)
    with pytest.raises(ValueError, match="lists 11 heads; a removal order must list all 3 × 4 = 12"):
        tl_geometry.ablation.sparsification_curve(tiny, tokens, full[:-1], progress=False)
    with pytest.raises(ValueError, match="listed twice"):
        tl_geometry.ablation.sparsification_curve(tiny, tokens, [*full[:-1], (0, 0)], progress=False)
    with pytest.raises(ValueError, match="retention must be fractions"):
        tl_geometry.ablation.sparsification_curve(tiny, tokens, full, (1.5,), progress=False)
    with pytest.raises(ValueError, match="order must be an Ordering"):
        tl_geometry.ablation.sparsification_curve(tiny, tokens, 7, progress=False)
    assert isinstance(Ordering("x", tuple(full)), tuple)


def test_plots(tiny, tokens):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sens = tl_geometry.ablation.head_sensitivity(tiny, tokens, progress=False)
    curve = tl_geometry.ablation.sparsification_curve(tiny, tokens, [random_order(3, 4, s) for s in (0, 1)],
                                             (1.0, 0.5), progress=False)
    for figure in (sens.plot(), curve.plot()):
        assert figure.axes and figure.axes[0].get_xlabel()
        plt.close(figure)


# --- real models --------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_ablation_changes_only_that_query_head(real):
    """GQA (SmolLM2: heads 3, 4, 5 share KV head 1) and MQA (Gemma-3: one KV head for all)."""
    model, tokens, cache = real.model, real.tokens, real.cache
    layer, head = 2, 4 if real.name.startswith("smollm2") else 1
    n_heads = model.cfg.n_heads
    names = [f"blocks.{layer}.attn.hook_z", f"blocks.{layer + 1}.attn.hook_z"]
    with torch.no_grad(), tl_geometry.ablation.ablate_heads(model, [(layer, head)]):
        _, ablated = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    z, z_ablated = cache[names[0]], ablated[names[0]]
    others = [h for h in range(n_heads) if h != head]
    torch.testing.assert_close(z_ablated[:, :, others], z[:, :, others], rtol=0, atol=1e-6)
    assert z_ablated[:, :, head].abs().max() == 0 and z[:, :, head].abs().max() > 0
    assert not torch.allclose(ablated[names[1]], cache[names[1]], atol=1e-4)  # later layers see it


@pytest.mark.real_model
def test_real_retention_one_exact_hooks_gone_mean_kept(smollm2):
    model, tokens = smollm2.model, smollm2.tokens
    with torch.no_grad():
        base = float(model(tokens, return_type="loss"))
    order = random_order(model.cfg.n_layers, model.cfg.n_heads, 0)
    curve = tl_geometry.ablation.sparsification_curve(model, tokens, order, (1.0,), progress=False)
    assert curve.rows[0]["loss"] == base and curve.rows[0]["n_removed"] == 0

    layer, head = 5, 3
    ablation = tl_geometry.ablation.ablate_heads(model, [(layer, head)], "mean", reference_tokens=tokens)
    with ablation:
        z = _z(model, tokens, layer)
    original = smollm2.cache[f"blocks.{layer}.attn.hook_z"][:, :, head]
    torch.testing.assert_close(z[:, :, head].mean(dim=(0, 1)), original.mean(dim=(0, 1)), rtol=0, atol=1e-5)
    assert not any(hp._forward_hooks for hp in model.hook_dict.values())
    with torch.no_grad():
        assert float(model(tokens, return_type="loss")) == base


@pytest.mark.real_model
def test_real_oracle_beats_random_at_three_quarters(smollm2):
    """SmolLM2 on real text (built-in sample, 2 × 32 tokens), zero ablation, seeds 0-2: the
    sensitivity oracle, scored on the same tokens the curve is measured on (an oracle sees the
    evaluation text), removes a quarter of the heads at no more loss than the mean of three
    random orders. (Scored on *other* windows this short, it does not: see docs/ablation.md.)"""
    model = smollm2.model
    tokens = tl_geometry.text_windows(model, n_seqs=2, seq_len=32)
    sens = tl_geometry.ablation.head_sensitivity(model, tokens, progress=False)
    orders = tl_geometry.ablation.head_orderings(model, tokens, which=["random", "oracle"], seeds=(0, 1, 2),
                                        sensitivity=sens, progress=False)
    curve = tl_geometry.ablation.sparsification_curve(model, tokens, orders, (0.75,), progress=False)
    table = curve.to_pandas().set_index("ordering")
    oracle, random_mean = table.loc["oracle", "loss"], table.loc["random", "loss"].mean()
    assert oracle <= random_mean, (oracle, random_mean)
    assert sens.outliers()  # a few heads stand out on real text (the MAD flag)
    # Two windows give an SE (t = 12.7 at 95 %): a critical head's whole interval is large.
    assert sens.loss_increase_se.isfinite().all()
    low, _ = sens.interval()
    threshold = max(0.1, 0.05 * sens.base_loss)
    assert all(low[l, h] >= threshold for l, h in sens.critical())


@pytest.mark.real_model
def test_real_ablation_vs_random_same_layers(smollm2):
    """SmolLM2, 3 × 40 tokens: two layer-1 heads against 4 random pairs of layer-1 heads."""
    model, tokens = smollm2.model, smollm2.tokens
    heads = [(1, 5), (1, 4)]
    cmp = tl_geometry.ablation.ablation_vs_random(model, tokens, heads, n_random=4, same_layers=True, seed=3,
                                         progress=False)
    assert cmp.heads == [(1, 4), (1, 5)] and cmp.random_sets.shape == (4, 30, 9)
    assert (cmp.random_sets.sum(-1)[:, 1] == 2).all() and cmp.random_sets.sum() == 8  # layer 1 only
    with torch.no_grad():
        base = float(model(tokens, return_type="loss"))
        with tl_geometry.ablation.ablate_heads(model, heads):
            ablated = float(model(tokens, return_type="loss"))
    assert cmp.base_loss == base and cmp.loss_increase == pytest.approx(ablated - base, abs=1e-4)
    assert math.isfinite(cmp.loss_increase_se) and cmp.random_increase_se.isfinite().all()
    assert cmp.p_value == (1 + int((cmp.random_increase >= cmp.loss_increase).sum())) / 5
    assert "random sets of 2 heads from the same layers" in cmp.summary()
