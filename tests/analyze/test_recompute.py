"""``analyze_model(attention="recompute")``: attention rows recomputed from captured queries and
keys give the pattern path's numbers (to the float32 round-off of two different forwards: eager
attention with ``hook_pattern`` against SDPA), on real models; and the option is checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tl_geometry
from tl_geometry.functional.separability import METRIC_NAMES, TRUNCATION_NAMES


def _compare(a: tl_geometry.HeadAnalysis, b: tl_geometry.HeadAnalysis) -> float:
    """Votes and labels equal, sink figures to 1e-5, every truncation figure (SPEC §10) to 1e-5
    (relative to the figure where it is above 1: a relative error of 5 carries the forwards'
    1e-6 difference in α); returns the share of separability entries that differ by more than
    1e-6 (near ties in α flipped by the round-off of the two forwards)."""
    assert torch.equal(a.vote_counts, b.vote_counts)
    assert a.labels == b.labels
    assert torch.equal(torch.isnan(a.scores), torch.isnan(b.scores))
    torch.testing.assert_close(b.sink, a.sink, rtol=1e-5, atol=1e-5, equal_nan=True)
    n_sep = len(METRIC_NAMES) - len(TRUNCATION_NAMES)
    diff = (a.scores - b.scores).abs()
    finite = torch.isfinite(a.scores)
    separability, truncation = diff[:, :n_sep], diff[:, n_sep:]
    # The kept mass is summed over the selected keys (never 1 − τ_N), and a set keeping < 1e-6
    # has no relative error: round-off of α no longer decides a figure.
    scaled = truncation / a.scores[:, n_sep:].abs().clamp_min(1)
    worst = float(scaled[finite[:, n_sep:]].max())
    assert worst <= 1e-5, f"a truncation figure differs by {worst:.3g}"
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


def _captures(model, tokens, mask=None, logsumexp=False):
    """Every layer's capture of one forward, copied out of the forward."""
    from tl_geometry.inputs.capture import capture_attention

    kept = []
    capture_attention(model, tokens, lambda c: kept.append(dataclasses.replace(
        c, q=c.q.clone(), k=c.k.clone(), v=c.v.clone())), attention_mask=mask, logsumexp=logsumexp)
    return kept


@pytest.mark.real_model
def test_the_forwards_logsumexp_gives_the_first_keys_columns(smollm2):
    """``logsumexp=True`` runs each plain causal layer on the kernel SDPA runs it on, and keeps
    each query's log-sum-exp: the forward is the same (to the round-off of another forward), the
    log-sum-exp is the float64 one's to float32 rounding, and the first keys' columns read from it
    equal the float64 rows' (to that rounding: ℓ is a float32 number of magnitude up to ~100) and
    give the same sink. A padded batch has a mask, so its layers keep none and the columns come
    from the SDPA pass."""
    from tl_geometry.analyze.recompute import RecomputedRows
    from tl_geometry.engine.sink_choice import choose_sink, first_keys_mass

    tokens = tl_geometry.text_windows(smollm2.model, tl_geometry.sample_text(), n_seqs=2, seq_len=200)
    plain, kept = _captures(smollm2.model, tokens), _captures(smollm2.model, tokens, logsumexp=True)
    assert all(c.logsumexp is None for c in plain)
    assert all(c.logsumexp is not None and c.logsumexp.shape == (2, 9, 200) for c in kept)
    for a, b in zip(plain, kept):
        for x, y in ((a.q, b.q), (a.k, b.k), (a.v, b.v)):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    masses, from_rows = [], []
    for c in kept[::7]:
        q, k = c.q.double(), c.k.double().repeat_interleave(3, dim=2)
        logits = torch.einsum("bthd,bjhd->bhtj", q, k) * c.params.scale
        logits = logits.masked_fill(~torch.ones(200, 200, dtype=torch.bool).tril(), -torch.inf)
        torch.testing.assert_close(c.logsumexp.double(), torch.logsumexp(logits, -1), rtol=0, atol=2e-5)
        source = RecomputedRows(c, None)
        lead = source.leading_columns(torch.tensor([0, 0]), torch.tensor([200, 200]), 32)
        torch.testing.assert_close(lead.double(), torch.softmax(logits, -1)[..., :32], rtol=0, atol=2e-5)
        # An all-ones mask is no padding (the model drops it): the same columns. A window that
        # starts later is normalised from its start, which ℓ is not: the one-hot pass serves it.
        all_ones = RecomputedRows(c, torch.ones(2, 200, dtype=torch.bool))
        assert torch.equal(all_ones.leading_columns(torch.tensor([0, 0]), torch.tensor([200, 200]), 32), lead)
        later = (torch.tensor([0, 20]), torch.tensor([200, 200]), 32)
        assert torch.equal(source.leading_columns(*later),
                           RecomputedRows(dataclasses.replace(c, logsumexp=None), None).leading_columns(*later))
        masses.append(first_keys_mass(source, torch.ones(2, 200, dtype=torch.bool), None))

        class _RowsOnly:  # the same rows, without the columns
            shape, device, dtype, rows, blocks = (source.shape, source.device, source.dtype, source.rows,
                                                  source.blocks)
        from_rows.append(first_keys_mass(_RowsOnly(), torch.ones(2, 200, dtype=torch.bool), None))
        torch.testing.assert_close(masses[-1], from_rows[-1], rtol=0, atol=1e-5, equal_nan=True)
    assert torch.equal(choose_sink(masses), choose_sink(from_rows))
    mask = torch.ones_like(tokens)
    mask[1, :20] = 0
    assert all(c.logsumexp is None for c in _captures(smollm2.model, tokens, mask, logsumexp=True)[::10])


@pytest.mark.real_model
@pytest.mark.parametrize("padded", [False, True])
def test_first_keys_mass_from_leading_columns_equals_the_float64_rows(smollm2, padded):
    """``sink="auto"`` reads the first 32 keys' columns of every query through the layer's own
    SDPA kernel (float32) instead of the float64 rows: the same masses to the forward's round-off,
    and the same choice, also for a left-padded window (read from its first real token); a gap in
    the keys falls back to the rows."""
    from tl_geometry.analyze.recompute import RecomputedRows
    from tl_geometry.engine.sink_choice import choose_sink, first_keys_mass

    tokens = tl_geometry.text_windows(smollm2.model, tl_geometry.sample_text(), n_seqs=2, seq_len=200)
    mask = torch.ones_like(tokens)
    if padded:  # the second window starts 20 positions later (left padding)
        mask[1, :20] = 0
    masses, from_rows = [], []
    for c in _captures(smollm2.model, tokens, mask if padded else None)[::7]:
        source = RecomputedRows(c, mask if padded else None)
        lead = source.leading_columns(torch.tensor([0, 20 if padded else 0]), torch.tensor([200, 200]), 32)
        assert lead is not None
        holed = mask.clone()
        holed[0, 100] = 0
        assert RecomputedRows(c, holed).leading_columns(torch.tensor([0, 0]), torch.tensor([200, 200]), 32) is None
        masses.append(first_keys_mass(source, mask.bool(), None))

        class _RowsOnly:  # the same rows, without the columns
            shape, device, dtype, rows, blocks = (source.shape, source.device, source.dtype, source.rows,
                                                  source.blocks)
        from_rows.append(first_keys_mass(_RowsOnly(), mask.bool(), None))
        torch.testing.assert_close(masses[-1], from_rows[-1], rtol=0, atol=2e-6, equal_nan=True)
    assert torch.equal(choose_sink(masses), choose_sink(from_rows))


@pytest.mark.real_model
@pytest.mark.filterwarnings("ignore:weak sink")  # three layers of a short window
def test_sink_auto_on_the_recompute_path_takes_one_forward(smollm2, monkeypatch):
    """``sink="auto"`` with recomputed rows runs one forward per batch: its captures wait until the
    sink is chosen (in memory, or in a temporary folder past the budget), and the analysis equals
    the one given those sinks (to the round-off of another forward)."""
    from tl_geometry.analyze import from_model, stash
    from tl_geometry.inputs import capture

    tokens = tl_geometry.text_windows(smollm2.model, tl_geometry.sample_text(), n_seqs=2, seq_len=96)
    kwargs = dict(attention="recompute", layers=[0, 7, 29], random_samples=2, shuffle_samples=2, progress=False)
    forwards = []
    real = capture.capture_attention
    monkeypatch.setattr(from_model, "capture_attention",
                        lambda *a, **k: (forwards.append(1), real(*a, **k))[1])
    auto = tl_geometry.analyze_model(smollm2.model, tokens, sink="auto", **kwargs)
    assert len(forwards) == 1 and auto.metadata["sink"]["rule"] == "auto"
    given = tl_geometry.analyze_model(smollm2.model, tokens, sink=auto.metadata["sink"]["positions"], **kwargs)
    monkeypatch.setattr(stash, "STASH_BYTES", 0)
    spilled = tl_geometry.analyze_model(smollm2.model, tokens, sink="auto", **kwargs)
    # Each is another forward of the same tokens: BLAS may round it differently (its blocking can
    # follow the memory's alignment), so they agree as two forwards do, not bit for bit.
    for other in (given, spilled):
        assert _compare(auto, other) < 0.05
    assert spilled.metadata["sink"]["positions"] == auto.metadata["sink"]["positions"]


def test_the_capture_stash_hands_back_equal_copies_and_cleans_up(tmp_path, monkeypatch):
    from tl_geometry.analyze.stash import CaptureStash
    from tl_geometry.inputs.capture import AttentionParams, LayerCapture

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    g = torch.Generator().manual_seed(0)
    params = AttentionParams(0.125, None, None, None, n_heads=4, n_kv_heads=2)
    base = torch.randn(2, 5, 8, 16, generator=g)
    made = [LayerCapture(layer, base[:, :, :4].transpose(0, 0) * layer, base[:, :, 4:6] + layer,
                         base[:, :, 6:] - layer, params) for layer in range(3)]
    size = sum(t.numel() * t.element_size() for t in (made[0].q, made[0].k, made[0].v))
    stash = CaptureStash(budget=size)  # the first layer in memory, the others on disk
    for c in made:
        stash.keep(c)
    base.zero_()  # the stash holds copies, not the caller's views
    assert stash.held == size and len(list(tmp_path.iterdir())) == 1
    back = list(stash.drain())
    assert [c.layer for c in back] == [0, 1, 2] and stash.held == 0
    for c, layer in zip(back, range(3)):
        want = torch.randn(2, 5, 8, 16, generator=torch.Generator().manual_seed(0))
        assert torch.equal(c.q, want[:, :, :4] * layer) and torch.equal(c.k, want[:, :, 4:6] + layer)
        assert torch.equal(c.v, want[:, :, 6:] - layer) and c.params == params
    assert not list(tmp_path.iterdir())  # the temporary folder is gone


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_the_capture_stash_keeps_nothing_of_the_forward(budget):
    """The stash holds copies: once the forward lets go of a layer's tensors they are freed,
    whether the copy went to memory or to disk (an empty view of them would keep them alive)."""
    import gc
    import weakref

    from tl_geometry.analyze.stash import CaptureStash
    from tl_geometry.inputs.capture import AttentionParams, LayerCapture

    forward = torch.randn(1, 6, 5, 8)  # one tensor that q, k and v are views of, as a fused projection gives
    alive = weakref.ref(forward)
    params = AttentionParams(0.5, None, None, None, n_heads=3, n_kv_heads=1)
    capture = LayerCapture(0, forward[:, :, :3], forward[:, :, 3:4], forward[:, :, 4:], params)
    stash = CaptureStash(budget=budget)
    stash.keep(capture)
    del capture, forward
    gc.collect()
    assert alive() is None
    (back,) = stash.drain()
    assert back.q.shape == (1, 6, 3, 8) and back.params == params
