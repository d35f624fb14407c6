"""``head_scores`` (SPEC §9) against an independent per-query computation from the same patterns."""

from __future__ import annotations

import pytest
import torch

import tl_geometry
from tl_geometry.analyze.head_scores import ordinary_tokens

pytestmark = pytest.mark.real_model


def _patterns(model, tokens):
    names = [f"blocks.{layer}.attn.hook_pattern" for layer in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    return [cache[n].double() for n in names]


def test_scores_equal_an_independent_computation(smollm2):
    model = smollm2.model
    g = torch.Generator().manual_seed(7)
    vocab = ordinary_tokens(model)
    R = 8
    body = vocab[torch.randint(len(vocab), (2, R), generator=g)]
    bos = torch.full((2, 1), model.tokenizer.bos_token_id)
    repeated = torch.cat([bos, body, body], dim=1)
    windows = tl_geometry.text_windows(model, n_seqs=2, seq_len=64)
    before = (repeated.clone(), windows.clone())
    scores = tl_geometry.head_scores(model, repeated=repeated, windows=windows, seed=0)
    assert torch.equal(repeated, before[0]) and torch.equal(windows, before[1])  # not mutated
    assert len(scores) == model.cfg.n_layers * model.cfg.n_heads
    rep, win = _patterns(model, repeated), _patterns(model, windows)
    for layer in range(model.cfg.n_layers):
        for head in range(model.cfg.n_heads):
            p, w = rep[layer][:, head], win[layer][:, head]
            prev = sum(float(p[b, t, t - 1]) for b in range(2) for t in range(2, 2 * R + 1)) / (2 * (2 * R - 1))
            dup = sum(float(p[b, t, t - R]) for b in range(2) for t in range(R + 1, 2 * R + 1)) / (2 * R)
            ind = sum(float(p[b, t, t - R + 1]) for b in range(2) for t in range(R + 1, 2 * R + 1)) / (2 * R)
            sink = sum(float(w[b, t, 0]) for b in range(2) for t in range(1, 64)) / (2 * 63)
            row = scores[(scores["layer"] == layer) & (scores["head"] == head)].iloc[0]
            for name, want in (("previous_token", prev), ("duplicate_token", dup),
                               ("induction", ind), ("sink_rate", sink)):
                assert row[name] == pytest.approx(want, abs=1e-5), (layer, head, name)
            assert 0 <= row["retrieval"] <= 1
    rates = torch.tensor(scores["sink_rate"].to_numpy())
    assert scores.attrs["sink_epsilon"] == pytest.approx(float((rates > 0.3).double().mean()))


def test_default_sequences_are_seeded_and_checked(smollm2):
    model = smollm2.model
    windows = tl_geometry.text_windows(model, n_seqs=1, seq_len=64)
    a = tl_geometry.head_scores(model, windows=windows, seed=1)
    b = tl_geometry.head_scores(model, windows=windows, seed=1)
    assert a.equals(b) and a.attrs["repeat"] == 32
    with pytest.raises(ValueError, match="second half"):
        tl_geometry.head_scores(model, repeated=torch.arange(1, 12)[None], windows=windows)
    with pytest.raises(ValueError, match=r"\[batch, 1 \+ 2R\]"):
        tl_geometry.head_scores(model, repeated=torch.ones(1, 10, dtype=torch.long), windows=windows)
