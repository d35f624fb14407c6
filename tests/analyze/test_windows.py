"""Sliding-window layers as candidate sets (SPEC §1, ours): only the keys a query sees are
candidates, and a query whose window starts after the sink has no sink. Both backends against
the loop reference restricted to the window; a real Gemma-3 run beyond its 512-key window."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from cases import make_case
from reference import METRICS, ref_analyze, ref_separability, ref_top_n
from shared_checks import assert_metrics_equal_reference, assert_sink_equals_reference
from streams import engine_randoms, engine_shuffles

import tl_geometry
from tl_geometry.inputs.cache import CacheError

N_VALUES = (1, 2, 3, 5, 8)
SAMPLES = 3
WINDOW = 6
GROUPS = ("top", "random", "shuffled", "sink_removed", "sink_in", "sink_out")


def _run(case, backend: str, window, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # N ≥ window is NaN on the windowed layer, as it says
        return tl_geometry.analyze_heads(
            case.cache(), n_values=N_VALUES, attention_mask=case.attention_mask, random_samples=SAMPLES,
            shuffle_samples=SAMPLES, backend=backend, window=window, **options)


CASES = [
    pytest.param({"ties": True, "duplicates": True, "sink": True}, {}, id="ties-last"),
    pytest.param({"sink": True}, {"queries": "all"}, id="sink-all"),
    pytest.param({"padding": "left", "n_kv": 1}, {"queries": "all"}, id="left-mqa-all"),
    pytest.param({"padding": "right", "n_heads": 6, "n_kv": 3}, {"queries": "all", "rank_by": "contribution"},
                 id="right-gqa-contribution"),
    pytest.param({"duplicates": True}, {"queries": "all", "distance": "cosine"}, id="cosine-all"),
]


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("case_options, options", CASES)
def test_windowed_cache_equals_the_reference(backend, case_options, options):
    case = make_case(80, batch=3, n_pos=14, window=WINDOW, **case_options)
    result = _run(case, backend, WINDOW, **options)
    mask = None if case.attention_mask is None else case.attention_mask.numpy()
    want = ref_analyze(case.pattern.double().numpy(), case.v.double().numpy(), N_VALUES,
                       queries=options.get("queries", "last"), attention_mask=mask,
                       distance=options.get("distance", "euclidean"),
                       rank_by=options.get("rank_by", "attention"), window=WINDOW,
                       randoms=engine_randoms(0, 0, mask), shuffles=engine_shuffles(0, 0, mask))
    assert_metrics_equal_reference(result, want, GROUPS, METRICS)
    np.testing.assert_array_equal(result.count("sink_in")[0].numpy(), want["sink_in_count"])
    np.testing.assert_array_equal(result.count("sink_out")[0].numpy(), want["sink_out_count"])
    assert_sink_equals_reference(result, want, ("mass", "norm_ratio", "cosine", "mean_cosine", "share"))
    np.testing.assert_array_equal(result.vote_counts[0].numpy(), want["vote_counts"])
    for h, per_n in enumerate(want["paired_ratios"]):
        assert result.paired_sink("count")[0, h].tolist() == [len(r) for r in per_n]
    # Some instance of every case loses the sink, and N ≥ the window is NaN on every query.
    assert result.sink_visible[0] < result.n_instances[0]
    assert torch.isnan(result.f_score[0, :, N_VALUES.index(8)]).all()


@pytest.mark.parametrize("case_options, options", CASES)
def test_backends_agree_with_a_window(case_options, options):
    case = make_case(81, batch=3, n_pos=14, window=5, **case_options)
    compiled, twin = (_run(case, backend, 5, **options) for backend in ("numba", "torch"))
    for name in ("scores", "sink", "paired", "group_counts"):
        torch.testing.assert_close(getattr(compiled, name), getattr(twin, name), equal_nan=True,
                                   rtol=1e-9, atol=1e-9, msg=name)
    assert torch.equal(compiled.vote_counts, twin.vote_counts)
    assert compiled.metadata["sink_visible"] == twin.metadata["sink_visible"]


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_a_window_as_wide_as_the_context_changes_nothing(backend):
    """``window ≥ every query's t + 1`` is the global layer, bit for bit (the same code path)."""
    case = make_case(82, batch=3, padding="left", sink=True)
    kwargs = dict(queries="all")
    none, wide = (_run(case, backend, w, **kwargs) for w in (None, case.pattern.shape[-1]))
    for name in ("scores", "group_counts", "sink", "paired", "vote_counts", "sequence_votes"):
        torch.testing.assert_close(getattr(none, name), getattr(wide, name), rtol=0, atol=0, equal_nan=True)
    assert none.windows == (None,) and wide.windows == (case.pattern.shape[-1],)
    assert none.sink_visible.tolist() == none.n_instances.tolist() == wide.sink_visible.tolist()


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_a_query_that_cannot_see_the_sink_never_votes_sink(backend):
    """All values zero: every contribution ties at 0 and the winner is the first key the query
    sees, the sink only where the window holds it (SPEC §5 ties → lower index)."""
    case = make_case(83, batch=2, n_pos=10, window=3)
    case.v.zero_()
    result = _run(case, backend, 3, queries="all")
    # Queries 1 and 2 see the sink (key 0) and decide the label; queries 3..9 see neither it
    # nor vote for it, and their votes are kept apart (SPEC §5).
    n_heads = case.pattern.shape[1]
    assert result.vote_counts[0].tolist() == [[0, 2 * 2, 0]] * n_heads
    assert result.beyond_votes[0].tolist() == [[0, 0, 2 * 7]] * n_heads
    assert result.sink_visible.tolist() == [2 * 3] and result.n_instances.tolist() == [2 * 10]


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_weight_outside_the_declared_window_is_an_error(backend):
    case = make_case(84, batch=2, n_pos=10, window=4)
    with pytest.raises(CacheError, match="outside the declared sliding window of 3"):
        _run(case, backend, 3)
    plain = make_case(84, batch=2, n_pos=10)  # a global layer declared windowed
    with pytest.raises(CacheError, match="outside the declared sliding window"):
        _run(plain, backend, {0: 4})
    _run(case, backend, 5)  # a wider window than the pattern's is not an error: α = 0 there


def test_windows_per_layer_are_recorded_and_round_trip(tmp_path):
    local, full = make_case(85, n_pos=12, window=4), make_case(86, n_pos=12)
    cache = {**local.cache(0), **full.cache(1), **local.cache(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tl_geometry.analyze_heads(cache, n_values=(1, 2), window={0: 4, 2: 4}, random_samples=2)
    assert result.windows == (4, None, 4)
    # Last query of 2 sequences: t = 11 sees keys 8..11 on the windowed layers, not the sink;
    # their sink figures are read at t_sink = 3, the last query that sees it (SPEC §1).
    assert result.sink_visible.tolist() == [0, 2, 0] and result.n_instances.tolist() == [2, 2, 2]
    assert result.metadata["sink_read_earlier"] == [2, 0, 2]
    assert torch.isfinite(result.sink_removed_f_score[[0, 2]][..., 0]).all()
    assert (result.count("sink_in")[[0, 2]] + result.count("sink_out")[[0, 2]] == 2).all()
    assert torch.isfinite(result.sink_mass).all()
    text = result.summary()
    assert "Sliding windows" in text and "L0 (w=4) 0/2 (+2 read at t_sink)" in text and "L2 (w=4) 0/2" in text
    loaded = tl_geometry.HeadAnalysis.load(result.save(tmp_path / "w.pt"))
    assert loaded.windows == result.windows and loaded.metadata == result.metadata
    assert torch.equal(loaded.sink_visible, result.sink_visible)
    # A result made before the option: no window, counts unknown, nothing in the summary.
    old = dict(result.metadata)
    for key in ("window", "sink_visible", "instances"):
        del old[key]
    before = tl_geometry.HeadAnalysis(**{**vars(result), "metadata": old})
    assert before.windows == (None, None, None) and torch.isnan(before.sink_visible).all()
    assert "Sliding windows" not in before.summary()
    again = tl_geometry.HeadAnalysis.load(before.save(tmp_path / "old.pt"))
    assert again.windows == (None, None, None)


def test_headline_range_follows_the_narrowest_window():
    case = make_case(87, n_pos=40, window=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tl_geometry.analyze_heads(case.cache(), n_values=(2, 4, 8), window=16, random_samples=0)
    assert result.headline_n == (2, 4)  # |T_t| = 16: N ≤ 4; without the window N ≤ 10
    with pytest.warns(UserWarning, match="sliding window of 16 keys"):
        tl_geometry.analyze_heads(case.cache(), n_values=(2, 16), window=16, random_samples=0)


@pytest.mark.parametrize("window, message", [
    (0, "positive int"), (-3, "positive int"), (2.5, "window must be None"), (True, "positive int"),
    ("local", "window must be 'auto'"), ({"0": 4}, "model layer indices"), ([4, "x"], r"window\[1\]"),
    ([4], r"window has 1 entries"),  # "auto" without a model is the default: every layer global
])
def test_bad_windows_are_refused_before_any_work(window, message):
    cache = make_case(88).cache(1)
    before = {k: v.clone() for k, v in cache.items()}
    with pytest.raises(ValueError, match=message):
        tl_geometry.analyze_heads(cache, window=window)
    assert all(torch.equal(cache[k], before[k]) for k in cache)


def test_bounds_stay_sound_with_a_window():
    """The shell certificate and the inversion bound are lower bounds on the windowed F_N too."""
    case = make_case(89, batch=2, n_pos=14, window=5, sink=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tl_geometry.analyze_heads(case.cache(), n_values=(1, 2, 3), queries="all", window=5,
                                           bounds=True, random_samples=0)
    for kind in ("inversion", "shell", "shell_n", "certified"):
        bound, measured = result.bound(kind, "f_score"), result.f_score
        assert torch.equal(torch.isnan(bound), torch.isnan(measured)), kind
        assert (bound[~torch.isnan(bound)] <= measured[~torch.isnan(measured)] + 1e-12).all(), kind


def test_model_windows_from_configs():
    from types import SimpleNamespace as NS

    from tl_geometry.inputs.capture import model_windows

    gemma = NS(config=NS(layer_types=["sliding_attention", "full_attention"], sliding_window=512))
    assert model_windows(gemma) == [512, None]
    bridge = NS(original_model=gemma, cfg=NS())
    assert model_windows(bridge) == [512, None]
    assert model_windows(NS(config=NS(layer_types=["full_attention"] * 3, sliding_window=None))) is None
    mistral = NS(config=NS(sliding_window=4096, num_hidden_layers=2))
    assert model_windows(mistral) == [4096, 4096]
    qwen_off = NS(config=NS(sliding_window=4096, num_hidden_layers=2, use_sliding_window=False))
    assert model_windows(qwen_off) is None
    hooked = NS(cfg=NS(attn_types=["global", "local"], window_size=8))
    assert model_windows(hooked) == [None, 8]
    assert model_windows(NS(cfg=NS())) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the torch twin's home)")
def test_cuda_twin_equals_the_compiled_kernels_with_a_window():
    case = make_case(90, batch=3, n_pos=14, window=5, sink=True, padding="left")
    on_cpu = _run(case, "numba", 5, queries="all", bounds=True)
    moved = type(case)(case.pattern.cuda(), case.v.cuda(), case.attention_mask.cuda())
    on_gpu = _run(moved, "auto", 5, queries="all", bounds=True)
    for name in ("scores", "sink", "paired", "group_counts", "bounds"):
        torch.testing.assert_close(getattr(on_gpu, name), getattr(on_cpu, name), equal_nan=True,
                                   rtol=1e-9, atol=1e-9, msg=name)
    assert torch.equal(on_gpu.vote_counts, on_cpu.vote_counts)
    assert on_gpu.metadata["sink_visible"] == on_cpu.metadata["sink_visible"]
    with pytest.raises(CacheError, match="outside the declared sliding window"):
        _run(moved, "auto", 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bounds_with_sampled_pairs_equal_the_cpu(monkeypatch):
    """Beyond MAX_PAIRS key pairs the regime fit samples pairs on the CPU (a CPU generator); on a
    CUDA cache the sampled lags must follow the cosines to the GPU (a real-model run crashed here)."""
    from tl_geometry.functional import bounds as functional_bounds

    monkeypatch.setattr(functional_bounds, "MAX_PAIRS", 20)
    case = make_case(91, batch=2, n_pos=14, sink=True, padding="left")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "pair cosines are sampled"
        on_cpu = _run(case, "numba", None, bounds=True)
        moved = type(case)(case.pattern.cuda(), case.v.cuda(), case.attention_mask.cuda())
        on_gpu = _run(moved, "auto", None, bounds=True)
    for name in ("scores", "bounds"):
        torch.testing.assert_close(getattr(on_gpu, name), getattr(on_cpu, name), equal_nan=True,
                                   rtol=1e-9, atol=1e-9, msg=name)


# --- a real Gemma-3 run beyond the 512-key window ------------------------------------------------

REAL_N = (2, 16)
REAL_SAMPLES = 2


@pytest.mark.real_model
def test_gemma3_local_layers_score_only_their_window(gemma3):
    """1 × 600 tokens, a local layer (0, window 512) and a global one (5), the last query: every
    group equals the reference restricted to the keys the query sees, the local layer's query
    has no sink (its sink figures are read at t_sink = 511, SPEC §1), and its chance floor is
    N/512."""
    model = gemma3.model
    tokens = tl_geometry.text_windows(model.tokenizer, n_seqs=1, seq_len=600)
    layers = [0, 5]
    result = tl_geometry.analyze_model(model, tokens, layers=layers, n_values=REAL_N, attention="pattern",
                                       random_samples=REAL_SAMPLES, shuffle_samples=REAL_SAMPLES)
    assert result.windows == (512, None)
    assert result.sink_visible.tolist() == [0, 1] and result.n_instances.tolist() == [1, 1]
    names = [f"blocks.{layer}.attn.{hook}" for layer in layers for hook in ("hook_pattern", "hook_v")]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    # analyze_heads reads the same windows from the bridge's Hugging Face config by default.
    from_cache = tl_geometry.analyze_heads(cache, model=model, layers=layers, n_values=REAL_N,
                                           random_samples=REAL_SAMPLES, shuffle_samples=REAL_SAMPLES)
    assert from_cache.windows == (512, None) and from_cache.metadata["window"] == [512, None]
    torch.testing.assert_close(from_cache.scores, result.scores, equal_nan=True, rtol=1e-6, atol=1e-6)
    assert tl_geometry.analyze_heads(cache, layers=layers, n_values=(2,), random_samples=1).windows == (None, None)
    t = tokens.shape[1] - 1
    for li, layer in enumerate(layers):
        window = result.windows[li]
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"][0, :, t].double().numpy()  # [head, key]
        v = cache[f"blocks.{layer}.attn.hook_v"][0].double().numpy()  # [pos, kv, d]
        valid = np.array([window is None or i > t - window for i in range(t + 1)])
        assert (pattern[:, ~valid] == 0).all()  # the model's own window: exactly zero outside
        n_heads, n_kv = pattern.shape[0], v.shape[1]
        randoms = engine_randoms(0, layer, None, REAL_SAMPLES)
        shuffles = engine_shuffles(0, layer, None, REAL_SAMPLES)
        keys = [i for i in range(t + 1) if valid[i]]
        for h in range(n_heads):
            alpha, values = pattern[h], v[:, h // (n_heads // n_kv)]
            for ni, n in enumerate(REAL_N):
                sel = ref_top_n(alpha, valid, n)
                want = {"top": [ref_separability(alpha, values, sel, valid)]}
                want["random"] = []
                for order in randoms(0, h, t, keys):
                    subset = np.zeros(t + 1, dtype=bool)
                    subset[order[:n]] = True
                    want["random"].append(ref_separability(alpha, values, subset, valid))
                want["shuffled"] = []
                listed = [k for k in keys if k != 0]
                for perm in shuffles(0, h, t, listed):
                    moved = values.copy()
                    moved[listed] = values[perm]
                    want["shuffled"].append(ref_separability(alpha, moved, sel, valid))
                for group, samples in want.items():
                    for m in ("precision", "recall", "f_score", "inversions", "precision_cc"):
                        got = result.metric(m, group)[li, h, ni].item()
                        expected = sum(x[m] for x in samples) / len(samples)
                        assert math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-6), (layer, h, n, group, m)
            if window is not None:  # no sink in the window: its figures are read at t_sink = 511
                at_sink = float(cache[f"blocks.{layer}.attn.hook_pattern"][0, h, window - 1, 0])
                assert math.isclose(result.sink_mass[li, h].item(), at_sink, rel_tol=1e-6, abs_tol=1e-9)
                assert math.isfinite(result.sink_removed_f_score[li, h, 0])
    assert result.metadata["sink_read_earlier"] == [1, 0]
    assert (result.count("sink_in") + result.count("sink_out") == 1).all()


@pytest.mark.real_model
def test_gemma3_head_geometry_reads_the_sliding_windows(gemma3):
    """capacity_correlation's per-head F_N (head_geometry) restricts a local layer's last query to
    the 512 keys it sees, as analyze_heads does: the two agree on every head at 600 tokens."""
    from tl_geometry.capacity import head_geometry

    model = gemma3.model
    tokens = tl_geometry.text_windows(model.tokenizer, n_seqs=1, seq_len=600)
    geometry = head_geometry(model, tokens, 4)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    analysis = tl_geometry.analyze_heads(cache, model=model, n_values=(4,), random_samples=1, shuffle_samples=0)
    assert analysis.windows.count(512) == 15
    torch.testing.assert_close(geometry["f_score"], analysis.f_score[..., 0].double(), rtol=0, atol=1e-12)


def test_auto_windows_without_a_model_are_global_and_a_config_without_a_window_warns():
    from types import SimpleNamespace as NS

    from tl_geometry.analyze import windows as _windows

    assert _windows.resolve("auto", None, [0, 1], need_model=False) == (None, None)
    with pytest.raises(ValueError, match="window='auto' reads the sliding windows"):
        _windows.resolve("auto", None, [0])
    silent = NS(config=NS(layer_types=["full_attention", "full_attention"], sliding_window=None))
    assert _windows.resolve("auto", silent, [0, 1]) == (None, None)
    unnamed = NS(config=NS(layer_types=["sliding_attention", "full_attention"], sliding_window=None))
    with pytest.warns(UserWarning, match="names sliding-window layers .* but gives no sliding_window"):
        assert _windows.resolve("auto", unnamed, [0, 1]) == (None, None)


@pytest.mark.real_model
def test_gemma3_local_labels_do_not_move_with_the_window_length(gemma3):
    """The same tokens cut at 600 and at 1,000 (SPEC §5): on every local layer the label is
    decided by the queries that see the sink (t ≤ 511), so the vote fractions agree within 0.01
    and every head with a margin ≥ 0.02 keeps its label (the two forwards differ by round-off
    only); κ and c_sink are read at t_sink = 511 and defined for every KV head (SPEC §1)."""
    model = gemma3.model
    tokens = tl_geometry.text_windows(model.tokenizer, n_seqs=1, seq_len=1000)
    runs = {n: tl_geometry.analyze_model(model, tokens[:, :n], n_values=(2,), attention="pattern",
                                         random_samples=1, shuffle_samples=1) for n in (600, 1000)}
    short, long = runs[600], runs[1000]
    local = [i for i, w in enumerate(long.windows) if w is not None]
    assert len(local) == 15
    torch.testing.assert_close(short.vote_fractions[local], long.vote_fractions[local], rtol=0, atol=0.01)
    margin = long.label_margin[local]
    for li, row in zip(local, margin):
        for h, m in enumerate(row.tolist()):
            if m >= 0.02:
                assert short.labels[li][h] == long.labels[li][h], (li, h)
    assert long.beyond_votes[local].sum() > short.beyond_votes[local].sum() > 0
    for field in ("norm_ratio", "cosine"):
        assert torch.isfinite(long.sink_diagnostic(field)).all(), field
    assert long.metadata["sink_read_earlier"] == [1 if w else 0 for w in long.windows]
