"""``analyze_model(attention="recompute")``: attention rows recomputed from captured queries and
keys give the pattern path's numbers (to the float32 round-off of two different forwards: eager
attention with ``hook_pattern`` against SDPA), on real models; and the option is checked."""

from __future__ import annotations

import pytest
import torch

import tl_geometry
from tl_geometry.functional.separability import METRIC_NAMES, TRUNCATION_NAMES


def _compare(a: tl_geometry.HeadAnalysis, b: tl_geometry.HeadAnalysis) -> float:
    """Votes and labels equal, sink figures to 1e-5; returns the share of separability entries
    that differ by more than 1e-6 (near ties in α flipped by the round-off of the two forwards).
    The truncation figures (SPEC §10) are sums of α themselves, so they carry that round-off
    everywhere: the share of them off by more than 1e-4 is held apart."""
    assert torch.equal(a.vote_counts, b.vote_counts)
    assert a.labels == b.labels
    assert torch.equal(torch.isnan(a.scores), torch.isnan(b.scores))
    torch.testing.assert_close(b.sink, a.sink, rtol=1e-5, atol=1e-5, equal_nan=True)
    n_sep = len(METRIC_NAMES) - len(TRUNCATION_NAMES)
    diff = (a.scores - b.scores).abs()
    finite = torch.isfinite(a.scores)
    separability, truncation = diff[:, :n_sep], diff[:, n_sep:]
    # Measured: 3.4 % of them beyond 1e-4 on SmolLM2 2 × 640 (a relative error amplifies where
    # ‖o‖ is small).
    assert float((truncation > 1e-4)[finite[:, n_sep:]].double().mean()) < 0.05
    return float((separability > 1e-6)[finite[:, :n_sep]].double().mean())


@pytest.mark.real_model
@pytest.mark.parametrize(("queries", "seq_len"), [("last", 640), ("all", 96)])
def test_recompute_equals_the_pattern_on_smollm2(smollm2, queries, seq_len):
    """2 × 640 tokens at the last query (2 × 96 at every query here; every layer at 2 × 640, both
    ways, is ``benchmarks/bench_recompute_equality.py``)."""
    text = tl_geometry.sample_text()
    tokens = tl_geometry.text_windows(smollm2.model, text, n_seqs=2, seq_len=seq_len)
    kwargs = dict(queries=queries, layers=[0, 7, 29], random_samples=4, shuffle_samples=4, progress=False)
    pattern = tl_geometry.analyze_model(smollm2.model, tokens, attention="pattern", **kwargs)
    recomputed = tl_geometry.analyze_model(smollm2.model, tokens, attention="recompute", **kwargs)
    assert pattern.metadata["attention"] == "pattern" and recomputed.metadata["attention"] == "recompute"
    assert _compare(pattern, recomputed) < 0.02


@pytest.mark.real_model
def test_votes_from_queries_and_keys_equal_the_recomputed_rows_on_smollm2(smollm2, monkeypatch):
    """The recompute path votes from the logits (``engine.key_votes``); reading every float64 row
    instead gives the same result, bit for bit."""
    from tl_geometry.engine import key_votes

    tokens = tl_geometry.text_windows(smollm2.model, tl_geometry.sample_text(), n_seqs=2, seq_len=256)
    kwargs = dict(attention="recompute", layers=[0, 7, 29], random_samples=2, shuffle_samples=2, progress=False)
    from_keys = tl_geometry.analyze_model(smollm2.model, tokens, **kwargs)
    monkeypatch.setattr(key_votes, "check_and_vote", lambda *args: None)
    from_rows = tl_geometry.analyze_model(smollm2.model, tokens, **kwargs)
    assert torch.equal(from_keys.vote_counts, from_rows.vote_counts)
    assert from_keys.labels == from_rows.labels
    torch.testing.assert_close(from_keys.scores, from_rows.scores, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(from_keys.sink, from_rows.sink, rtol=0, atol=0, equal_nan=True)


@pytest.mark.real_model
def test_recompute_sees_gemma3_sliding_window(gemma3):
    """900 tokens: beyond the 512-key window of Gemma-3's local layers (layer 0), and a global
    layer (5); the recomputed rows apply the window, so the numbers match the pattern's. One
    sequence: a mean is one instance, so each near-tie flip shows."""
    text = tl_geometry.sample_text()
    tokens = tl_geometry.text_windows(gemma3.model, text, n_seqs=1, seq_len=900)
    kwargs = dict(layers=[0, 5], random_samples=4, shuffle_samples=4, progress=False)
    pattern = tl_geometry.analyze_model(gemma3.model, tokens, attention="pattern", **kwargs)
    recomputed = tl_geometry.analyze_model(gemma3.model, tokens, attention="recompute", **kwargs)
    assert _compare(pattern, recomputed) < 0.05


def test_attention_option_is_checked():
    with pytest.raises(ValueError, match="attention must be one of"):
        tl_geometry.analyze_model(_NoHF(), torch.zeros(1, 4, dtype=torch.long), attention="flash")
    with pytest.raises(ValueError, match="needs a Hugging Face model"):
        tl_geometry.analyze_model(_NoHF(), torch.zeros(1, 4, dtype=torch.long), attention="recompute")


class _NoHF:
    """A model with TransformerLens's config and nothing to capture from."""

    class cfg:
        n_layers, n_heads, d_vocab, device = 1, 2, 10, "cpu"
