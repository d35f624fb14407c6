"""``head_scores`` (SPEC §9) against an independent per-query computation from the same patterns.

The functional scores are checked on synthetic patterns (with and without a sliding window)
against slow per-query loops; ``head_scores`` itself on a tiny hooked model (its sequences, its
arguments, the windows it reads) and on the session's real models at small lengths.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from shared_checks import spy_head_score_inputs

import tl_geometry
from tl_geometry.analyze.head_scores import ordinary_tokens
from tl_geometry.functional import head_scores as F

# The module (tl_geometry.analyze.head_scores is the function of the same name).
_head_scores = importlib.import_module("tl_geometry.analyze.head_scores")


def _patterns(model, tokens):
    names = [f"blocks.{layer}.attn.hook_pattern" for layer in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    return [cache[n].double() for n in names]


@pytest.mark.real_model
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


@pytest.mark.real_model
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


# --- the functional scores against per-query loops ------------------------------------------------
def _synthetic(batch: int, heads: int, n_pos: int, window: int | None = None, seed: int = 0) -> torch.Tensor:
    """A causal attention pattern; with ``window``, query ``t`` sees only keys ``t − w < i ≤ t``
    (the rest are exact zeros, as in a sliding-window layer's cache)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, heads, n_pos, n_pos, generator=g, dtype=torch.float64)
    t = torch.arange(n_pos)
    seen = t[None, :] <= t[:, None]
    if window is not None:
        seen &= t[:, None] - t[None, :] < window
    return logits.masked_fill(~seen, -math.inf).softmax(-1)


def _loop(pattern: torch.Tensor, pairs: list[tuple[int, int]]) -> list[float]:
    """Per head, the mean of α[t, i] over sequences and the (t, i) pairs, one query at a time."""
    batch, heads = pattern.shape[:2]
    return [float(np.mean([float(pattern[b, h, t, i]) for b in range(batch) for t, i in pairs]))
            if pairs else math.nan for h in range(heads)]


@pytest.mark.parametrize("n_pos, window", [(12, None), (12, 5), (12, 1), (6, 9), (40, 16)])
def test_sink_rate_reads_only_the_queries_that_see_key_0(n_pos, window):
    p = _synthetic(3, 4, n_pos, window)
    pairs = [(t, 0) for t in range(1, n_pos) if window is None or t < window]
    assert F.sink_queries(n_pos, window) == len(pairs)
    np.testing.assert_allclose(F.sink_rate(p, window).numpy(), _loop(p, pairs), rtol=0, atol=1e-12)
    if window is not None and window < n_pos:
        # Beyond the window α[t, 0] = 0: averaging over every query would dilute the rate.
        assert bool((p[:, :, window:, 0] == 0).all())
        everywhere = _loop(p, [(t, 0) for t in range(1, n_pos)])
        assert all(e < r for e, r in zip(everywhere, F.sink_rate(p, window).tolist())) or window == 1


@pytest.mark.parametrize("start", [1, 0])
@pytest.mark.parametrize("repeat, window", [(2, None), (5, None), (5, 6), (5, 5), (7, 3)])
def test_repeated_scores_read_the_second_copy_with_R_and_the_window(start, repeat, window):
    """previous_token over t = start+1 … T−1, duplicate_token α[t, t−R] and induction α[t, t−R+1]
    over the second copy t = start+R … start+2R−1; a key the window hides never counts (NaN where
    every one is hidden: duplicate_token for R ≥ w)."""
    n_pos = start + 2 * repeat
    p = _synthetic(2, 3, n_pos, window, seed=repeat)

    def seen(pairs):
        return [(t, i) for t, i in pairs if window is None or t - i < window]

    second = range(start + repeat, start + 2 * repeat)
    want = {
        "previous": _loop(p, seen([(t, t - 1) for t in range(start + 1, n_pos)])),
        "duplicate": _loop(p, seen([(t, t - repeat) for t in second])),
        "induction": _loop(p, seen([(t, t - repeat + 1) for t in second])),
    }
    got = {
        "previous": F.previous_token_score(p, start, window),
        "duplicate": F.duplicate_token_score(p, repeat, start, window),
        "induction": F.induction_score(p, repeat, start, window),
    }
    for name in want:
        np.testing.assert_allclose(got[name].numpy(), want[name], rtol=0, atol=1e-12, err_msg=name)
    assert bool(got["duplicate"].isnan().all()) is (window is not None and repeat >= window)
    with pytest.raises(ValueError, match=f"R = {repeat + 1} has {start + 2 * repeat + 2} positions"):
        F.duplicate_token_score(p, repeat + 1, start, window)


def test_retrieval_share_skips_queries_whose_key_the_window_hides():
    p = _synthetic(2, 3, 20)
    queries, keys = torch.tensor([10, 12, 19]), torch.tensor([3, 11, 2])
    winners = p[:, :, queries].argmax(-1)
    want = (winners == keys).double().mean(dim=(0, 2))
    np.testing.assert_allclose(F.argmax_share(p, queries, keys).numpy(), want.numpy())
    near = (winners[..., 1] == 11).double().mean(0)  # only 12 → 11 is within a window of 4
    np.testing.assert_allclose(F.argmax_share(p, queries, keys, window=4).numpy(), near.numpy())
    assert bool(F.argmax_share(p, queries, keys, window=1).isnan().all())


def test_sink_epsilon_is_a_share_of_the_defined_rates():
    assert F.sink_epsilon(torch.tensor([0.1, 0.5, 0.9, 0.3])) == 0.5
    assert F.sink_epsilon(torch.tensor([0.5, math.nan, 0.1, math.nan])) == 0.5
    assert math.isnan(F.sink_epsilon(torch.tensor([math.nan, math.nan])))


@pytest.mark.parametrize("window", [0, -3])
def test_a_bad_window_is_a_named_error(window):
    with pytest.raises(ValueError, match="sliding window, a whole number ≥ 1"):
        F.sink_rate(_synthetic(1, 1, 5), window)
    with pytest.raises(ValueError, match="sliding window"):
        F.sink_queries(5, window)


# --- head_scores on a tiny model: the lengths it reads, R, the windows --------------------------
def _tiny(with_bos: bool = True, windows: list[str] | None = None, size: int = 8, n_ctx: int | None = None):
    from test_bos_and_scores_refusals import tiny

    model = tiny(with_bos)
    if windows is not None:  # a config naming local layers (TinyLM itself attends globally)
        model.cfg.attn_types, model.cfg.window_size = windows, size
    if n_ctx is not None:
        model.cfg.n_ctx = n_ctx
    return model


class Forward(Exception):
    """Raised by a spy where the first forward would run: every check passed before it."""


def _no_forward(monkeypatch) -> None:
    def forward(*args):
        raise Forward

    monkeypatch.setattr(_head_scores, "_forward", forward)


def test_default_windows_are_the_analysis_length_and_sink_epsilon_reads_64(monkeypatch):
    seen = spy_head_score_inputs(monkeypatch)
    scores = tl_geometry.head_scores(_tiny(), seed=1)
    repeated, windows, sink, needled = seen
    assert windows.shape == (8, 128) and needled.shape == (8, 128 + 48) and repeated.shape == (8, 65)
    assert sink.shape == (8, 64) and torch.equal(sink[0, :16], windows[0, :16])  # the same text
    assert scores.attrs["seq_len"] == 128 and scores.attrs["sink_epsilon_seq_len"] == 64
    assert scores.attrs["n_windows"] == 8 and scores.attrs["repeat"] == 32 and scores.attrs["window"] is None
    assert (scores["sink_queries"] == 127).all()
    assert list(scores.columns) == ["layer", "head", *F.SCORE_NAMES, "sink_queries"]
    # Sink^ε: the share of heads above 0.3 on those 64-token windows, where sink_rate is read.
    seen.clear()
    short = tl_geometry.head_scores(_tiny(), seq_len=64, seed=1)
    assert [tuple(t.shape) for t in seen] == [(8, 65), (8, 64), (8, 64 + 48)]  # no forward apart
    assert torch.equal(seen[1], sink)
    rates = torch.tensor(short["sink_rate"].to_numpy())
    assert scores.attrs["sink_epsilon"] == short.attrs["sink_epsilon"] == F.sink_epsilon(rates)
    assert not np.allclose(scores["sink_rate"], short["sink_rate"])  # sink_rate reads all 127


def test_passed_windows_give_sink_epsilon_their_first_64_tokens(monkeypatch):
    model = _tiny()
    windows = tl_geometry.text_windows(model, n_seqs=3, seq_len=100)
    seen = spy_head_score_inputs(monkeypatch)
    long = tl_geometry.head_scores(model, windows=windows)
    assert [tuple(t.shape) for t in seen] == [(8, 65), (3, 100), (3, 148)]  # read in the same forward
    short = tl_geometry.head_scores(model, windows=windows[:, :64].clone())
    assert long.attrs["sink_epsilon"] == short.attrs["sink_epsilon"]
    assert long.attrs["seq_len"] == 100 and (long.sink_queries == 99).all()


@pytest.mark.parametrize("seq_len", [24, 64, 200])
def test_seq_len_sets_the_text_windows_and_leaves_sink_epsilon(monkeypatch, seq_len):
    seen = spy_head_score_inputs(monkeypatch)
    scores = tl_geometry.head_scores(_tiny(), seq_len=seq_len, seed=2)
    shapes = [tuple(tokens.shape) for tokens in seen]
    sink = [(8, 64)] if seq_len != 64 else []  # 64-token windows of the same text, read apart
    assert shapes == [(8, 65), (8, seq_len), *sink, (8, seq_len + 48)]
    assert scores.attrs["seq_len"] == seq_len and (scores["sink_queries"] == seq_len - 1).all()
    reference = tl_geometry.head_scores(_tiny(), seq_len=64, seed=2)
    assert scores.attrs["sink_epsilon"] == reference.attrs["sink_epsilon"]
    assert torch.equal(seen[2 if sink else 1][0, :16], seen[1][0, :16])  # the same text, from its start


@pytest.mark.parametrize("repeat", [2, 7, 40])
def test_repeat_sets_R_whatever_the_windows(monkeypatch, repeat):
    seen = spy_head_score_inputs(monkeypatch)
    model = _tiny()
    scores = tl_geometry.head_scores(model, repeat=repeat, seq_len=16, seed=4)
    repeated = seen[0]
    assert repeated.shape == (8, 1 + 2 * repeat) and scores.attrs["repeat"] == repeat
    assert torch.equal(repeated[:, 1:1 + repeat], repeated[:, 1 + repeat:])
    with torch.no_grad():
        _, cache = model.run_with_cache(repeated)
    second = range(1 + repeat, 1 + 2 * repeat)
    for layer in range(model.cfg.n_layers):
        p = cache[f"blocks.{layer}.attn.hook_pattern"].double()
        rows = scores[scores.layer == layer]
        np.testing.assert_allclose(rows.duplicate_token, _loop(p, [(t, t - repeat) for t in second]), atol=1e-12)
        np.testing.assert_allclose(rows.induction, _loop(p, [(t, t - repeat + 1) for t in second]), atol=1e-12)
    again = tl_geometry.head_scores(model, repeated=repeated, repeat=repeat, seq_len=16, seed=4)
    columns = ["previous_token", "duplicate_token", "induction", "sink_rate"]
    assert again[columns].equals(scores[columns])  # the needles draw on from another state


def test_sliding_window_layers_read_only_what_they_see(monkeypatch):
    """Layers 0 and 2 named local with w = 8: the sink rate reads t = 1 … 7 there (the count is
    recorded), every query on the global layer 1; R may be 7 = w − 1."""
    model = _tiny(windows=["local", "global", "local"], size=8)
    windows = tl_geometry.text_windows(model, n_seqs=2, seq_len=20)
    sink = tl_geometry.text_windows(model, n_seqs=2, seq_len=64)
    scores = tl_geometry.head_scores(model, windows=windows, sink_windows=sink, repeat=7)
    assert scores.attrs["window"] == [8, None, 8] and scores.attrs["repeat"] == 7
    with torch.no_grad():
        _, cache = model.run_with_cache(windows)
    for layer, w in enumerate([8, None, 8]):
        rows = scores[scores.layer == layer]
        visible = range(1, 20 if w is None else w)
        assert (rows.sink_queries == len(visible)).all()
        p = cache[f"blocks.{layer}.attn.hook_pattern"].double()
        np.testing.assert_allclose(rows.sink_rate, _loop(p, [(t, 0) for t in visible]), atol=1e-12)


@pytest.mark.parametrize("repeat", [8, 9, 100])
def test_R_beyond_the_window_is_refused_before_any_forward(monkeypatch, repeat):
    _no_forward(monkeypatch)
    model = _tiny(windows=["global", "local", "local"], size=8)
    with pytest.raises(ValueError, match=r"repeat R = \d+ is too long .*layer 1 sees the last 8 keys.*"
                                         r"R ≤ w − 1 = 7; use repeat ≤ 7"):
        tl_geometry.head_scores(model, repeat=repeat)
    body = torch.randint(3, 40, (1, repeat))
    with pytest.raises(ValueError, match="use repeat ≤ 7"):  # passed sequences too
        tl_geometry.head_scores(model, repeated=torch.cat([torch.zeros(1, 1, dtype=torch.long), body, body], 1))
    with pytest.raises(Forward):
        tl_geometry.head_scores(model, repeat=7)


@pytest.mark.parametrize("kwargs, message", [
    ({"repeat": 1}, r"repeat must be ≥ 2 \(R, .*\) \(with R = 1 the induction key is the query itself\), got 1"),
    ({"repeat": 0}, "repeat must be ≥ 2"),
    ({"repeat": -4}, "repeat must be ≥ 2"),
    ({"repeat": True}, r"repeat must be a whole number ≥ 2 .*got True \(bool\)"),
    ({"repeat": 4.0}, r"repeat must be a whole number ≥ 2 .*got 4.0 \(float\)"),
    ({"repeat": "32"}, r"repeat must be a whole number .*got '32' \(str\)"),
    ({"seq_len": 3}, r"seq_len must be ≥ 4 \(tokens per text window, BOS included\), got 3"),
    ({"seq_len": False}, r"seq_len must be a whole number ≥ 4 .*got False"),
    ({"seq_len": 64.0}, "seq_len must be a whole number"),
    ({"seq_len": 32, "windows": "w16"}, r"seq_len=32 but windows are 16 tokens long"),
    ({"repeat": 5, "repeated": "R4"}, r"repeat=5 but repeated holds R = 4"),
    ({"sink_windows": "w16"}, r"sink_windows must be \[batch, 64\]"),
    ({"seq_len": 60, "n_ctx": 100}, r"retrieval sequences of 60 \+ 48 tokens.*context of 100; use seq_len ≤ 52"),
    ({"repeat": 50, "n_ctx": 100}, r"sequences of 101 tokens \(BOS \+ 2R\).*use repeat ≤ 49"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_lengths_are_named_errors_before_any_forward(monkeypatch, kwargs, message):
    _no_forward(monkeypatch)
    kwargs = dict(kwargs)
    model = _tiny(n_ctx=kwargs.pop("n_ctx", None))
    body = torch.randint(3, 40, (1, 4))
    named = {"w16": tl_geometry.text_windows(model, n_seqs=1, seq_len=16),
             "R4": torch.cat([torch.zeros(1, 1, dtype=torch.long), body, body], 1)}
    kwargs = {k: named.get(v, v) if isinstance(v, str) and k != "repeat" else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        tl_geometry.head_scores(model, **kwargs)


def test_short_windows_without_sink_windows_leave_sink_epsilon_undefined():
    model = _tiny()
    windows = tl_geometry.text_windows(model, n_seqs=2, seq_len=16)
    with pytest.warns(UserWarning, match=r"Sink\^ε reads windows of 64 tokens .* these windows have 16.*sink_windows="):
        scores = tl_geometry.head_scores(model, windows=windows)
    assert math.isnan(scores.attrs["sink_epsilon"]) and (scores.sink_queries == 15).all()
    sink = tl_geometry.text_windows(model, n_seqs=3, seq_len=64)
    with_sink = tl_geometry.head_scores(model, windows=windows, sink_windows=sink)
    on_sink = tl_geometry.head_scores(model, windows=sink)
    assert with_sink.attrs["sink_epsilon"] == on_sink.attrs["sink_epsilon"]
    np.testing.assert_array_equal(with_sink.sink_rate, scores.sink_rate)
    no_bos = sink.clone()
    no_bos[:, 0] = 5
    with pytest.raises(ValueError, match=r"sink_windows: .*do not start with BOS"):
        tl_geometry.head_scores(model, windows=windows, sink_windows=no_bos)


# --- the real models, at small lengths ------------------------------------------------------------
@pytest.mark.real_model
def test_gemma3_reads_its_windows_and_counts_the_sink_queries(gemma3, monkeypatch):
    """Gemma-3's local layers (w = 512) at T = 24: every query t ≥ 1 sees key 0, so the count is
    23 on every layer and the rate is the plain mean; R = 512 is refused, R = 511 accepted."""
    model = gemma3.model
    windows = tl_geometry.text_windows(model, n_seqs=2, seq_len=24)
    sink = tl_geometry.text_windows(model, n_seqs=2, seq_len=64)
    scores = tl_geometry.head_scores(model, windows=windows, sink_windows=sink, repeat=3)
    local = [w for w in scores.attrs["window"] if w is not None]
    assert local and set(local) == {512} and None in scores.attrs["window"]
    assert (scores.sink_queries == 23).all() and scores.attrs["seq_len"] == 24
    pattern = _patterns(model, windows)
    for layer in range(model.cfg.n_layers):
        rows = scores[scores.layer == layer]
        np.testing.assert_allclose(rows.sink_rate, _loop(pattern[layer], [(t, 0) for t in range(1, 24)]),
                                   atol=1e-5)
    assert 0 <= scores.attrs["sink_epsilon"] <= 1
    _no_forward(monkeypatch)
    with pytest.raises(ValueError, match="R ≤ w − 1 = 511; use repeat ≤ 511"):
        tl_geometry.head_scores(model, repeat=512)
    with pytest.raises(Forward):
        tl_geometry.head_scores(model, repeat=511)


@pytest.mark.real_model
def test_smollm2_short_windows_count_every_query_and_sink_epsilon_reads_64(smollm2):
    model = smollm2.model
    scores = tl_geometry.head_scores(model, seq_len=16, repeat=4)
    assert scores.attrs["window"] is None and (scores.sink_queries == 15).all()
    assert scores.attrs["seq_len"] == 16 and scores.attrs["repeat"] == 4
    sink = tl_geometry.text_windows(model, n_seqs=8, seq_len=64)
    rates = torch.cat([F.sink_rate(p) for p in _patterns(model, sink)])
    assert scores.attrs["sink_epsilon"] == pytest.approx(F.sink_epsilon(rates), abs=1e-9)
