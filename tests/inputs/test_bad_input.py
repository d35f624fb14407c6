"""Bad input to ``analyze_heads``: every one gets a clear error (or a documented NaN / warning).

Each error test checks, through :func:`expect_error`:

* the exception type: ``tl_geometry.CacheError`` (a ``ValueError``) for cache problems,
  ``ValueError`` / ``TypeError`` for bad options, never a raw ``RuntimeError`` /
  ``IndexError`` / ``KeyError`` / ``AttributeError`` from deep inside torch;
* that it is raised by tl_geometry itself (the last traceback frame is in the package);
* a distinctive part of the message that names the problem and, where there is one, the fix.

Inputs the toolkit must *accept* (half precision, NaN rows at padded queries with the right
mask, ``remove_batch_dim`` caches, ...) are checked too, and no call may write to the
caller's tensors.

pyproject's ``--jaxtyping-packages=...,beartype.beartype`` wraps tl_geometry functions in a
beartype check under pytest only; a bad *type* reaching a wrapped function would fail there
(``jaxtyping.TypeCheckError``) before tl_geometry's own checks run. Users never run with that
hook, so this file switches it off (``jaxtyping_disable``) and tests the errors users get.
"""

from __future__ import annotations

import copy
import inspect
import re
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import jaxtyping
import pytest
import torch
from cases import make_case

import tl_geometry
from tl_geometry import CacheError

P0, V0 = "blocks.0.attn.hook_pattern", "blocks.0.attn.hook_v"
PACKAGE_DIR = Path(tl_geometry.__file__).resolve().parent
RAW = (RuntimeError, IndexError, KeyError, AttributeError, NotImplementedError, AssertionError)
FAST = {"n_values": (1, 2), "random_samples": 2}


@pytest.fixture(autouse=True)
def _as_users_run_it(monkeypatch):
    """No pytest-only runtime type checking (see the module docstring); restored after each test."""
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)


def analyze(cache, **kwargs):
    return tl_geometry.analyze_heads(cache, **{**FAST, **kwargs})


def expect_error(
    call: Callable[[], object],
    *match: str,
    kind: type[Exception] | tuple[type[Exception], ...] = CacheError,
) -> Exception:
    """Run ``call``; it must raise ``kind`` from tl_geometry code with every ``match`` regex in
    its message. Every failure is an ``AssertionError``."""
    try:
        call()
    except Exception as exc:
        err = exc
    else:
        raise AssertionError(f"no error raised (expected {kind} matching {match})")
    described = f"{type(err).__name__}: {err}"
    assert not isinstance(err, RAW), f"raw error instead of a clear one: {described}"
    assert isinstance(err, kind), f"expected {kind}, got {described}"
    frame = traceback.extract_tb(err.__traceback__)[-1]
    assert PACKAGE_DIR in Path(frame.filename).resolve().parents, (
        f"raised outside tl_geometry ({frame.filename}:{frame.lineno}): {described}"
    )
    for pattern in match:
        assert re.search(pattern, str(err)), f"message does not match {pattern!r}: {described}"
    return err


def layer_cache(pattern, v, layer: int = 0) -> dict[str, torch.Tensor]:
    return {f"blocks.{layer}.attn.hook_pattern": pattern, f"blocks.{layer}.attn.hook_v": v}


@pytest.fixture(scope="module")
def case():
    return make_case(0)  # batch 2, 4 heads, 2 KV heads, 12 positions, d 5, float32


@pytest.fixture(scope="module")
def left():
    return make_case(2, padding="left")  # NaN pattern rows at the padded queries


def test_cache_error_is_a_value_error():
    assert issubclass(CacheError, ValueError)


# --- the cache: hooks, layers, object type ---------------------------------------------------


def test_names_filter_dropped_hook_v(case):
    expect_error(
        lambda: analyze({P0: case.pattern}),
        r"missing blocks\.0\.attn\.hook_v",
        "CACHE_NAMES_FILTER",
    )


def test_names_filter_dropped_hook_v_of_one_layer(case):
    cache = {**case.cache(0), "blocks.1.attn.hook_pattern": case.pattern}
    expect_error(lambda: analyze(cache), r"missing blocks\.1\.attn\.hook_v", "CACHE_NAMES_FILTER")


@pytest.mark.parametrize(
    "keys",
    [
        pytest.param((V0,), id="only-v"),
        pytest.param((), id="empty"),
        pytest.param(("blocks.0.attn.hook_attn_scores",), id="scores"),
    ],
)
def test_cache_without_any_pattern(case, keys):
    cache = dict.fromkeys(keys, case.v)
    expect_error(
        lambda: analyze(cache),
        r"holds no 'blocks\.\{l\}\.attn\.hook_pattern'",
        "CACHE_NAMES_FILTER",
    )


@pytest.mark.parametrize(
    "obj", [None, 3, "blocks.0.attn.hook_pattern", [1, 2]], ids=["None", "int", "str", "list"]
)
def test_cache_not_a_mapping(obj):
    expect_error(
        lambda: analyze(obj),
        "Expected a TransformerLens ActivationCache or a dict",
        "CACHE_NAMES_FILTER",
    )


def test_cache_is_a_bare_tensor(case):
    expect_error(lambda: analyze(case.pattern), "got Tensor", "ActivationCache or a dict")


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda c: {P0: None, V0: c.v}, id="pattern-None"),
        pytest.param(lambda c: {P0: "pattern", V0: c.v}, id="pattern-str"),
        pytest.param(lambda c: {P0: c.pattern, V0: c.v.numpy()}, id="v-numpy"),
    ],
)
def test_hook_is_not_a_tensor(case, make):
    expect_error(lambda: analyze(make(case)), "must be torch tensors")


def test_layer_not_in_cache(case):
    expect_error(
        lambda: analyze(case.cache(), layers=[5]),
        r"missing blocks\.5\.attn\.hook_pattern, blocks\.5\.attn\.hook_v",
        "CACHE_NAMES_FILTER",
    )


def test_duplicate_layers(case):
    expect_error(lambda: analyze(case.cache(), layers=[0, 0]), r"layers has duplicates: \[0, 0\]")


def test_empty_layers(case):
    expect_error(lambda: analyze(case.cache(), layers=[]), "layers is empty", "pass None")


@pytest.mark.parametrize(
    "layers", [0, ["x"], [None], [0.5]], ids=["int", "str-item", "None-item", "float"]
)
def test_layers_of_the_wrong_type(case, layers):
    expect_error(
        lambda: analyze(case.cache(), layers=layers), "layers", kind=(ValueError, TypeError)
    )


# --- shapes -------------------------------------------------------------------------------


def test_heads_not_a_multiple_of_kv_heads(case):
    v = torch.randn(2, 12, 3, 5)
    expect_error(
        lambda: analyze(layer_cache(case.pattern, v)),
        "4 query heads",
        "3 KV heads",
        "multiple of the KV heads",
    )


def test_zero_kv_heads(case):
    expect_error(lambda: analyze(layer_cache(case.pattern, case.v[:, :, :0])), "0 KV heads")


def test_positions_differ_between_pattern_and_v(case):
    expect_error(
        lambda: analyze(layer_cache(case.pattern, case.v[:, :11])),
        r"hook_v has shape \(2, 11, 2, 5\)",
        "positions must agree",
        "different runs",
    )


def test_batch_differs_between_pattern_and_v(case):
    expect_error(
        lambda: analyze(layer_cache(case.pattern, case.v[:1])),
        r"hook_v has shape \(1, 12, 2, 5\)",
        "batch and positions must agree",
    )


def test_query_and_key_positions_differ(case):
    """A pattern cached during generation with a KV cache has one query row."""
    expect_error(
        lambda: analyze(layer_cache(case.pattern[:, :, -1:], case.v)),
        "1 query and 12 key positions",
        "KV cache",
        "run_with_cache",
    )


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: p[0, 0], id="2d"),
        pytest.param(lambda p: p[None], id="5d"),
    ],
)
def test_pattern_of_the_wrong_rank(case, make):
    expect_error(
        lambda: analyze(layer_cache(make(case.pattern), case.v)),
        r"hook_pattern has shape",
        r"expected \[batch, head, query_pos, key_pos\]",
    )


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda v: v[0, :, 0], id="2d"),
        pytest.param(lambda v: v.flatten(2), id="3d-heads-merged"),
        pytest.param(lambda v: v[None], id="5d"),
    ],
)
def test_v_of_the_wrong_rank(case, make):
    expect_error(
        lambda: analyze(layer_cache(case.pattern, make(case.v))),
        r"hook_v has shape",
        r"expected \[batch, pos, kv_head, d_head\]",
    )


def test_3d_pattern_with_4d_v(case):
    expect_error(
        lambda: analyze(layer_cache(case.pattern[0], case.v)),
        r"hook_pattern has shape \(4, 12, 12\)",
    )


@pytest.mark.parametrize(
    "other",
    [
        pytest.param({"n_pos": 10}, id="n_pos"),
        pytest.param({"batch": 3}, id="batch"),
        pytest.param({"n_heads": 2, "n_kv": 1}, id="heads"),
    ],
)
def test_layers_whose_shapes_disagree(case, other):
    cache = {**case.cache(0), **make_case(1, **other).cache(1)}
    expect_error(lambda: analyze(cache), "Layer 1's pattern is", "layers of one cache must agree")


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda c: layer_cache(c.pattern[:0], c.v[:0]), id="batch-0"),
        pytest.param(lambda c: layer_cache(c.pattern[:, :, :0, :0], c.v[:, :0]), id="positions-0"),
    ],
)
def test_empty_cache(case, make):
    expect_error(lambda: analyze(make(case)), "is empty", "nothing to analyse")


# --- dtypes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64], ids=str
)
def test_non_float_pattern(case, dtype):
    pattern = (case.pattern * 100).to(dtype)
    expect_error(
        lambda: analyze(layer_cache(pattern, case.v)),
        rf"hook_pattern has dtype {dtype}",
        "expected a floating-point tensor",
    )


def test_integer_v(case):
    expect_error(
        lambda: analyze(layer_cache(case.pattern, case.v.round().long())),
        r"hook_v has dtype torch\.int64",
        "floating-point",
    )


@pytest.mark.parametrize(
    "seed,dtype,options,kwargs",
    [
        pytest.param(5, torch.float16, {"n_heads": 6, "n_kv": 3}, {}, id="fp16-gqa"),
        pytest.param(
            6,
            torch.bfloat16,
            {"padding": "left"},
            {"queries": "all", "rank_by": "contribution"},
            id="bf16-left-padded-all-contribution",
        ),
        pytest.param(
            7,
            torch.float16,
            {"padding": "right", "sink": True},
            {"queries": "all", "distance": "cosine"},
            id="fp16-right-padded-all-cosine",
        ),
        pytest.param(
            8,
            torch.bfloat16,
            {"n_kv": 1, "ties": True},
            {"rank_by": "contribution"},
            id="bf16-mqa-ties",
        ),
    ],
)
def test_half_precision_equals_float32_of_the_same_values(seed, dtype, options, kwargs):
    half = make_case(seed, dtype=dtype, **options)
    assert half.pattern.dtype == dtype and half.v.dtype == dtype
    upcast = layer_cache(half.pattern.float(), half.v.float())
    run = dict(
        n_values=(1, 2, 3, 5), random_samples=3, attention_mask=half.attention_mask, **kwargs
    )
    got = tl_geometry.analyze_heads(half.cache(), **run)
    want = tl_geometry.analyze_heads(upcast, **run)
    assert torch.isfinite(got.f_score[..., 1]).all()
    for name in ("scores", "group_counts", "sink", "vote_counts"):
        torch.testing.assert_close(
            getattr(got, name), getattr(want, name), rtol=0, atol=1e-6, equal_nan=True, msg=name
        )


def test_unusual_but_valid_inputs_are_accepted(case):
    """float64, remove_batch_dim (3-D), requires_grad, non-contiguous views: no error."""
    variants = {
        "float64": layer_cache(case.pattern.double(), case.v.double()),
        "3d": layer_cache(case.pattern[0], case.v[0]),
        "grad": layer_cache(case.pattern.clone().requires_grad_(), case.v.clone().requires_grad_()),
        "strided": layer_cache(
            case.pattern.transpose(-1, -2).contiguous().transpose(-1, -2),
            case.v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3),
        ),
        "mixed dtypes": layer_cache(case.pattern.half(), case.v.double()),
    }
    base = analyze(case.cache())
    for name, cache in variants.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            result = analyze(cache)
        assert torch.isfinite(result.f_score).all(), name
        if name in ("grad", "strided", "float64"):
            torch.testing.assert_close(result.scores, base.scores, equal_nan=True, msg=name)


# --- n_values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n_values",
    [(0,), (-1, 2), (2.5,), (True,), (), (2, "4")],
    ids=["zero", "negative", "float", "bool", "empty", "str"],
)
def test_n_values_out_of_range(case, n_values):
    expect_error(
        lambda: tl_geometry.analyze_heads(case.cache(), n_values=n_values),
        "n_values must be positive ints",
        kind=ValueError,
    )


def test_n_values_duplicates(case):
    expect_error(
        lambda: tl_geometry.analyze_heads(case.cache(), n_values=(2, 4, 2)),
        r"n_values has duplicates",
        kind=ValueError,
    )


def test_n_values_none(case):
    expect_error(
        lambda: tl_geometry.analyze_heads(case.cache(), n_values=None),
        "n_values",
        kind=(ValueError, TypeError),
    )


def test_n_larger_than_the_sequence_is_nan_with_a_warning():
    """Documented: a size N ≥ number of keys gives NaN metrics and a UserWarning."""
    small = make_case(50, n_pos=6)
    with pytest.warns(UserWarning, match=r"N = \[6, 9\] cannot be evaluated on 6-position"):
        result = tl_geometry.analyze_heads(small.cache(), n_values=(2, 6, 9), random_samples=2)
    assert torch.isfinite(result.f_score[..., 0]).all()
    assert torch.isnan(result.f_score[..., 1:]).all()
    assert torch.isnan(result.random_f_score[..., 1:]).all()


def test_n_too_large_for_the_short_sequence_only_is_nan_for_it():
    """Padded batch: N = 8 fits the long sequence (12) but not the short one (6): no warning, the
    mean is over the sequences that can hold N."""
    padded = make_case(3, padding="right")
    assert padded.attention_mask.sum(-1).tolist() == [6, 12]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        both = tl_geometry.analyze_heads(
            padded.cache(), n_values=(8,), random_samples=2, attention_mask=padded.attention_mask
        )
    assert torch.isfinite(both.f_score).all()
    assert (both.group_counts[0, ..., 0] == 1).all()  # one sequence behind each mean


# --- attention_mask ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda m: m[:, 1:], id="short"),
        pytest.param(lambda m: m.T, id="transposed"),
        pytest.param(lambda m: m[0], id="1d"),
        pytest.param(lambda m: m[:, None], id="3d"),
        pytest.param(lambda m: m[:1], id="one-row"),
    ],
)
def test_attention_mask_of_the_wrong_shape(left, make):
    expect_error(
        lambda: analyze(left.cache(), attention_mask=make(left.attention_mask)),
        "attention_mask has shape",
        r"expected \[batch, pos\] = \[2, 12\]",
    )


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda m: m * 2, id="two"),
        pytest.param(lambda m: m - 1, id="minus-one"),
        pytest.param(lambda m: m.float() * 0.5, id="half"),
        pytest.param(lambda m: m.float().masked_fill(m == 0, float("nan")), id="nan"),
    ],
)
def test_attention_mask_not_zero_one(left, make):
    expect_error(
        lambda: analyze(left.cache(), attention_mask=make(left.attention_mask)),
        r"attention_mask must hold only 0 \(padding\) and 1 \(real token\)",
    )


def test_attention_mask_row_all_padding(left):
    mask = left.attention_mask.clone()
    mask[1] = 0
    expect_error(
        lambda: analyze(left.cache(), attention_mask=mask),
        r"marks every position of sequence\(s\) \[1\] as padding",
    )


def test_attention_mask_that_does_not_match_the_pattern(left):
    """The pattern of an unpadded run attends to keys this (left-padding) mask calls padding."""
    unpadded = make_case(3)
    expect_error(
        lambda: analyze(unpadded.cache(), attention_mask=left.attention_mask),
        r"puts attention mass [\d.]+ on padding",
        "the forward pass did not mask them",
        r"Pass the same attention_mask to the model \(run_with_cache",
    )


def test_attention_mask_marks_padded_queries_as_real(left):
    """Right-padding mask on a left-padded pattern: the NaN rows are at 'real' queries."""
    wrong = left.attention_mask.flip(-1)
    expect_error(
        lambda: analyze(left.cache(), attention_mask=wrong),
        "NaN/inf entries at real positions",
        "Check that attention_mask is the one the model was run with",
    )


def test_attention_mask_as_list_and_bool_are_accepted(left):
    want = analyze(left.cache(), attention_mask=left.attention_mask)
    for mask in (
        left.attention_mask.tolist(),
        left.attention_mask.bool(),
        left.attention_mask.float(),
    ):
        got = analyze(left.cache(), attention_mask=mask)
        torch.testing.assert_close(got.scores, want.scores, equal_nan=True)


# --- NaN / inf / non-probabilities in the pattern and v -------------------------------------


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"]
)
def test_non_finite_pattern_at_a_real_position(case, value):
    pattern = case.pattern.clone()
    pattern[1, 2, 5, 3] = value
    expect_error(
        lambda: analyze(layer_cache(pattern, case.v)),
        r"1 NaN/inf entries at real positions \(first at batch 1, head 2, query 5, key 3\)",
        "pass attention_mask",
        "float32 instead of float16",
    )


def test_padded_batch_with_nan_rows_and_no_mask(left):
    assert torch.isnan(left.pattern).any()
    expect_error(
        lambda: analyze(left.cache()),
        "NaN/inf entries at real positions",
        "With a padded batch pass attention_mask",
    )


@pytest.mark.parametrize(
    "padding,queries,dtype",
    [
        ("left", "last", torch.float32),
        ("right", "all", torch.float32),
        ("left", "all", torch.float16),
        ("right", "last", torch.bfloat16),
    ],
    ids=["left-last-fp32", "right-all-fp32", "left-all-fp16", "right-last-bf16"],
)
def test_nan_rows_at_padded_queries_with_the_mask_are_accepted(padding, queries, dtype):
    padded = make_case(12, padding=padding, dtype=dtype, batch=3)
    pattern = padded.pattern.clone()
    pad_queries = ~padded.attention_mask.bool()
    pattern.masked_fill_(pad_queries[:, None, :, None], float("nan"))  # every padded row NaN
    assert torch.isnan(pattern).any()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        result = analyze(
            layer_cache(pattern, padded.v), attention_mask=padded.attention_mask, queries=queries
        )
    for name in ("f_score", "random_f_score", "sink_removed_f_score", "margin"):
        assert torch.isfinite(getattr(result, name)[..., 1]).all(), name
    assert torch.isfinite(result.sink_mass).all() and torch.isfinite(result.vote_fractions).all()


def test_nan_in_v_at_a_padded_position_with_the_mask_is_accepted(left):
    v = left.v.clone()
    v[~left.attention_mask.bool()] = float("nan")
    result = analyze(layer_cache(left.pattern, v), attention_mask=left.attention_mask)
    assert torch.isfinite(result.f_score).all() and torch.isfinite(result.sink_mass).all()


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_v_at_a_real_position(case, value):
    v = case.v.clone()
    v[1, 4, 0, 2] = value
    expect_error(
        lambda: analyze(layer_cache(case.pattern, v)),
        r"hook_v has 1 NaN/inf entries at real positions",
    )


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: p.transpose(-1, -2), id="transposed"),
        pytest.param(
            lambda p: torch.softmax(
                torch.randn(p.shape, generator=torch.Generator().manual_seed(0)), -1
            ),
            id="bidirectional",
        ),
        pytest.param(
            lambda p: (
                torch.randn(p.shape, generator=torch.Generator().manual_seed(0))
                .abs()
                .masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), -torch.inf)
            ),
            id="scores-minus-inf",
        ),
    ],
)
def test_non_causal_pattern(case, make):
    expect_error(
        lambda: analyze(layer_cache(make(case.pattern), case.v)),
        r"puts attention mass \S+ on future keys",
        r"\[batch, head, query_pos, key_pos\]",
    )


def test_negative_pattern(case):
    """Pre-softmax scores (causally masked with 0) instead of probabilities."""
    scores = torch.randn(case.pattern.shape, generator=torch.Generator().manual_seed(1)).tril()
    expect_error(
        lambda: analyze(layer_cache(scores, case.v)), "negative entries", "attention probabilities"
    )


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda p: torch.softmax(
                torch.randn(p.shape, generator=torch.Generator().manual_seed(0)).masked_fill(
                    ~torch.ones(12, 12, dtype=torch.bool).tril(), -torch.inf
                ),
                dim=-2,
            ),
            id="softmax-over-queries",
        ),
        pytest.param(lambda p: p * 3, id="scaled"),
    ],
)
def test_pattern_rows_summing_to_more_than_one(case, make):
    pattern = make(case.pattern)
    if not pattern.sum(-1).amax() > 1.5:
        pytest.fail("test input does not have a row summing to more than 1.5")
    expect_error(lambda: analyze(layer_cache(pattern, case.v)), r"(?i)sum|normali[sz]|probabilit")


# --- padding without a mask --------------------------------------------------------------


def test_padded_batch_without_mask_warns(left):
    """Zero (not NaN) rows at padded queries: accepted, with a warning naming attention_mask."""
    zeroed = left.pattern.nan_to_num()
    with pytest.warns(
        UserWarning, match=r"36 query rows with no attention mass.*pass attention_mask"
    ):
        analyze(layer_cache(zeroed, left.v))


def test_no_padding_warning_for_an_unpadded_batch(case):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        analyze(case.cache())


# --- options ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"queries": "first"}, r"queries must be 'last' \(paper protocol\), 'all', an int k ≥ 1 .*got 'first'"),
        ({"distance": "l1"}, r"distance must be 'euclidean' or 'cosine', got 'l1'"),
        ({"space": "logit"}, r"space must be 'value' .* or 'output' .*got 'logit'"),
        ({"rank_by": "x"}, r"rank_by must be 'attention' or 'contribution', got 'x'"),
        ({"random_samples": -3}, r"random_samples must be a non-negative int .*got -3"),
        ({"random_samples": 2.0}, r"random_samples must be a non-negative int .*got 2\.0"),
        ({"random_samples": True}, r"random_samples must be a non-negative int .*got True"),
        ({"bounds": "yes"}, r"bounds must be True or False, got 'yes'"),
        ({"backend": "cuda"}, r"backend must be 'auto', 'numba' or 'torch', got 'cuda'"),
    ],
    ids=[
        "queries",
        "distance",
        "space",
        "rank_by",
        "samples-neg",
        "samples-float",
        "samples-bool",
        "bounds-str",
        "backend",
    ],
)
def test_bad_option(case, kwargs, match):
    expect_error(
        lambda: tl_geometry.analyze_heads(case.cache(), **{"n_values": (2,), **kwargs}),
        match,
        kind=ValueError,
    )


def test_bad_option_is_reported_before_reading_the_cache():
    expect_error(
        lambda: tl_geometry.analyze_heads(None, queries="first"), "queries must be", kind=ValueError
    )


@pytest.mark.parametrize("model", [None, object()], ids=["no-model", "model-without-W_O"])
def test_output_space_without_W_O(case, model):
    expect_error(
        lambda: analyze(case.cache(), space="output", model=model),
        r"space='output' needs the output projections",
        r"W_O=model\.W_O",
        kind=ValueError,
    )


@pytest.mark.parametrize(
    "W_O,match",
    [
        pytest.param(
            torch.randn(4, 5, 7), r"W_O must be \[layer, head, d_head, d_model\]", id="3d"
        ),
        pytest.param(
            torch.randn(1, 3, 5, 7),
            r"W_O of layer 0 is \(3, 5, 7\); expected \[4, 5, d_model\]",
            id="heads",
        ),
        pytest.param(
            torch.randn(1, 4, 6, 7),
            r"W_O of layer 0 is \(4, 6, 7\); expected \[4, 5, d_model\]",
            id="d_head",
        ),
    ],
)
def test_output_space_with_W_O_of_the_wrong_shape(case, W_O, match):
    expect_error(lambda: analyze(case.cache(), space="output", W_O=W_O), match, kind=ValueError)


def test_output_space_with_W_O_not_covering_the_layer(case):
    expect_error(
        lambda: analyze(case.cache(3), space="output", W_O=torch.randn(2, 4, 5, 7)),
        r"covering layer 3",
        kind=ValueError,
    )


@pytest.mark.parametrize(
    "convert", [lambda w: w.numpy(), lambda w: w.tolist()], ids=["numpy", "list"]
)
def test_output_space_with_W_O_not_a_tensor(case, convert):
    W_O = convert(torch.randn(1, 4, 5, 7))
    expect_error(
        lambda: analyze(case.cache(), space="output", W_O=W_O), "W_O", kind=(ValueError, TypeError)
    )


def test_output_space_with_nan_in_W_O(case):
    W_O = torch.randn(1, 4, 5, 7)
    W_O[0, 1, 2, 3] = float("nan")
    expect_error(
        lambda: analyze(case.cache(), space="output", W_O=W_O), "W_O", "NaN", kind=ValueError
    )


@pytest.mark.parametrize("seed", [2.5, None, "1"], ids=["float", "None", "str"])
def test_seed_of_the_wrong_type(case, seed):
    expect_error(lambda: analyze(case.cache(), seed=seed), "seed", kind=(ValueError, TypeError))


# --- the caller's cache is never written to -------------------------------------------------


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``x`` (NaN payloads included) as an integer tensor."""
    if not x.is_floating_point():
        return x
    return (
        x.detach()
        .contiguous()
        .view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    )


def _snapshot(mapping):
    return {
        k: (v, copy.deepcopy(v), v.dtype, v.shape, v.stride(), v.requires_grad)
        for k, v in mapping.items()
    }


def _assert_unchanged(mapping, snapshot):
    assert list(mapping.keys()) == list(snapshot.keys())
    for key, (obj, before, dtype, shape, stride, grad) in snapshot.items():
        now = mapping[key]
        assert now is obj, key
        assert (now.dtype, now.shape, now.stride(), now.requires_grad) == (
            dtype,
            shape,
            stride,
            grad,
        ), key
        assert torch.equal(_bits(now), _bits(before)), f"{key} was modified"


def _mutation_inputs():
    fp32 = make_case(60, batch=3)
    fp16 = make_case(61, dtype=torch.float16, n_heads=6, n_kv=3)
    bf16 = make_case(62, dtype=torch.bfloat16, padding="left")
    padded = make_case(63, padding="left", batch=3)
    right = make_case(64, padding="right", sink=True)
    W_O = torch.randn(2, 4, 5, 7, generator=torch.Generator().manual_seed(65))
    out = make_case(66, n_kv=2)
    return [
        pytest.param(
            {**fp32.cache(0), **make_case(67, batch=3).cache(1)}, {}, id="fp32-two-layers"
        ),
        pytest.param(fp16.cache(), {"queries": "all"}, id="fp16"),
        pytest.param(
            bf16.cache(), {"attention_mask": bf16.attention_mask}, id="bf16-padded-nan-rows"
        ),
        pytest.param(
            padded.cache(),
            {"attention_mask": padded.attention_mask, "queries": "all", "rank_by": "contribution"},
            id="fp32-padded-nan-rows",
        ),
        pytest.param(
            right.cache(),
            {"attention_mask": right.attention_mask.bool(), "distance": "cosine"},
            id="right-padded-bool-mask",
        ),
        pytest.param(
            out.cache(1), {"space": "output", "W_O": W_O, "queries": "all"}, id="output-W_O"
        ),
        pytest.param(
            layer_cache(fp32.pattern.clone().requires_grad_(), fp32.v.clone().requires_grad_()),
            {},
            id="requires-grad",
        ),
    ]


@pytest.mark.parametrize("cache,kwargs", _mutation_inputs())
def test_caller_cache_is_not_mutated(cache, kwargs):
    extra = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    cache_before, extra_before = _snapshot(cache), _snapshot(extra)
    result = analyze(cache, **kwargs)
    assert torch.isfinite(result.f_score[..., 1]).any()
    _assert_unchanged(cache, cache_before)
    _assert_unchanged(extra, extra_before)


@pytest.mark.parametrize("where", ["pattern", "v"])
def test_caller_cache_is_not_mutated_on_error(left, where):
    pattern, v = left.pattern.clone(), left.v.clone()
    if where == "pattern":
        pattern[1, 0, 11, 11] = float("nan")
    else:
        v[1, 11, 0, 0] = float("nan")
    cache = layer_cache(pattern, v)
    mask = left.attention_mask.clone()
    before, mask_before = _snapshot(cache), _snapshot({"mask": mask})
    expect_error(lambda: analyze(cache, attention_mask=mask), "NaN/inf entries at real positions")
    _assert_unchanged(cache, before)
    _assert_unchanged({"mask": mask}, mask_before)


def _activation_cache(cache_dict):
    """``transformer_lens.ActivationCache(cache_dict, model=None)``: in TransformerLens 4.3 the
    signature is ``(cache_dict, model, has_batch_dim=True)`` and ``model`` is only stored."""
    ActivationCache = pytest.importorskip("transformer_lens").ActivationCache
    assert "cache_dict" in inspect.signature(ActivationCache.__init__).parameters
    try:
        return ActivationCache(cache_dict, model=None)
    except Exception as exc:
        pytest.skip(f"this TransformerLens' ActivationCache needs a real model: {exc!r}")


@pytest.mark.parametrize(
    "dtype,padding",
    [(torch.float32, None), (torch.float16, "left")],
    ids=["fp32", "fp16-padded-nan-rows"],
)
def test_activation_cache_is_not_mutated_and_matches_the_dict(dtype, padding):
    source = make_case(70, dtype=dtype, padding=padding)
    cache_dict = {**source.cache(0), **source.cache(2)}
    activation_cache = _activation_cache(cache_dict)
    before = _snapshot(cache_dict)
    keys = list(activation_cache.keys())
    got = analyze(activation_cache, attention_mask=source.attention_mask)
    _assert_unchanged(cache_dict, before)
    assert list(activation_cache.keys()) == keys
    assert got.layers == (0, 2) and got.metadata["cache_type"] == "ActivationCache"
    want = analyze(dict(cache_dict), attention_mask=source.attention_mask)
    torch.testing.assert_close(got.scores, want.scores, equal_nan=True)


def test_activation_cache_missing_hook_v():
    source = make_case(72)
    activation_cache = _activation_cache({P0: source.pattern})
    expect_error(
        lambda: analyze(activation_cache), r"missing blocks\.0\.attn\.hook_v", "CACHE_NAMES_FILTER"
    )
