"""The sink where the model puts it (SPEC §1): ``sink=`` (a position, one per window, or
``"auto"``), keys before the sink as ordinary keys, the sink check and its "weak sink" warning,
and the votes of sliding-window layers (SPEC §5: the label from the queries that see the sink,
the others apart, blocks of 128 queries). Both backends against the loop reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from cases import make_case
from reference import METRICS, ref_analyze
from shared_checks import assert_metrics_equal_reference, assert_sink_equals_reference
from streams import engine_randoms, engine_shuffles

import tl_geometry
from tl_geometry.engine.sink_choice import choose_sink, sink_check
from tl_geometry.engine.votes import LABEL_BLOCK, tally

N_VALUES = (1, 2, 3, 5)
SAMPLES = 3
GROUPS = ("top", "random", "shuffled", "sink_removed", "sink_in", "sink_out")


def _run(case, backend: str, **options):
    options = {"random_samples": SAMPLES, "shuffle_samples": SAMPLES, **options}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weak sinks and N beyond a window, as they say
        return tl_geometry.analyze_heads(case.cache(), n_values=N_VALUES, attention_mask=case.attention_mask,
                                         backend=backend, **{k: v for k, v in options.items() if v is not None})


def _assert_equals_reference(result, case, sink, window=None, **options):
    mask = None if case.attention_mask is None else case.attention_mask.numpy()
    want = ref_analyze(case.pattern.double().numpy(), case.v.double().numpy(), N_VALUES,
                       queries=options.get("queries", "last"), attention_mask=mask, window=window,
                       shuffle=options.get("shuffle", "values"), sink=sink,
                       randoms=engine_randoms(0, 0, mask), shuffles=engine_shuffles(0, 0, mask))
    assert_metrics_equal_reference(result, want, GROUPS, METRICS)
    np.testing.assert_array_equal(result.count("sink_in")[0].numpy(), want["sink_in_count"])
    assert_sink_equals_reference(result, want, ("mass", "norm_ratio", "cosine", "mean_cosine", "share"))
    np.testing.assert_array_equal(result.vote_counts[0].numpy(), want["vote_counts"])
    np.testing.assert_array_equal(result.beyond_votes[0].numpy(), want["beyond_counts"])
    for h, per_n in enumerate(want["paired_ratios"]):
        assert result.paired_sink("count")[0, h].tolist() == [len(r) for r in per_n]


SINK_CASES = [
    pytest.param({}, {}, 3, None, id="p3-last"),
    pytest.param({}, {"queries": "all"}, 4, None, id="p4-all"),
    pytest.param({"padding": "left", "n_kv": 1}, {"queries": "all"}, [2, 1, 3], None, id="left-per-window-all"),
    pytest.param({"padding": "right", "duplicates": True}, {"queries": "all", "shuffle": "unselected"}, 2, None,
                 id="right-unselected"),
    pytest.param({}, {"queries": "all", "shuffle": "norms"}, 5, 6, id="window-norms"),
    pytest.param({"ties": True}, {"queries": "all", "shuffle": "directions"}, 3, 4, id="window-ties-directions"),
    # Right padding (lengths 7, 9, 8): no last query (6 to 8) sees a sink at 2 through a window
    # of 4, so the sink figures are read at t_sink = 5, everything else at the last query (SPEC
    # §1, sink-visible reading).
    pytest.param({"padding": "right"}, {}, 2, 4, id="window-last-read-at-t-sink"),
]


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("case_options, options, sink, window", SINK_CASES)
def test_a_sink_after_the_first_token_equals_the_reference(backend, case_options, options, sink, window):
    """Keys before the sink are ordinary keys: candidates, shuffled, never "the sink"; every
    sink figure, null and vote reads the chosen key (SPEC §1)."""
    case = make_case(90, batch=3, n_pos=14, window=window, **case_options)
    result = _run(case, backend, sink=sink, window=window, **options)
    _assert_equals_reference(result, case, sink, window=window, **options)
    given = [sink] * 3 if isinstance(sink, int) else sink
    assert result.metadata["sink"]["positions"] == given and result.metadata["sink"]["rule"] == "given"


def test_sink_zero_is_the_default_bit_for_bit():
    case = make_case(91, batch=2, n_pos=12, padding="left")
    default, zero = _run(case, "numba"), _run(case, "numba", sink=0)
    for name in ("scores", "sink", "vote_counts", "sequence_votes", "paired"):
        torch.testing.assert_close(getattr(default, name), getattr(zero, name), rtol=0, atol=0, equal_nan=True)
    assert default.metadata["sink"]["positions"] == [0, 0]


def _attracting(case, key: int, extra: float = 4.0):
    """The case with every query from ``key`` on attending most to ``key``."""
    logits = case.pattern.clamp_min(1e-30).log()
    n_pos = logits.shape[-1]
    logits[..., key:, key] += extra
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    case.pattern = torch.softmax(logits.masked_fill(~causal, -torch.inf), dim=-1)
    return case


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_auto_finds_the_most_attended_of_the_first_32_tokens(backend):
    case = _attracting(make_case(92, batch=2, n_pos=48), key=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the chosen sink passes its own check: no "weak sink"
        result = tl_geometry.analyze_heads(case.cache(), n_values=N_VALUES, sink="auto", backend=backend,
                                           random_samples=SAMPLES, shuffle_samples=SAMPLES)
    record = result.metadata["sink"]
    assert record["rule"] == "auto" and record["positions"] == [5, 5]
    assert record["weak"] is False and record["sink_mass"][0] > record["other_mass"][0]
    _assert_equals_reference(result, case, 5)


def test_auto_reads_each_window_on_its_own_and_short_windows_take_the_first():
    long = _attracting(make_case(93, batch=1, n_pos=40), key=7)
    other = _attracting(make_case(94, batch=1, n_pos=40), key=2)
    both = tl_geometry.analyze_heads({"blocks.0.attn.hook_pattern": torch.cat([long.pattern, other.pattern]),
                                      "blocks.0.attn.hook_v": torch.cat([long.v, other.v])},
                                     n_values=(1, 2), sink="auto", random_samples=0, shuffle_samples=0)
    assert both.metadata["sink"]["positions"] == [7, 2]
    short = _attracting(make_case(95, batch=2, n_pos=32), key=4)  # 32 tokens: no query reads 32 keys
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to check: the figures are None, not a weak sink
        result = tl_geometry.analyze_heads(short.cache(), n_values=(1, 2), sink="auto")
    assert result.metadata["sink"]["positions"] == [0, 0]
    assert result.metadata["sink"]["sink_mass"] == [None] and result.metadata["sink"]["weak"] is False


def test_choose_sink_ties_go_to_the_lower_index_and_weights_layers_equally():
    masses = torch.zeros(1, 2, 32)
    masses[0, :, [3, 9]] = 0.5  # a tie
    assert choose_sink([masses]).tolist() == [3]
    a, b = torch.zeros(1, 1, 32), torch.zeros(1, 8, 32)
    a[0, 0, 4], b[0, :, 6] = 0.9, 0.5  # layer means 0.9 on 4 vs 0.5 on 6: the layers count alike
    assert choose_sink([a, b]).tolist() == [4]


def test_a_weak_sink_warns_and_names_the_fix():
    case = _attracting(make_case(96, batch=2, n_pos=48), key=6, extra=6.0)
    with pytest.warns(UserWarning, match="weak sink.*sink='auto'"):
        result = tl_geometry.analyze_heads(case.cache(), n_values=(1, 2), random_samples=0, shuffle_samples=0)
    record = result.metadata["sink"]
    assert record["weak"] is True and record["other_key"] == [6] and record["positions"] == [0, 0]
    check = sink_check([torch.ones(2, 3, 33) / 32], torch.tensor([0, 0]))
    assert check["weak"] is False  # a tie is not weak: the sink is as attended as any other


@pytest.mark.parametrize("bad, message", [
    ("first", "sink must be None"), (1.5, "sink must be None"), (True, "sink must be None"),
    (-1, "negative"), ([0, -2], "negative"), (torch.tensor([0.5]), "float"),
    ([0, 1, 2], "one position per window"), (11, "past the end of window 0"),
])
def test_bad_sink_values_are_refused_naming_the_fix(bad, message):
    case = make_case(97, batch=2, n_pos=10)
    with pytest.raises(ValueError, match=message):
        tl_geometry.analyze_heads(case.cache(), n_values=(1, 2), sink=bad)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_windowed_votes_decide_from_the_queries_that_see_the_sink_in_blocks(backend):
    """A 300-token window with a 150-key sliding window and the sink at 20: queries up to 169
    decide the label (blocks 0 of 128 complete, block 1 partial and dropped), the rest apart."""
    case = make_case(98, batch=2, n_pos=300, n_heads=2, n_kv=1, d=3, window=150)
    result = _run(case, backend, sink=20, window=150, queries="last")
    mask = None
    want = ref_analyze(case.pattern.double().numpy(), case.v.double().numpy(), (1,), attention_mask=mask,
                       window=150, sink=20)
    np.testing.assert_array_equal(result.vote_counts[0].numpy(), want["vote_counts"])
    np.testing.assert_array_equal(result.beyond_votes[0].numpy(), want["beyond_counts"])
    assert result.vote_counts[0].sum(-1).tolist() == [2 * 169] * 2
    blocks = result.block_votes[:, :, 0]  # [sequence, block, head, 3]
    for (b, block), counts in want["block_counts"].items():
        np.testing.assert_array_equal(blocks[b, block].numpy(), counts)
    assert blocks.sum(-1)[:, 0].tolist() == [[LABEL_BLOCK] * 2] * 2 and blocks[:, 1:].sum() == 0


def test_tally_counts_the_first_real_position_nowhere():
    vote_of = torch.tensor([[[-1, -1, 0, 2, 1]]], dtype=torch.int8)
    is_token = torch.tensor([[False, True, True, True, True]])
    counted = tally(vote_of, is_token, torch.tensor([1]), torch.tensor([1]), 2)
    # Window 2, sink at 1: query 2 sees it (decides), queries 3 and 4 do not (apart).
    assert counted.deciding.tolist() == [[[1, 0, 0]]] and counted.beyond.tolist() == [[[0, 1, 1]]]


@pytest.mark.parametrize("seed", range(6))
def test_tally_equals_a_loop_over_the_queries(seed):
    """Every count of :func:`tally` against a plain loop over (sequence, head, query), with left
    padding, sinks after the first token, windows and votes of every kind (−1 none)."""
    g = torch.Generator().manual_seed(seed)
    batch, n_heads, n_pos = 3, 2, 300
    window = (2**62, 150, 7)[seed % 3]
    start = torch.randint(0, 40, (batch,), generator=g)
    is_token = torch.arange(n_pos) >= start[:, None]
    sink = start + torch.randint(0, 5, (batch,), generator=g)
    vote_of = torch.randint(-1, 3, (batch, n_heads, n_pos), generator=g, dtype=torch.int8)
    got = tally(vote_of, is_token, start, sink, window)
    deciding = torch.zeros(batch, n_heads, 3, dtype=torch.long)
    beyond = torch.zeros_like(deciding)
    blocks = torch.zeros(batch, n_heads, -(-n_pos // LABEL_BLOCK), 3, dtype=torch.long)
    sizes = torch.zeros(batch, blocks.shape[2], dtype=torch.long)
    for b in range(batch):
        for t in range(int(start[b]) + 1, n_pos):
            decides = t - window < int(sink[b])
            block = (t - int(start[b]) - 1) // LABEL_BLOCK
            sizes[b, block] += decides
            for h in range(n_heads):
                vote = int(vote_of[b, h, t])
                if vote < 0:
                    continue
                (deciding if decides else beyond)[b, h, vote] += 1
                if decides:
                    blocks[b, h, block, vote] += 1
    blocks *= (sizes == LABEL_BLOCK)[:, None, :, None]
    assert torch.equal(got.deciding, deciding) and torch.equal(got.beyond, beyond)
    assert torch.equal(got.blocks, blocks.permute(0, 2, 1, 3))


def test_label_stability_resamples_blocks_below_eight_sequences():
    """One 1,100-token window: its 1,099 voting queries hold 8 complete blocks of 128 (the rest
    dropped), enough for a block bootstrap (SPEC §5); cut to 1,000 tokens it holds 7: no stability."""
    case = make_case(99, batch=1, n_pos=1100, n_heads=2, n_kv=1, d=3)
    long = _run(case, "numba")
    assert long.metadata["n_sequences"] == 1
    assert tl_geometry.result.labels.stability_units(long) == [("block", 8)]
    stability = long.label_stability
    assert torch.isfinite(stability).all() and ((stability >= 0) & (stability <= 1)).all()
    blocks = long.block_votes[0, :, 0]  # [block, head, 3]
    assert blocks.sum(-1)[:8].eq(LABEL_BLOCK).all() and blocks[8:].sum() == 0
    want = tl_geometry.functional.bootstrap_stability(blocks[:8])
    torch.testing.assert_close(stability[0], want)
    assert "block bootstrap: 8 blocks" in " ".join(long.summary().split())
    cut = make_case(99, batch=1, n_pos=1000, n_heads=2, n_kv=1, d=3)
    short = _run(cut, "torch")
    assert tl_geometry.result.labels.stability_units(short) == [("block", 7)]
    assert torch.isnan(short.label_stability).all()
    assert "at most 7 complete blocks" in " ".join(short.summary().split())


def test_the_summary_reports_the_sink_check_and_layer_kinds():
    case = _attracting(make_case(100, batch=2, n_pos=48), key=6, extra=6.0)
    local = make_case(101, batch=2, n_pos=48, window=16)
    cache = {**case.cache(0), **local.cache(1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tl_geometry.analyze_heads(cache, n_values=(1, 2), window={1: 16}, random_samples=0,
                                           shuffle_samples=0)
    text = " ".join(result.summary().split())
    assert "Sink (SPEC §1): position 0 of every window, given." in text
    assert "WEAK SINK" in text or "in 1 of 2 layers" in text
    assert "global layers (1):" in text and "local layers (1):" in text
    assert "local queries that cannot see the sink vote" in text
    assert result.beyond_votes[1].sum() > 0 and result.beyond_votes[0].sum() == 0


class _Rows:
    """The same pattern served as recomputed rows are (only the chosen queries' rows)."""

    def __init__(self, pattern):
        self.pattern = pattern

    shape = property(lambda self: tuple(self.pattern.shape[:3]))
    device = property(lambda self: self.pattern.device)
    dtype = property(lambda self: self.pattern.dtype)

    def rows(self, b0, b1, queries):
        index = queries.clamp_min(0)[:, None, :, None].expand(-1, self.pattern.shape[1], -1, self.pattern.shape[-1])
        return self.pattern[b0:b1].gather(2, index), torch.arange(queries.shape[1]).expand_as(queries)

    def blocks(self, b0, b1):
        yield 0, self.pattern[b0:b1]


@pytest.mark.parametrize("padding", ["left", None])  # None: the pattern is read as one slice
@pytest.mark.parametrize("window, cap", [(None, None), (50, None), (None, 7)])
def test_first_keys_mass_reads_the_spec_queries_from_a_pattern_and_from_rows(window, cap, padding):
    from tl_geometry.engine.block import PatternRows
    from tl_geometry.engine.sink_choice import first_keys_mass

    case = make_case(102, batch=3, n_pos=70, padding=padding, window=window)
    mask = case.attention_mask.bool() if padding else torch.ones(3, 70, dtype=torch.bool)
    got = first_keys_mass(PatternRows(case.pattern), mask, window, cap)
    torch.testing.assert_close(first_keys_mass(_Rows(case.pattern), mask, window, cap), got, equal_nan=True)
    assert torch.isnan(got[..., 32]).all()  # no sink given: no sink column
    start = mask.int().argmax(-1)
    with_sink = first_keys_mass(PatternRows(case.pattern), mask, window, cap, start + 3)
    torch.testing.assert_close(with_sink[..., :32], got[..., :32], equal_nan=True)
    torch.testing.assert_close(with_sink[..., 32], got[..., 3], equal_nan=True)  # the sink's own column
    for b in range(3):
        start, n_real = int(mask[b].int().argmax()), int(mask[b].sum())
        stop = min(n_real, window or n_real, 32 + (cap if cap is not None else n_real))
        queries = [start + t for t in range(32, stop)]
        if not queries:
            assert torch.isnan(got[b]).all()
            continue
        want = torch.stack([case.pattern[b, :, t, start:start + 32].double() for t in queries]).mean(0)
        torch.testing.assert_close(got[b, :, :32], want)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("padding, window, sink", [(None, None, 0), ("left", None, 2), ("right", 50, 0),
                                                   (None, None, 40), ("left", 45, 36)])
def test_the_validation_reads_the_sink_checks_masses_as_first_keys_mass(backend, padding, window, sink):
    """The check of a given sink is added as the validation reads the rows
    (``LayerStats.first_keys``): the masses :func:`first_keys_mass` reads with
    ``CHECK_QUERIES``, sinks past the 32 candidates and windows with too few queries included."""
    from tl_geometry.engine import analyze_layer, check_options
    from tl_geometry.engine.block import PatternRows
    from tl_geometry.engine.sink_choice import CHECK_QUERIES, first_keys_mass

    case = make_case(103, batch=3, n_pos=200, padding=padding, window=window)
    mask = case.attention_mask.bool() if padding else torch.ones(3, 200, dtype=torch.bool)
    sinks = mask.int().argmax(-1) + sink
    stats = analyze_layer(case.pattern, case.v, mask, sinks, check_options(n_values=(1, 2), backend=backend),
                          layer=0, mask_given=padding is not None, window=window)
    want = first_keys_mass(PatternRows(case.pattern), mask, window, CHECK_QUERIES, sinks)
    assert not torch.isnan(want).all()
    torch.testing.assert_close(stats.first_keys, want, rtol=1e-12, atol=1e-15, equal_nan=True)


def test_per_window_arrays_are_each_windows_own_means_and_round_trip(tmp_path):
    """``per_window=True`` keeps what a bootstrap over windows resamples (SPEC §8): the mean over
    windows of ``window_scores`` is the result's per-sequence-first mean, batches or not."""
    case = make_case(103, batch=5, n_pos=16, padding="right")
    kept = _run(case, "numba", per_window=True, queries="all")
    plain = _run(case, "numba", queries="all")
    assert plain.window_scores is None and plain.window_sink is None
    n_metrics = kept.scores.shape[1]
    # [window, group, metric, layer, head, n]; groups: the four below, then sink in / out (format 9)
    assert kept.window_scores.shape == (5, 6, n_metrics, 1, 4, len(N_VALUES))
    for gi in range(4):  # top, random, shuffled, sink removed
        torch.testing.assert_close(kept.window_scores[:, gi].double().nanmean(0), plain.scores[gi],
                                   rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(kept.window_sink.double().nanmean(0), plain.sink, rtol=1e-6, atol=1e-6,
                               equal_nan=True)
    back = tl_geometry.HeadAnalysis.load(kept.save(tmp_path / "w.pt"))
    torch.testing.assert_close(back.window_scores, kept.window_scores, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="per_window must be"):
        tl_geometry.analyze_heads(case.cache(), per_window="yes")
    assert kept.window_bounds is None  # no bounds asked for


def test_per_window_bounds_are_each_windows_own_means(tmp_path):
    """With ``bounds=True`` the per-window arrays hold each window's mean bounds too (format 7):
    their mean over windows is the result's bounds."""
    case = make_case(105, batch=4, n_pos=14)
    kept = _run(case, "numba", per_window=True, bounds=True)
    assert kept.window_bounds.shape == (4, *kept.bounds.shape)  # [window, kind, metric, layer, head, n]
    torch.testing.assert_close(kept.window_bounds.double().nanmean(0), kept.bounds, rtol=1e-6, atol=1e-6,
                               equal_nan=True)
    back = tl_geometry.HeadAnalysis.load(kept.save(tmp_path / "b.pt"))
    torch.testing.assert_close(back.window_bounds, kept.window_bounds, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("queries", [5, [0, 3, 7, 20]])
def test_sampled_and_given_queries_equal_the_reference_at_those_positions(backend, queries):
    """``queries=k`` reads k seeded positions per sequence (the same on every layer and batch)
    and ``queries=[...]`` the given ones from each first real token; the votes read every query
    (SPEC §3, §5). R defaults to 4 where more than the last query is read."""
    from tl_geometry.engine.rng import sampled_positions

    case = make_case(104, batch=3, n_pos=14, padding="left")
    mask = case.attention_mask.bool()
    result = _run(case, backend, queries=queries, random_samples=None, shuffle_samples=None)
    assert result.metadata["random_samples"] == result.metadata["shuffle_samples"] == 4
    positions = []
    for b in range(3):
        start, real = int(mask[b].int().argmax()), int(mask[b].sum())
        picked = (sampled_positions(0, b, real, queries).tolist() if isinstance(queries, int)
                  else [p for p in queries if p < real])
        positions.append([start + p for p in picked])
    mask_np = case.attention_mask.numpy()
    want = ref_analyze(case.pattern.double().numpy(), case.v.double().numpy(), N_VALUES, queries=positions,
                       attention_mask=mask_np, randoms=engine_randoms(0, 0, mask_np, 4),
                       shuffles=engine_shuffles(0, 0, mask_np, 4))
    assert_metrics_equal_reference(result, want, ("top", "random", "shuffled", "sink_removed"), METRICS)
    np.testing.assert_array_equal(result.vote_counts[0].numpy(), want["vote_counts"])
    np.testing.assert_array_equal(result.sequence_votes[:, 0].numpy().sum(0), want["vote_counts"])


@pytest.mark.parametrize("bad", [0, -1, "some", [1, 1], [], [0.5], True])
def test_bad_queries_are_refused_naming_the_choices(bad):
    case = make_case(105, batch=1, n_pos=8)
    with pytest.raises(ValueError, match="queries"):
        tl_geometry.analyze_heads(case.cache(), n_values=(1, 2), queries=bad)


def test_sampled_positions_do_not_depend_on_the_batch():
    """``queries=k`` draws each sequence's positions from (seed, its index) alone: analysed in
    batches of one, streamed, or all at once, the per-sequence means are the same."""
    case = make_case(106, batch=4, n_pos=20, padding="left")
    whole = _run(case, "numba", queries=6, per_window=True)
    cache = case.cache()
    for b in range(4):
        one = {k: v[b:b + 1] for k, v in cache.items()}
        mask = case.attention_mask[b:b + 1]
        from tl_geometry.engine import Accumulator, analyze_layer, check_options

        opts = check_options(n_values=N_VALUES, queries=6, random_samples=SAMPLES, shuffle_samples=SAMPLES,
                             per_window=True)
        sink = mask.int().argmax(-1)
        stats = analyze_layer(one["blocks.0.attn.hook_pattern"], one["blocks.0.attn.hook_v"], mask.bool(),
                              sink, opts, layer=0, sequence_offset=b, mask_given=True)
        acc = Accumulator.zeros(1, 4, len(N_VALUES), n_sequences=1, per_window=True)
        acc.add(0, stats)
        alone = acc.finish((0,), opts, 20, {})
        # Same cache, another batch width: equal up to summation order (stored as float32); other
        # positions would move these means by far more.
        torch.testing.assert_close(alone.window_scores[0], whole.window_scores[b], rtol=1e-6, atol=1e-7,
                                   equal_nan=True)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("sink, queries", [(8, [3]), (10, [1, 2]), (5, [50])])
def test_a_sink_after_every_chosen_query_is_read_correctly(backend, sink, queries):
    """A given sink after every chosen query (or no chosen query at all): nothing reads past the
    chunk, and every figure equals the reference."""
    case = make_case(107, batch=2, n_pos=14)
    result = _run(case, backend, sink=sink, queries=queries)
    mask = np.ones((2, 14), dtype=np.int64)
    absolute = [[t for t in queries if t < 14]] * 2
    want = ref_analyze(case.pattern.double().numpy(), case.v.double().numpy(), N_VALUES, queries=absolute,
                       attention_mask=mask, sink=sink, randoms=engine_randoms(0, 0, mask),
                       shuffles=engine_shuffles(0, 0, mask))
    assert_metrics_equal_reference(result, want, ("top", "random", "shuffled", "sink_removed"), METRICS)
    np.testing.assert_array_equal(result.vote_counts[0].numpy(), want["vote_counts"])


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_the_t_sink_pass_survives_chunks_without_a_query(backend, monkeypatch):
    """One sequence per chunk, one of them whose last query sees the sink: its t_sink chunk has
    no query to score, and the others still read theirs."""
    import tl_geometry.engine.layer as layer_module

    monkeypatch.setattr(layer_module, "MIN_CHUNK_BYTES", 1)
    monkeypatch.setattr(layer_module, "CHUNK_FRACTION", 1e-9)
    case = make_case(108, batch=3, n_pos=14, padding="right", window=8)
    result = _run(case, backend, window=8)
    _assert_equals_reference(result, case, None, window=8)


def test_a_given_sink_past_the_first_32_tokens_is_checked():
    case = _attracting(make_case(109, batch=2, n_pos=80), key=40, extra=6.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the sink at 40 is the most attended: no weak sink
        result = tl_geometry.analyze_heads(case.cache(), n_values=(1, 2), sink=40, random_samples=0,
                                           shuffle_samples=0)
    record = result.metadata["sink"]
    assert record["positions"] == [40, 40] and record["sink_mass"][0] > record["other_mass"][0]


def test_auto_skips_layers_that_no_query_can_read():
    """A local layer of 16 keys has no query that sees all 32 candidates: the choice comes from
    the other layers, not the first token by default."""
    glob = _attracting(make_case(110, batch=2, n_pos=48), key=5)
    local = make_case(111, batch=2, n_pos=48, window=16)
    cache = {**glob.cache(0), **local.cache(1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tl_geometry.analyze_heads(cache, n_values=(1, 2), window={1: 16}, sink="auto",
                                           random_samples=0, shuffle_samples=0)
    record = result.metadata["sink"]
    assert record["positions"] == [5, 5] and record["sink_mass"][1] is None and record["weak"] is False


def test_a_sink_outside_the_sequence_is_refused_by_the_engine():
    from tl_geometry.engine import analyze_layer, check_options

    case = make_case(112, batch=2, n_pos=14)
    with pytest.raises(ValueError, match="real position of its sequence"):
        analyze_layer(case.pattern, case.v, torch.ones(2, 14, dtype=torch.bool), torch.tensor([40, 40]),
                      check_options(n_values=(1, 2)), layer=0, mask_given=False)


def test_half_the_layers_is_not_a_weak_sink():
    strong, weak = torch.zeros(1, 1, 33), torch.zeros(1, 1, 33)
    strong[..., 0], weak[..., 0], weak[..., 3] = 0.5, 0.1, 0.4
    assert sink_check([strong, weak], torch.tensor([0]))["weak"] is False
    assert sink_check([weak, weak, strong], torch.tensor([0]))["weak"] is True


def test_block_stability_keeps_the_label_the_head_is_shown_with():
    """The dropped partial block can hold the votes that decide the head's label: the block
    bootstrap then counts every resample as a change, not as a stable other label."""
    import dataclasses

    case = make_case(113, batch=1, n_pos=300, n_heads=1, n_kv=1, d=3)
    result = _run(case, "numba")
    blocks = torch.zeros(1, 8, 1, 1, 3, dtype=torch.int32)
    blocks[0, :, 0, 0] = torch.tensor([100, 0, 28], dtype=torch.int32)  # 8 full blocks voting "current"
    counts = result.vote_counts.clone()
    counts[0, 0] = torch.tensor([800.0, 0, 1000.0])  # … but the head's label is Reset
    votes = counts.to(torch.int32)[None]
    changed = dataclasses.replace(result, block_votes=blocks, vote_counts=counts, sequence_votes=votes)
    assert changed.labels[0][0] == "Reset" and float(changed.label_stability[0, 0]) == 0.0


def test_queries_of_one_position_keep_r_16_and_a_negative_seed_samples():
    from tl_geometry.engine.options import check_options

    assert check_options(queries=1).random_samples == check_options(queries=[5]).random_samples == 16
    assert check_options(random_samples=32).shuffle_samples == 32
    case = make_case(114, batch=1, n_pos=12)
    assert torch.isfinite(_run(case, "numba", queries=4, seed=-3).f_score).any()
