"""analyze_heads against the per-query loop reference, and its protocol guarantees."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cases import make_case
from reference import ref_analyze
from shared_checks import assert_metrics_equal_reference, assert_same_analysis

import tl_geometry

METRICS = ("precision", "recall", "f_score", "margin", "inversions", "precision_cc", "f_score_cc")
N_VALUES = (1, 2, 3, 5, 8)

SCENARIOS = [
    pytest.param(0, {}, {}, id="plain"),
    pytest.param(1, {"ties": True, "duplicates": True}, {}, id="ties-duplicates"),
    pytest.param(2, {"sink": True, "n_kv": 1}, {}, id="mqa-sink"),
    pytest.param(3, {"padding": "right", "sink": True}, {}, id="right-padded"),
    pytest.param(4, {"padding": "left", "ties": True}, {}, id="left-padded"),
    pytest.param(5, {"dtype": torch.float16, "n_heads": 6, "n_kv": 3}, {}, id="fp16-gqa"),
    pytest.param(6, {"dtype": torch.bfloat16, "padding": "left"}, {}, id="bf16-left"),
    pytest.param(7, {"sink": True}, {"queries": "all"}, id="all-queries"),
    pytest.param(8, {"padding": "right", "duplicates": True}, {"queries": "all"}, id="all-right-padded"),
    pytest.param(9, {"padding": "left"}, {"queries": "all", "distance": "cosine"}, id="all-left-cosine"),
    pytest.param(10, {"ties": True}, {"rank_by": "contribution"}, id="rank-by-contribution"),
    pytest.param(11, {"n_kv": 2}, {"space": "output", "queries": "all"}, id="output-space"),
]


def _compare(result, want, li=0):
    assert_metrics_equal_reference(result, want, ("top", "sink_removed", "sink_in", "sink_out"), METRICS,
                                   layer=li, tol=1e-5)
    np.testing.assert_array_equal(result.count("sink_in")[li].numpy(), want["sink_in_count"])
    np.testing.assert_array_equal(result.count("sink_out")[li].numpy(), want["sink_out_count"])
    for field in ("mass", "norm_ratio", "cosine", "mean_cosine", "share"):
        np.testing.assert_allclose(getattr(result, f"sink_{field}")[li].numpy(), want[f"sink_{field}"],
                                   rtol=1e-5, atol=1e-5, equal_nan=True, err_msg=field)
    np.testing.assert_array_equal(result.vote_counts[li].numpy(), want["vote_counts"])
    np.testing.assert_allclose(result.vote_fractions[li].numpy(), want["vote_fractions"],
                               rtol=1e-12, equal_nan=True)
    assert result.labels[li] == want["labels"]


@pytest.mark.parametrize("seed,case_options,options", SCENARIOS)
def test_analyze_heads_matches_reference(seed, case_options, options):
    case = make_case(seed, batch=3, **case_options)
    W_O = None
    if options.get("space") == "output":
        g = torch.Generator().manual_seed(seed)
        W_O = torch.randn(1, case.pattern.shape[1], case.v.shape[-1], 7, generator=g)
    result = tl_geometry.analyze_heads(
        case.cache(), n_values=N_VALUES, attention_mask=case.attention_mask, W_O=W_O,
        random_samples=4, **options,
    )
    want = ref_analyze(
        case.pattern.double().numpy(), case.v.double().numpy(), N_VALUES,
        queries=options.get("queries", "last"),
        attention_mask=None if case.attention_mask is None else case.attention_mask.numpy(),
        distance=options.get("distance", "euclidean"),
        W_O=None if W_O is None else W_O[0].double().numpy(),
        rank_by=options.get("rank_by", "attention"),
    )
    _compare(result, want)


def test_random_baseline_matches_exact_expectation():
    """With many permutations the random mean approaches the average over every N-subset."""
    from itertools import combinations

    from reference import ref_separability

    case = make_case(21, batch=1, n_heads=1, n_kv=1, n_pos=6, d=3)
    result = tl_geometry.analyze_heads(case.cache(), n_values=(2, 3), random_samples=3000, seed=5)
    alpha = case.pattern[0, 0, -1].double().numpy()
    values = case.v[0, :, 0].double().numpy()
    valid = np.ones(6, dtype=bool)
    for i, n in enumerate((2, 3)):
        exact = [
            ref_separability(alpha, values, np.isin(np.arange(6), subset), valid)["f_score"]
            for subset in combinations(range(6), n)
        ]
        spread = np.std(exact) / np.sqrt(3000)
        got = float(result.random_f_score[0, 0, i])
        assert abs(got - np.mean(exact)) < 5 * spread + 1e-9, (n, got, np.mean(exact))


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_results_do_not_depend_on_chunking(monkeypatch, backend):
    from tl_geometry.engine import layer
    from tl_geometry.engine.twins import score

    case = make_case(30, batch=5, padding="right", sink=True)
    kwargs = dict(n_values=N_VALUES, attention_mask=case.attention_mask, random_samples=3,
                  queries="all", backend=backend)
    whole = tl_geometry.analyze_heads(case.cache(), **kwargs)
    # One sequence per chunk, then one value group of one sequence, one query per torch block.
    monkeypatch.setattr(layer, "MIN_CHUNK_BYTES", 1)
    monkeypatch.setattr(score, "BLOCK_ELEMENTS", 1)
    for fraction in (1e-3, 1e-9):
        monkeypatch.setattr(layer, "CHUNK_FRACTION", fraction)
        chunked = tl_geometry.analyze_heads(case.cache(), **kwargs)
        torch.testing.assert_close(whole.scores, chunked.scores, equal_nan=True, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(whole.sink, chunked.sink, equal_nan=True, rtol=1e-12, atol=1e-12)
        assert torch.equal(whole.vote_counts, chunked.vote_counts)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_results_are_ordinary_tensors_the_caller_may_edit(backend):
    """The engine runs under inference mode; nothing of it reaches the result, whose tensors
    the caller may change in place."""
    case = make_case(5, batch=2, sink=True)
    result = tl_geometry.analyze_heads(case.cache(), n_values=(1, 2), bounds=True, per_window=True,
                                       backend=backend, progress=False)
    tensors = {name: x for name, x in vars(result).items() if isinstance(x, torch.Tensor)}
    assert tensors and not [name for name, x in tensors.items() if x.is_inference()]
    for x in tensors.values():
        x.add_(0)  # an inference tensor refuses this outside inference mode


def test_seed_reproducible_and_random_differs_between_seeds():
    case = make_case(31, batch=2)
    a = tl_geometry.analyze_heads(case.cache(), n_values=(2, 3), seed=1, random_samples=2)
    b = tl_geometry.analyze_heads(case.cache(), n_values=(2, 3), seed=1, random_samples=2)
    c = tl_geometry.analyze_heads(case.cache(), n_values=(2, 3), seed=2, random_samples=2)
    assert torch.equal(a.scores.nan_to_num(), b.scores.nan_to_num())
    assert not torch.equal(a.random_f_score, c.random_f_score)
    assert torch.equal(a.f_score, c.f_score)  # only the baseline is random


def test_layers_are_read_by_name_and_selected():
    cases = [make_case(40 + i) for i in range(3)]
    cache = {}
    for layer, case in enumerate(cases):
        cache.update(case.cache(layer))
    full = tl_geometry.analyze_heads(cache, n_values=(2,), random_samples=2)
    assert full.layers == (0, 1, 2) and full.f_score.shape == (3, 4, 1)
    part = tl_geometry.analyze_heads(cache, n_values=(2,), random_samples=2, layers=[2])
    assert part.layers == (2,)
    torch.testing.assert_close(part.f_score[0], full.f_score[2])
    torch.testing.assert_close(part.random_f_score[0], full.random_f_score[2])


def test_n_larger_than_sequence_is_nan_with_a_warning():
    case = make_case(50, n_pos=6)
    with pytest.warns(UserWarning, match="cannot be evaluated"):
        result = tl_geometry.analyze_heads(case.cache(), n_values=(2, 6, 9), random_samples=2)
    assert torch.isfinite(result.f_score[..., 0]).all()
    assert torch.isnan(result.f_score[..., 1:]).all()


def test_all_queries_nan_where_n_exceeds_the_query():
    """queries='all' averages each N over the queries that can hold it (t ≥ N)."""
    case = make_case(51, batch=1, n_pos=8)
    result = tl_geometry.analyze_heads(case.cache(), n_values=(7,), queries="all", random_samples=2)
    last = tl_geometry.analyze_heads(case.cache(), n_values=(7,), queries="last", random_samples=2)
    # Only the last query (t = 7, eight keys) can hold N = 7: both modes agree.
    torch.testing.assert_close(result.f_score, last.f_score)


def test_random_baseline_independent_of_padding_width():
    """A right-padded sequence gets the same random subsets as when analysed at its own width."""
    case = make_case(60, batch=2, n_pos=20, padding="right")
    length = int(case.attention_mask[0].sum())
    for queries in ("last", "all"):
        kwargs = dict(n_values=(2, 3), queries=queries, random_samples=3)
        padded = tl_geometry.analyze_heads({k: v[:1] for k, v in case.cache().items()},
                                           attention_mask=case.attention_mask[:1], **kwargs)
        trimmed = {k: v[:1, :, :length, :length] if "pattern" in k else v[:1, :length]
                   for k, v in case.cache().items()}
        alone = tl_geometry.analyze_heads(trimmed, **kwargs)
        torch.testing.assert_close(padded.random_f_score, alone.random_f_score, equal_nan=True)
        torch.testing.assert_close(padded.f_score, alone.f_score, equal_nan=True)


def test_nan_values_at_padding_do_not_leak():
    case = make_case(61, batch=2, padding="left")
    clean = tl_geometry.analyze_heads(case.cache(), attention_mask=case.attention_mask, n_values=(2, 3))
    v = case.v.clone()
    v[~case.attention_mask.bool()] = torch.nan
    dirty = {"blocks.0.attn.hook_pattern": case.pattern, "blocks.0.attn.hook_v": v}
    result = tl_geometry.analyze_heads(dirty, attention_mask=case.attention_mask, n_values=(2, 3))
    torch.testing.assert_close(result.scores, clean.scores, equal_nan=True)
    torch.testing.assert_close(result.sink, clean.sink, equal_nan=True)


@pytest.mark.parametrize("sink", [None, "auto"])
def test_analyze_model_ends_each_forward_at_the_last_layer_it_reads(sink):
    """The pattern path stops each forward after the last layer the pass reads (layer 1; while
    ``sink="auto"`` probes, layer 2, whose pattern only chooses the sink): no later hook fires, no
    logits are formed, and the numbers are those of a whole forward's cache."""
    from test_ablation import TinyLM

    model = TinyLM().eval()
    tokens = torch.randint(1, model.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    fired: list[str] = []
    spies = [(f"blocks.2.attn.{name}", lambda x, hook: fired.append(hook.name)) for name in ("hook_v", "hook_z")]
    with model.hooks(fwd_hooks=spies):
        result = tl_geometry.analyze_model(model, tokens, layers=[0, 1], n_values=(2,), sink=sink, progress=False)
    assert fired == (["blocks.2.attn.hook_v"] if sink == "auto" else [])
    _, cache = model.run_with_cache(tokens)
    assert_same_analysis(result, tl_geometry.analyze_heads(cache, layers=[0, 1], n_values=(2,), sink=sink,
                                                           progress=False))
