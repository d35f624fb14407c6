"""The local sink of each head of a sliding-window layer (ours): over the queries that cannot see
the sink, the key with the largest mean attention, its position, mass, coverage, κ and token.
Checked against a plain loop on synthetic caches (padding, GQA, several layers with and without
windows), across the three paths on Gemma-3, and in result files."""

from __future__ import annotations

import math
import warnings

import jaxtyping
import numpy as np
import pytest
import torch
from cases import make_case

import tl_geometry
from tl_geometry import functional as F
from tl_geometry.analyze import local_sink as _local
from tl_geometry.analyze.recompute import RecomputedRows
from tl_geometry.inputs.capture import AttentionParams, LayerCapture
from tl_geometry.result import HeadAnalysis, ResultFileError
from tl_geometry.result import io as _result_io

FIELDS = ("position", "mass", "coverage", "kappa", "token")


# --- the reference: a plain loop over sequences, heads, beyond queries and keys ---------------------

def ref_local_sink(pattern, v, mask, window, sink_offset=0, tokens=None):
    """``[batch, field, head]``: per sequence and head, over the real queries ``t`` with
    ``t − window + 1 > p`` (``p`` = first real token + ``sink_offset``), the mean attention of each
    key (0 outside the query's window), the argmax (first maximum), and its figures."""
    batch, n_heads, n_pos, _ = pattern.shape
    n_kv = v.shape[2]
    out = np.full((batch, len(FIELDS), n_heads), np.nan)
    for b in range(batch):
        real = [t for t in range(n_pos) if mask[b, t]]
        start = real[0]
        sink = start + sink_offset
        beyond = [t for t in real if t - window + 1 > sink]
        if not beyond:
            continue
        seen = [j for j in range(n_pos) if mask[b, j] and any(t - window < j <= t for t in beyond)]
        for h in range(n_heads):
            mean = {}
            for j in seen:
                total = 0.0
                for t in beyond:
                    if t - window < j <= t:
                        total += float(pattern[b, h, t, j])
                mean[j] = total / len(beyond)
            best = seen[0]
            for j in seen:
                if mean[j] > mean[best]:
                    best = j
            covered = sum(1 for t in beyond if t - window < best <= t)
            group = h // (n_heads // n_kv)

            def norm(j, b=b, group=group):
                return math.sqrt(sum(float(x) ** 2 for x in v[b, j, group]))

            others = [norm(j) for j in seen if j != best]
            kappa = norm(best) / (sum(others) / len(others)) if others else math.nan
            token = math.nan if tokens is None else float(tokens[b, best])
            out[b, :, h] = (best - start, mean[best], covered / len(beyond), kappa, token)
    return out


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=1e-12, atol=1e-12, equal_nan=True)


# --- the functional: rows in, figures out -----------------------------------------------------------

CASES = [
    pytest.param({}, 5, id="plain"),
    pytest.param({"padding": "left"}, 4, id="left"),
    pytest.param({"padding": "right", "n_heads": 6, "n_kv": 3}, 4, id="right-gqa"),
    pytest.param({"n_kv": 1, "ties": True}, 3, id="mqa-ties"),
    pytest.param({"sink": True, "duplicates": True}, 6, id="sink-duplicates"),
    pytest.param({"dtype": torch.bfloat16, "padding": "left"}, 5, id="bf16-left"),
]


@pytest.mark.parametrize(("options", "window"), CASES)
def test_functional_equals_the_loop(options, window):
    case = make_case(90, batch=3, n_pos=15, window=window, **options)
    mask = torch.ones(3, 15, dtype=torch.bool) if case.attention_mask is None else case.attention_mask.bool()
    tokens = torch.randint(0, 1000, (3, 15), generator=torch.Generator().manual_seed(1))
    got = F.local_sink(case.pattern, case.v, window=window, key_mask=mask, tokens=tokens).stack()
    want = ref_local_sink(case.pattern.double().numpy(), case.v.double().numpy(), mask.numpy(), window,
                          tokens=tokens.numpy())
    assert got.dtype == torch.float64 and got.shape == (3, len(FIELDS), case.pattern.shape[1])
    assert torch.isfinite(got[:, 1]).any()  # some sequence has queries beyond the window
    _close(got, want)
    # A later sink: fewer queries are beyond it.
    sink = F.sink_positions(mask) + 1
    later = F.local_sink(case.pattern, case.v, window=window, sink=sink, key_mask=mask, tokens=tokens).stack()
    _close(later, ref_local_sink(case.pattern.double().numpy(), case.v.double().numpy(), mask.numpy(), window,
                                 sink_offset=1, tokens=tokens.numpy()))


def test_a_tie_goes_to_the_lower_key_and_no_beyond_query_is_nan():
    """Uniform rows over a window of 3: the one beyond query (t = 3) gives its 3 keys 1/3 each."""
    n_pos, window = 4, 3
    alpha = torch.zeros(1, 1, n_pos, n_pos, dtype=torch.float64)
    for t in range(n_pos):
        lo = max(0, t - window + 1)
        alpha[0, 0, t, lo:t + 1] = 1 / (t + 1 - lo)
    s = F.local_sink(alpha, torch.ones(1, n_pos, 1, 2), window=window)
    assert s.position.tolist() == [[1.0]] and s.coverage.tolist() == [[1.0]] and s.kappa.tolist() == [[1.0]]
    assert math.isnan(s.token.item())  # no tokens given
    # A window as long as the sequence: nothing is beyond it, every figure is NaN.
    assert F.local_sink(alpha, torch.ones(1, n_pos, 1, 2), window=n_pos).stack().isnan().all()


def test_bad_inputs_name_the_fix(monkeypatch):
    # The errors users get: the suite's run-time shape check (jaxtyping) would refuse first.
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    alpha = torch.zeros(1, 1, 4, 4)
    with pytest.raises(ValueError, match="window=0 must be a positive int"):
        F.local_sink(alpha, torch.ones(1, 4, 1, 2), window=0)
    with pytest.raises(ValueError, match="key_mask has shape"):
        F.local_sink(alpha, torch.ones(1, 4, 1, 2), window=2, key_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="tokens has shape"):
        F.local_sink(alpha, torch.ones(1, 4, 1, 2), window=2, tokens=torch.zeros(1, 3, dtype=torch.long))


# --- analyze_heads: several layers with and without windows ----------------------------------------

#: layer → (make_case options, window): local layers of different windows and a global one.
LAYERS = {0: ({}, 4), 1: ({}, None), 2: ({"sink": True}, 6), 3: ({"ties": True}, 3)}


def _layered(seed, padding, n_heads=4, n_kv=2):
    """A cache of the layers of :data:`LAYERS`; one seed, so every layer has the same mask."""
    cases = {layer: make_case(seed, batch=3, n_pos=15, n_heads=n_heads, n_kv=n_kv, padding=padding, window=w,
                              **options) for layer, (options, w) in LAYERS.items()}
    masks = {None if c.attention_mask is None else tuple(c.attention_mask.flatten().tolist()) for c in cases.values()}
    assert len(masks) == 1
    cache = {}
    for layer, case in cases.items():
        cache.update(case.cache(layer))
    return cases, cache, cases[0].attention_mask


def _analyze(cache, mask, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # N beyond the narrowest window is NaN, as it says
        return tl_geometry.analyze_heads(cache, attention_mask=mask, n_values=(2,), random_samples=1,
                                         shuffle_samples=0, window={k: w for k, (_, w) in LAYERS.items()},
                                         **kwargs)


@pytest.mark.parametrize("small_blocks", [False, True], ids=["one-block", "one-query-blocks"])
@pytest.mark.parametrize(("padding", "n_heads", "n_kv", "sink"),
                         [(None, 4, 2, None), ("left", 6, 3, None), ("right", 4, 1, 1), ("left", 4, 4, 1)])
def test_analyze_heads_equals_the_loop(padding, n_heads, n_kv, sink, small_blocks, monkeypatch):
    if small_blocks:  # the column sums add up block by block: one query per block
        monkeypatch.setattr(_local, "BLOCK_BYTES", 1)
    cases, cache, mask = _layered(91, padding, n_heads, n_kv)
    tokens = torch.randint(0, 1000, (3, 15), generator=torch.Generator().manual_seed(2))
    result = _analyze(cache, mask, tokens=tokens, sink=sink)
    assert result.local_sink is not None
    assert result.local_sink.shape == (3, len(FIELDS), len(LAYERS), n_heads)
    real = torch.ones(3, 15, dtype=torch.bool) if mask is None else mask.bool()
    for li, (layer, (_, window)) in enumerate(LAYERS.items()):
        got = result.local_sink[:, :, li]
        if window is None:
            assert got.isnan().all(), "a global layer has no local sink"
            continue
        case = cases[layer]
        want = ref_local_sink(case.pattern.double().numpy(), case.v.double().numpy(), real.numpy(), window,
                              sink_offset=sink or 0, tokens=tokens.numpy())
        _close(got, want)
        assert np.isfinite(want[:, 1]).any()
    # The positions count from each window's first real token, as the sink's do.
    start = F.sink_positions(real)
    positions = result.local_sink[:, 0]
    picked = positions[positions.isfinite()]
    assert (picked >= 0).all() and (picked == picked.round()).all()
    ids = result.local_sink[:, 4, 0]
    for b in range(3):
        for h in range(n_heads):
            if positions[b, 0, h].isfinite():
                assert ids[b, h] == tokens[b, start[b] + int(positions[b, 0, h])]


def test_analyze_heads_without_tokens_or_windows():
    _, cache, mask = _layered(92, None)
    result = _analyze(cache, mask)
    assert result.local_sink[:, 4].isnan().all()  # no tokens: no token ids
    assert result.local_sink[:, 1, 0].isfinite().all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = tl_geometry.analyze_heads(cache, n_values=(2,), random_samples=1, shuffle_samples=0)
    assert plain.local_sink is None  # no layer has a window
    assert plain.local_sinks().empty and "Local sinks" not in plain.summary()
    with pytest.raises(ValueError, match=r"tokens must be the \[batch, pos\] = \[3, 15\]"):
        _analyze(cache, mask, tokens=torch.zeros(3, 14, dtype=torch.long))


def test_from_capture_equals_from_pattern_with_softcap_and_sink_logits():
    """The recompute path's blocks of rows from q and k give the figures of the full pattern
    recomputed once, softcap and sink logits included (nothing is left NaN for them)."""
    g = torch.Generator().manual_seed(3)
    batch, n_pos, n_heads, n_kv, d, window = 2, 23, 4, 2, 8, 7
    q, k, v = (torch.randn(batch, n_pos, n, d, generator=g) for n in (n_heads, n_kv, n_kv))
    mask = torch.ones(batch, n_pos, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    params = AttentionParams(0.35, window, 2.5, torch.randn(n_heads, generator=g), n_heads=n_heads, n_kv_heads=n_kv)
    pattern = F.attention_rows(q, k, torch.arange(n_pos).expand(batch, -1), key_mask=mask, **params.row_kwargs())
    sink = F.sink_positions(mask)
    tokens = torch.arange(batch * n_pos).view(batch, n_pos)
    capture = LayerCapture(0, q, k, v, params)
    from_rows = _local.layer_local_sink(pattern, v, mask, sink, window, tokens).stack()
    from_qk = _local.layer_local_sink(RecomputedRows(capture, mask), v, mask, sink, window, tokens).stack()
    torch.testing.assert_close(from_qk, from_rows, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert from_rows[:, 1].isfinite().all()
    _close(from_rows, ref_local_sink(pattern.numpy(), v.double().numpy(), mask.numpy(), window,
                                     tokens=tokens.numpy()))


# --- the table, the summary and the files -------------------------------------------------------------

class _Tokenizer:
    def decode(self, ids):
        return f"<{ids[0]}>"


def test_local_sinks_table_and_summary():
    _, cache, mask = _layered(93, "right")
    tokens = torch.randint(0, 5, (3, 15), generator=torch.Generator().manual_seed(4))
    result = _analyze(cache, mask, tokens=tokens)
    table = result.local_sinks(_Tokenizer())
    local = [li for li, (_, w) in enumerate(LAYERS.values()) if w is not None]
    assert len(table) == len(local) * result.n_heads
    assert set(table.layer) == {layer for layer, (_, w) in LAYERS.items() if w is not None}
    for row in table.itertuples():
        li = result.layers.index(row.layer)
        figures = result.local_sink[:, :, li, row.head].numpy()
        defined = figures[np.isfinite(figures[:, 1])]
        assert row.sequences == len(defined) and row.window == LAYERS[row.layer][1]
        positions, counts = np.unique(defined[:, 0], return_counts=True)
        assert row.position == positions[np.argmax(counts)] and row.position_share == counts.max() / len(defined)
        ids, counts = np.unique(defined[:, 4], return_counts=True)
        assert row.token == f"<{int(ids[np.argmax(counts)])}>" and row.token_share == counts.max() / len(defined)
        for i, name in ((1, "mass"), (2, "coverage"), (3, "kappa")):
            assert getattr(row, name) == pytest.approx(float(np.median(defined[:, i])), abs=1e-15)
    assert result.local_sinks().token.map(type).eq(int).all()  # without a tokenizer: the ids
    line = next(x for x in result.summary().splitlines() if x.startswith("Local sinks"))
    assert "token id" in line and "median mass" in line


def test_files_round_trip_bit_for_bit_and_older_files_load_without_it(tmp_path):
    _, cache, mask = _layered(94, "left")
    result = _analyze(cache, mask, tokens=torch.randint(0, 1000, (3, 15), generator=torch.Generator().manual_seed(5)))
    path = result.save(tmp_path / "run.pt")
    loaded = HeadAnalysis.load(path)
    assert loaded.local_sink.dtype == result.local_sink.dtype
    torch.testing.assert_close(loaded.local_sink, result.local_sink, rtol=0, atol=0, equal_nan=True)
    assert loaded.local_sinks().equals(result.local_sinks())
    # The same file as format 8 wrote it: without what format 9 added.
    payload = torch.load(path, weights_only=True)
    for key, since in _result_io._FIELD_SINCE.items():
        if since > 8:
            payload.pop(key, None)
            payload["axes"].pop(key, None)
            payload["names"].pop(key, None)
    for axis, added in _result_io._ADDED_IN.items():
        payload["names"][axis] = [x for x in payload["names"][axis] if added.get(x, 0) <= 8]
    payload["format"] = "tl_geometry.HeadAnalysis/8"
    payload["checksum"] = _result_io.checksum(payload)
    older = tmp_path / "older.pt"
    torch.save(payload, older)
    old = HeadAnalysis.load(older)
    assert old.local_sink is None and old.local_sinks().empty
    torch.testing.assert_close(old.scores, result.scores, rtol=0, atol=0, equal_nan=True)
    # A format-8 file that holds the local sinks was relabelled: refused.
    payload["local_sink"] = result.local_sink
    payload["axes"]["local_sink"] = list(_result_io.AXES["local_sink"])
    payload["names"]["local_field"] = list(FIELDS)
    payload["checksum"] = _result_io.checksum(payload)
    torch.save(payload, older)
    with pytest.raises(ResultFileError, match=r"local_sink \(format 9\)"):
        HeadAnalysis.load(older)


def test_layer_subset_keeps_the_local_sinks():
    _, cache, mask = _layered(95, None)
    result = _analyze(cache, mask)
    part = result.layer_subset([2, 1])
    torch.testing.assert_close(part.local_sink, result.local_sink[:, :, [2, 1]], rtol=0, atol=0, equal_nan=True)
    assert result.layer_subset([1]).local_sink is None  # a global layer alone: as its analysis alone
    assert set(result.by_layer_kind()) == {"global", "local"} and result.by_layer_kind()["global"].local_sink is None


def test_shards_add_up_their_own_sequences(tmp_path):
    """Under torch.distributed every rank fills its own sequences and the rows add up; a NaN
    (a sequence with no query beyond the window) stays NaN."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sinks = _local.LocalSinks([3, None], n_sequences=4)
        figures = F.LocalSink(*(torch.tensor([[1.0, math.nan], [2.0, 3.0]], dtype=torch.float64) for _ in FIELDS))
        sinks.add(0, 0, figures)
        sinks.all_reduce(0, 2, n_heads=2, device="cpu")
    finally:
        dist.destroy_process_group()
    assert sinks.values is not None
    torch.testing.assert_close(sinks.values[:2, :, 0], figures.stack(), rtol=0, atol=0, equal_nan=True)
    assert sinks.values[:2, :, 1].isnan().all() and (sinks.values[2:] == 0).all()


# --- the three paths on a real model -----------------------------------------------------------------

@pytest.mark.real_model
def test_the_three_paths_agree_on_gemma3(gemma3):
    """1 × 600 tokens (88 queries beyond the 512-key window of local layer 0) and global layer 5:
    the cache, the pattern hooks and the recomputed rows give the same local sink of every head
    (positions exactly, mass, coverage and κ to the forwards' float32 round-off), and its token
    is the token at its position."""
    model = gemma3.model
    tokens = tl_geometry.text_windows(model.tokenizer, n_seqs=1, seq_len=600)
    kwargs = dict(layers=[0, 5], n_values=(2,), random_samples=1, shuffle_samples=0, progress=False)
    pattern = tl_geometry.analyze_model(model, tokens, attention="pattern", **kwargs)
    recomputed = tl_geometry.analyze_model(model, tokens, attention="recompute", **kwargs)
    names = [f"blocks.{layer}.attn.{hook}" for layer in (0, 5) for hook in ("hook_pattern", "hook_v")]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    cached = tl_geometry.analyze_heads(cache, model=model, tokens=tokens, **kwargs)
    assert pattern.windows == recomputed.windows == cached.windows == (512, None)
    assert recomputed.metadata["attention"] == "recompute"
    for result in (pattern, recomputed, cached):
        assert result.local_sink is not None and result.local_sink[:, :, 1].isnan().all()
        assert result.local_sink[:, :, 0].isfinite().all()
    # Two forwards of the same tokens: equal to the float32 round-off of α (about 1e-6 between CPUs).
    torch.testing.assert_close(cached.local_sink, pattern.local_sink, rtol=1e-6, atol=1e-6, equal_nan=True)
    positions = pattern.local_sink[0, 0, 0]
    moved = recomputed.local_sink[0, 0, 0] != positions
    # The mass of the most attended key agrees; the key itself may differ only in a near-tie.
    torch.testing.assert_close(recomputed.local_sink[0, 1], pattern.local_sink[0, 1], rtol=1e-5, atol=1e-5,
                               equal_nan=True)
    same = ~moved
    assert bool(same.any())  # measured: every head chooses the same key on this machine
    torch.testing.assert_close(recomputed.local_sink[:, 2:4, 0][..., same], pattern.local_sink[:, 2:4, 0][..., same],
                               rtol=1e-5, atol=1e-5)
    for result in (pattern, recomputed):
        chosen = result.local_sink[0, 0, 0].long()
        assert torch.equal(result.local_sink[0, 4, 0], tokens[0, chosen].double())
    table = pattern.local_sinks(model.tokenizer)
    assert list(table.layer) == [0] * 4 and table.position_share.eq(1).all()
