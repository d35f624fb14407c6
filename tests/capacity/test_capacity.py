"""Top-N attention sparsification and retrieval capacity (docs/capacity.md).

Fast tests use ``TinyLM`` from ``test_ablation`` (real TransformerLens hook points; causal
attention with padding), rebuilt with 1 (MQA), 2 (GQA) or 4 (MHA) KV heads. The intervention is
checked against an independent loop that sparsifies each row from the definition and recomputes
``z = pattern · v`` with the KV head ``h // (n_heads // n_kv)``. Real-model tests use the
session fixtures (SmolLM2: GQA, Gemma-3: MQA).
"""

from __future__ import annotations

import math

import jaxtyping
import pytest
import torch
from matplotlib.figure import Figure
from repo_paths import REPO
from test_ablation import TinyLM, _Block
from torch import nn

import tl_geometry
from tl_geometry.capacity import (
    RetrievalCapacity,
    capacity_correlation,
    capacity_sweep,
    head_geometry,
    retrieval_capacity,
    sparsify_pattern,
    spearman,
    top_n_attention,
)

MODES = ("renormalize", "delete")


def tiny_lm(n_kv: int, seed: int = 0) -> TinyLM:
    """TinyLM (3 layers × 4 query heads) with ``n_kv`` KV heads."""
    model = TinyLM(seed)
    model.cfg.n_key_value_heads = n_kv
    gen = torch.Generator().manual_seed(seed + 100)
    model.blocks = nn.ModuleList(_Block(model.cfg, gen) for _ in range(model.cfg.n_layers))
    model.setup()
    return model.eval()


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["mqa", "gqa", "mha"])
def tiny(request) -> TinyLM:
    return tiny_lm(request.param)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(1))


def _padding(kind: str | None, batch: int = 3, n_pos: int = 12) -> torch.Tensor | None:
    if kind is None:
        return None
    mask = torch.ones(batch, n_pos, dtype=torch.long)
    if kind == "left":
        mask[0, :4] = 0
        mask[2, :1] = 0
    else:
        mask[0, -4:] = 0
        mask[1, -2:] = 0
    return mask


def _reference_rows(pattern: torch.Tensor, n: int, mode: str, valid: torch.Tensor) -> torch.Tensor:
    """Sparsify every row from the definition, by loops: among the valid keys (causal, not
    padding) keep the n largest, ties to the lower index; renormalise or not; rows with ≤ n
    valid keys unchanged."""
    out = pattern.clone()
    batch, n_heads, n_query, _ = pattern.shape
    for b in range(batch):
        for h in range(n_heads):
            for t in range(n_query):
                keys = [i for i in range(t + 1) if valid[b, i]]
                if len(keys) <= n:
                    continue
                row = pattern[b, h, t]
                kept = sorted(keys, key=lambda i: (-float(row[i]), i))[:n]
                new = torch.zeros_like(row)
                new[kept] = row[kept]
                if mode == "renormalize":
                    new = new / new[kept].sum()
                out[b, h, t] = new
    return out


def _captured(model, tokens, layer, fwd_hooks=(), **kwargs) -> dict[str, torch.Tensor]:
    """The pattern of ``layer`` before any hook, and the v and z the next module sees."""
    seen: dict[str, torch.Tensor] = {}

    def grab(key):
        return lambda x, hook: seen.setdefault(key, x.clone())

    name = f"blocks.{layer}.attn.hook_"
    fwd = [(name + "pattern", grab("pattern")), *fwd_hooks,
           (name + "v", grab("v")), (name + "z", grab("z")), (name + "pattern", grab("used"))]
    with torch.no_grad(), model.hooks(fwd_hooks=fwd):
        model(tokens, **kwargs)
    return seen


# --- the intervention -----------------------------------------------------------------------------


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize("mode", MODES)
def test_intervention_equals_manual_recomputation(tiny, tokens, mode, padding):
    mask = _padding(padding)
    kwargs = {} if mask is None else {"attention_mask": mask}
    valid = torch.ones(tokens.shape, dtype=torch.bool) if mask is None else mask.bool()
    n_heads, n_kv = tiny.cfg.n_heads, tiny.cfg.n_key_value_heads
    kv = torch.arange(n_heads) // (n_heads // n_kv)
    for n in (1, 3):
        sparsified = top_n_attention(tiny, n, mode)
        for layer in range(tiny.cfg.n_layers):
            seen = _captured(tiny, tokens, layer, sparsified, **kwargs)
            expected = _reference_rows(seen["pattern"], n, mode, valid)
            # Real query rows only: a padding query's row is whatever the model makes of it.
            rows = valid[:, None, :].expand(-1, n_heads, -1)
            # float32: the kept mass may be summed in another order than the reference (1 ulp).
            torch.testing.assert_close(seen["used"][rows], expected[rows], rtol=0, atol=1e-6)
            z = torch.einsum("bhqk,bkhe->bqhe", seen["used"], seen["v"][:, :, kv])
            torch.testing.assert_close(seen["z"], z, rtol=0, atol=1e-6)
            assert not torch.allclose(seen["used"], seen["pattern"])  # it did act


def test_scope_changes_only_listed_heads(tokens):
    model = tiny_lm(2)
    seen = [_captured(model, tokens, layer, top_n_attention(model, 2, heads=[(1, 2)])) for layer in range(3)]
    assert torch.equal(seen[0]["used"], seen[0]["pattern"])
    others = [0, 1, 3]
    assert torch.equal(seen[1]["used"][:, others], seen[1]["pattern"][:, others])  # head 3 shares KV
    assert not torch.equal(seen[1]["used"][:, 2], seen[1]["pattern"][:, 2])
    layer_scope = _captured(model, tokens, 1, top_n_attention(model, 2, layers=[1]))
    assert not torch.equal(layer_scope["used"][:, 0], layer_scope["pattern"][:, 0])


def test_n_at_least_seq_len_is_exactly_dense(tiny, tokens):
    n_pos = tokens.shape[1]
    with torch.no_grad():
        dense = float(tiny(tokens, return_type="loss"))
        for mode in MODES:
            with top_n_attention(tiny, n_pos, mode):
                assert float(tiny(tokens, return_type="loss")) == dense
    cap = retrieval_capacity(tiny, tokens, (n_pos, n_pos + 5, 2))
    assert cap.loss[0] == cap.loss[1] == dense == cap.dense_loss
    assert cap.loss[2] != dense and cap.metadata["forwards"] == 1


def test_hooks_removed_after_an_exception(tokens):
    model = tiny_lm(2)
    with pytest.raises(RuntimeError, match="boom"), top_n_attention(model, 2):
        assert any(hp._forward_hooks for hp in model.hook_dict.values())
        raise RuntimeError("boom")
    assert not any(hp._forward_hooks for hp in model.hook_dict.values())
    model.run_with_hooks(tokens, fwd_hooks=top_n_attention(model, 2), return_type="loss")
    assert not any(hp._forward_hooks for hp in model.hook_dict.values())


def test_sparsify_pattern_keeps_input_and_breaks_ties_low():
    pattern = torch.tensor([[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.25, 0.25, 0.5]]])
    before = pattern.clone()
    out = sparsify_pattern(pattern, 1, "delete")
    assert torch.equal(pattern, before)
    assert out.tolist() == [[[1.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.5]]]
    two = sparsify_pattern(pattern, 2)
    assert two[0, :2].tolist() == pattern[0, :2].tolist() and two[0, 2].tolist() == pytest.approx([1 / 3, 0.0, 2 / 3])


def test_bad_input(tokens, monkeypatch):
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)  # the errors users get
    model = tiny_lm(2)
    for n, match in ((0, "≥ 1"), (-3, "≥ 1"), (2.5, "int ≥ 1"), (True, "int ≥ 1")):
        with pytest.raises(ValueError, match=match):
            top_n_attention(model, n)
    with pytest.raises(ValueError, match="mode must be one of"):
        top_n_attention(model, 2, "softmax")
    with pytest.raises(ValueError, match="head 4 is out of range"):
        top_n_attention(model, 2, heads=[(0, 4)])
    with pytest.raises(ValueError, match="layer 3 is out of range"):
        top_n_attention(model, 2, heads=[(3, 0)])
    with pytest.raises(ValueError, match="not a layer of the model"):
        top_n_attention(model, 2, layers=[5])
    with pytest.raises(ValueError, match="not both"):
        top_n_attention(model, 2, layers=[0], heads=[(0, 1)])
    with pytest.raises(ValueError, match="empty"):
        top_n_attention(model, 2, heads=[])
    with pytest.raises(ValueError, match="n_values is empty"):
        retrieval_capacity(model, tokens, ())
    with pytest.raises(ValueError, match=r"n_values\[1\] must be ≥ 1"):
        retrieval_capacity(model, tokens, (2, 0))
    with pytest.raises(ValueError, match="twice"):
        retrieval_capacity(model, tokens, (2, 2))
    with pytest.raises(ValueError, match="tolerance"):
        retrieval_capacity(model, tokens, (2,), tolerance=-0.1)
    with pytest.raises(ValueError, match="mode must be one of"):
        retrieval_capacity(model, tokens, (2,), mode="drop")
    with pytest.raises(ValueError, match="tokens must be"):
        retrieval_capacity(model, tokens.float(), (2,))
    with pytest.raises(ValueError, match="by must be"):
        capacity_sweep(model, tokens, (2,), by="neuron")
    with pytest.raises(ValueError, match=r"model\.cfg must give"):
        top_n_attention(torch.nn.Linear(2, 2), 2)
    hookless = torch.nn.Linear(2, 2)
    hookless.cfg = model.cfg  # type: ignore[assignment]
    with pytest.raises(ValueError, match="no hooks"):
        top_n_attention(hookless, 2)


# --- losses ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_retrieval_capacity_batched_equals_one_at_a_time(tiny, tokens, mode):
    mask = _padding("right")
    cap = retrieval_capacity(tiny, tokens, (1, 2, 4), mode=mode, attention_mask=mask, batch_size=2)
    for n, loss in zip(cap.n_values, cap.loss.tolist()):
        with torch.no_grad(), top_n_attention(tiny, n, mode):
            one = float(tiny(tokens, return_type="loss", attention_mask=mask))
        assert loss == pytest.approx(one, abs=1e-5)
    assert cap.metadata["forwards"] == 2
    table = cap.to_pandas()
    assert list(table["n"]) == [1, 2, 4] and (table["mode"] == mode).all()


def test_n_star_rule():
    cap = RetrievalCapacity((1, 2, 4, 8), torch.tensor([3.0, 2.2, 2.09, 2.0], dtype=torch.float64), 2.0,
                            tolerance=0.05)
    assert cap.n_star == 4  # 2.09 is 4.5 % above 2.0; 2.2 is 10 %
    assert torch.allclose(cap.relative_increase, torch.tensor([0.5, 0.1, 0.045, 0.0], dtype=torch.float64))
    assert RetrievalCapacity((1, 2), torch.tensor([3.0, 2.5]), 2.0).n_star is None
    assert isinstance(cap.plot(), Figure)


def test_head_and_layer_sweeps(tokens):
    model = tiny_lm(2)
    sweep = capacity_sweep(model, tokens, (1, 2), by="head", batch_size=5)
    assert sweep.loss.shape == (2, 3, 4) and not sweep.loss.isnan().any()
    assert sweep.metadata["forwards"] == math.ceil(24 / 5)
    for i, n in enumerate((1, 2)):
        for layer, head in ((0, 1), (2, 3)):
            with torch.no_grad(), top_n_attention(model, n, heads=[(layer, head)]):
                one = float(model(tokens, return_type="loss"))
            assert sweep.loss[i, layer, head].item() == pytest.approx(one, abs=1e-5)
    layers = capacity_sweep(model, tokens, (2,), by="layer", layers=[1])
    assert layers.loss.shape == (1, 3) and layers.loss[0, [0, 2]].isnan().all()
    with torch.no_grad(), top_n_attention(model, 2, layers=[1]):
        assert layers.loss[0, 1].item() == pytest.approx(float(model(tokens, return_type="loss")), abs=1e-5)
    table = sweep.to_pandas()
    assert len(table) == 24 and set(table.columns) >= {"n", "layer", "head", "loss_increase"}
    assert isinstance(sweep.plot(2), Figure) and isinstance(layers.plot(), Figure)


def test_correlation_geometry_matches_analyze_heads(tokens):
    model = tiny_lm(2)
    geometry = head_geometry(model, tokens, 2)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    analysis = tl_geometry.analyze_heads(cache, n_values=(2,), random_samples=1)
    torch.testing.assert_close(geometry["f_score"], analysis.f_score[..., 0].double(), rtol=0, atol=1e-12)
    assert (geometry["shell_k0"] <= geometry["shell_kn"] + 1e-12).all()
    assert (geometry["shell_kn"] <= geometry["f_score"] + 1e-12).all()
    corr = capacity_correlation(model, tokens, 2)
    assert set(corr.rho) == {"f_score", "shell_k0", "shell_kn", "tail_mass", "truncation_error"}
    assert all(math.isnan(r) or -1 <= r <= 1 for r in corr.rho.values())
    assert len(corr.to_pandas()) == 12 and isinstance(corr.plot(), Figure)
    with pytest.raises(ValueError, match="contains N=3"):
        capacity_correlation(model, tokens, 3, sweep=capacity_sweep(model, tokens, (2,)))


def test_spearman():
    assert spearman(torch.tensor([1.0, 2.0, 2.0, 4.0]), torch.tensor([1.0, 3.0, 3.0, 5.0])) == pytest.approx(1.0)
    assert spearman(torch.tensor([1.0, 2.0, 3.0, math.nan]), torch.tensor([3.0, 2.0, 1.0, 0.0])) == -1.0
    assert math.isnan(spearman(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0, 2.0, 3.0])))


# --- real models --------------------------------------------------------------------------------


@pytest.mark.real_model
@pytest.mark.parametrize("mode", MODES)
def test_real_intervention_equals_recomputed_z(real, mode):
    """SmolLM2 (GQA: 9 query heads on 3 KV heads) and Gemma-3 (MQA): what the model uses after
    the hook is pattern · v recomputed from the sparsified pattern."""
    model, tokens = real.model, real.tokens[:2, :24]
    layer, n = 2, 3
    names = [f"blocks.{layer}.attn.hook_{x}" for x in ("pattern", "v", "z")]
    with torch.no_grad():
        _, dense = model.run_with_cache(tokens, names_filter=lambda x: x in names)
        with top_n_attention(model, n, mode, layers=[layer]):
            _, cache = model.run_with_cache(tokens, names_filter=lambda x: x in names)
    pattern, v, z = (cache[x] for x in names)
    valid = torch.ones(tokens.shape, dtype=torch.bool)
    expected = _reference_rows(dense[names[0]], n, mode, valid)
    torch.testing.assert_close(pattern, expected, rtol=0, atol=1e-7)
    n_heads, n_kv = model.cfg.n_heads, v.shape[2]
    kv = torch.arange(n_heads) // (n_heads // n_kv)
    torch.testing.assert_close(z, torch.einsum("bhqk,bkhe->bqhe", expected, v[:, :, kv]), rtol=1e-5, atol=1e-5)
    assert (z - dense[names[2]]).abs().max() > 1e-3  # the output really changed


@pytest.mark.real_model
def test_real_capacity_padding_and_dense(smollm2):
    """Left padding on SmolLM2: the padded batch's z at real positions is pattern · v from the
    sparsified pattern; N ≥ T gives exactly the dense loss; N = 1 costs loss."""
    model = smollm2.model
    tokens = smollm2.tokens[:2, :20]
    mask = torch.ones_like(tokens)
    mask[0, :5] = 0
    names = [f"blocks.1.attn.hook_{x}" for x in ("pattern", "v", "z")]
    with torch.no_grad():
        _, dense = model.run_with_cache(tokens, attention_mask=mask, names_filter=lambda x: x in names)
        with top_n_attention(model, 2, layers=[1]):
            _, cache = model.run_with_cache(tokens, attention_mask=mask, names_filter=lambda x: x in names)
    expected = _reference_rows(dense[names[0]], 2, "renormalize", mask.bool())
    real_q = mask.bool()[:, None, :, None]
    assert torch.equal(torch.where(real_q, cache[names[0]] - expected, 0).abs() <= 1e-7,
                       torch.ones_like(expected, dtype=torch.bool))
    v, kv = cache[names[1]], torch.arange(9) // 3
    z = torch.einsum("bhqk,bkhe->bqhe", expected, v[:, :, kv])
    torch.testing.assert_close(cache[names[2]][mask.bool()], z[mask.bool()], rtol=1e-5, atol=1e-5)
    cap = retrieval_capacity(model, tokens, (1, 20), attention_mask=mask)
    assert cap.loss[1].item() == cap.dense_loss and cap.loss[0].item() > cap.dense_loss


# --- command and report -----------------------------------------------------------------------------


class _CharTokenizer:
    """Enough of a tokenizer for text_windows: one id per character, BOS = 0."""

    bos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(c) % 39 for c in text]}


def test_cli_writes_csv_plots_and_report_section(tmp_path, monkeypatch, capsys):
    from tl_geometry.cli import main as cli

    model = tiny_lm(2)
    model.tokenizer = _CharTokenizer()
    monkeypatch.setattr("tl_geometry.inputs.models.load_model", lambda name, **_: model)
    out = tmp_path / "cap"
    status = cli.main(["capacity", "--n-seqs", "2", "--seq-len", "12", "--n-values", "1,2,16",
                       "--head-n", "2", "--batch-size", "8", "--out", str(out)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "renormalize: dense loss" in printed and "delete: dense loss" in printed and "ρ" in printed
    import pandas as pd

    curve = pd.read_csv(out / "capacity.csv")
    assert sorted(set(curve["mode"])) == ["delete", "renormalize"] and len(curve) == 6
    assert (curve.loc[curve["n"] == 16, "relative_increase"] == 0).all()  # N ≥ T: exactly dense
    heads = pd.read_csv(out / "capacity_heads.csv")
    assert len(heads) == 2 * 12 and {"f_score", "shell_k0", "shell_kn", "loss_increase"} <= set(heads.columns)
    assert (out / "capacity.png").is_file() and (out / "capacity_heads_delete.png").is_file()
    page = (out / "capacity.html").read_text()
    assert "Retrieval capacity" in page and "N* =" in page

    tokens = tl_geometry.text_windows(model, "abcdefghij" * 4, n_seqs=2, seq_len=12)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    result = tl_geometry.analyze_heads(cache, n_values=(1, 2), random_samples=1)
    index = tl_geometry.write_report(result, out)
    html = index.read_text()
    assert "<h2>Retrieval capacity</h2>" in html and "capacity_heads.csv" in html


def test_cli_rejects_bad_options(capsys):
    from tl_geometry.cli import main as cli

    for argv, flag in ((["--tolerance", "-1"], "--tolerance"), (["--head-n", "-2"], "--head-n"),
                       (["--n-values", "0,2"], "--n-values"), (["--out", __file__], "--out")):
        with pytest.raises(SystemExit) as stop:
            cli.main(["capacity", *argv])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert flag in err and len(err.splitlines()) == 1, err


# --- claim 7 of demos/reproduce.py ------------------------------------------------------------------


def test_claim7_tables_on_tiny_model_keep_their_windows(tmp_path):
    """Claim 7's tables from the tiny model (its run / save / load): the per-window values the
    intervals resample give back the tables' losses and ρ on all windows; with fewer than 8
    windows the claim prints n and gives no verdict, and without them no interval."""
    import sys
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "demos"))
    from _reproduce import capacity as claim_module
    from _reproduce.corpora import Corpus
    from _reproduce.intervals import NO_INTERVAL, NOT_MEASURED, TOO_FEW
    from _reproduce.protocol import QUICK

    from tl_geometry.functional.uncertainty import window_mean

    model = tiny_lm(2)
    model.tokenizer = _CharTokenizer()
    corpus = Corpus("chars", "the quick brown fox jumps over the lazy dog " * 20, "test")
    tables = claim_module.run(model, corpus, QUICK, progress=False)
    assert tables["seq_len"] == QUICK.ablation_seq_len and len(tables["heads"]) == 12
    tables["options"] = "{}"
    claim_module.save(tables, tmp_path / "tiny__capacity")
    again = claim_module.load(tmp_path / "tiny__capacity")
    assert again["rho"] == pytest.approx(tables["rho"], nan_ok=True) and len(again["curve"]) == len(tables["curve"])
    every = torch.arange(QUICK.ablation_windows)
    w = again["windows"]
    for mode in ("renormalize", "delete"):
        part = again["curve"][again["curve"]["mode"] == mode].sort_values("n")
        torch.testing.assert_close(window_mean(w[f"{mode}_loss"], w["weight"], every),
                                   torch.tensor(part["loss"].values, dtype=torch.float64), rtol=0, atol=1e-5)
    spread = claim_module.rho_intervals(again)
    assert spread["f_score"].value == pytest.approx(tables["rho"]["f_score"], abs=1e-9, nan_ok=True)
    study = SimpleNamespace(capacity={"a": again})
    assert claim_module.claim7(study, tmp_path).verdict == TOO_FEW  # 2 windows: "n = 2, too few"
    study = SimpleNamespace(capacity={"a": {**again, "windows": None}})
    assert claim_module.claim7(study, tmp_path).verdict == NO_INTERVAL
    assert claim_module.claim7(SimpleNamespace(capacity={}), tmp_path).verdict == NOT_MEASURED


def test_losses_per_window_match_each_window_alone(tokens):
    """Every capacity loss kept per window (the rows an interval over windows resamples, SPEC §8)
    equals the same intervention on that window alone, and their prediction-weighted mean is the
    batch's loss; the correlation's per-window geometry is each window's own, and ρ recomputed on
    all windows is the reported ρ."""
    model = tiny_lm(2)
    mask = _padding("right")
    cap = retrieval_capacity(model, tokens, (1, 2), attention_mask=mask, batch_size=1)
    sweep = capacity_sweep(model, tokens, (2,), by="head", heads=[(0, 1), (2, 3)], attention_mask=mask)
    assert cap.window_loss.shape == (2, 3) and sweep.window_loss.shape == (1, 3, 4, 3)
    assert cap.window_weight.tolist() == [7.0, 9.0, 11.0]  # valid predictions per window
    for b in range(3):
        one, one_mask = tokens[b:b + 1], mask[b:b + 1]
        with torch.no_grad():
            dense = float(model(one, return_type="loss", attention_mask=one_mask))
            assert cap.dense_window_loss[b].item() == pytest.approx(dense, abs=1e-5)
            for i, n in enumerate((1, 2)):
                with top_n_attention(model, n):
                    loss = float(model(one, return_type="loss", attention_mask=one_mask))
                assert cap.window_loss[i, b].item() == pytest.approx(loss, abs=1e-5)
            with top_n_attention(model, 2, heads=[(2, 3)]):
                loss = float(model(one, return_type="loss", attention_mask=one_mask))
            assert sweep.window_loss[0, 2, 3, b].item() == pytest.approx(loss, abs=1e-5)
    assert sweep.window_loss[0, 1, 1].isnan().all()  # not swept
    w = cap.window_weight
    torch.testing.assert_close((cap.window_loss * w).sum(-1) / w.sum(), cap.loss, rtol=0, atol=1e-5)
    corr = capacity_correlation(model, tokens, 2)
    for b in range(3):
        alone = head_geometry(model, tokens[b:b + 1], 2)
        torch.testing.assert_close(corr.window_scores["f_score"][b], alone["f_score"], rtol=0, atol=1e-12)
    rho = corr.rho_over(torch.arange(3))
    assert rho == pytest.approx(corr.rho, abs=1e-9, nan_ok=True)
    # A resample with a repeat: window 0 counts twice, window 1 not at all.
    drawn = [0, 0, 2]
    weight = corr.window_weight[drawn]
    increase = (corr.window_loss_increase[..., drawn] * weight).sum(-1) / weight.sum()
    assert corr.rho_over(torch.tensor(drawn)) == pytest.approx(
        {name: spearman(score[drawn].nanmean(0), increase) for name, score in corr.window_scores.items()},
        nan_ok=True)


def test_top_n_exit_without_enter_is_a_clear_error():
    model = tiny_lm(2)
    sparsified = tl_geometry.capacity.top_n_attention(model, 2)
    with pytest.raises(RuntimeError, match=r"without a matching __enter__.*with top_n_attention"):
        sparsified.__exit__(None, None, None)
