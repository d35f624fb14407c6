"""No silently wrong number, no raw traceback: the cases a demanding tester found (issue 14).

Each test here failed on the 0.1 code: NaN switching validation off, contradictory masks,
coerced layer indices, degenerate shapes and dtypes, and values whose squared norms overflow.
A hypothesis fuzz over corrupted caches checks that only a ``ValueError`` (``CacheError``), a
documented NaN or a warning ever comes out, and that the caller's tensors are never modified.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from cases import make_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bad_input import expect_error, layer_cache

import tl_geometry

FAST = {"n_values": (1, 2), "random_samples": 2, "progress": False}
BACKENDS = ["numba", "torch"]


def analyze(cache, **kwargs):
    return tl_geometry.analyze_heads(cache, **{**FAST, **kwargs})


# --- 1. NaN never switches validation off ---------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_on_a_future_key_does_not_hide_a_non_causal_pattern(backend):
    case = make_case(80)
    pattern = case.pattern.clone()
    pattern[0, 0, 3, :] = 1.0  # non-causal and summing to 12
    pattern[1, 2, 5, 9] = torch.nan  # one NaN elsewhere, on a future key
    expect_error(lambda: analyze(layer_cache(pattern, case.v), backend=backend), "future keys")


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_on_a_padded_key_of_a_real_query_is_refused(backend):
    case = make_case(81, padding="left")
    pattern = case.pattern.clone()
    mask = case.attention_mask.bool()
    b = int((~mask).any(-1).nonzero()[0])
    pad = int((~mask[b]).nonzero()[0])
    pattern[b, 1, -1, pad] = torch.nan
    expect_error(lambda: analyze(layer_cache(pattern, case.v), attention_mask=case.attention_mask,
                                 backend=backend), "NaN/inf on padding")


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_sum_above_one_is_caught_next_to_nan_elsewhere(backend):
    case = make_case(82, padding="right")
    pattern = case.pattern.clone()
    pattern[0, 0, 2, :3] = 1.0  # causal, but the row sums to 3
    expect_error(lambda: analyze(layer_cache(pattern, case.v), attention_mask=case.attention_mask,
                                 backend=backend), "sums to 3")


# --- 2. contradictory masks -----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_one_position_too_long_is_refused(backend):
    """The model masked position p; the mask given here calls it real: its row holds nothing."""
    case = make_case(83, batch=1, padding="left")
    mask = case.attention_mask.clone()
    first = int(mask[0].nonzero()[0])
    pattern = case.pattern.clone().nan_to_num(0.0)  # a forward pass that zeroes masked rows
    mask[0, first - 1] = 1
    expect_error(lambda: analyze(layer_cache(pattern, case.v), attention_mask=mask, backend=backend),
                 "attention_mask calls real but that hold no attention", "mask the model was run with")


def test_mask_given_but_forward_unmasked_names_the_forward_pass():
    unpadded, left = make_case(84), make_case(84, padding="left")
    err = expect_error(lambda: analyze(unpadded.cache(), attention_mask=left.attention_mask),
                       "on padding")
    assert "Pass the same attention_mask to the model" in str(err)


def test_pad_tokens_without_a_mask_warn_and_a_correct_mask_does_not():
    class Tok:
        pad_token_id, bos_token_id = 0, 1

    class Model:
        tokenizer = Tok()

    case = make_case(85, padding="right")
    tokens = torch.randint(2, 50, case.attention_mask.shape)
    tokens[:, 0] = 1
    tokens[~case.attention_mask.bool()] = 0
    clean_pattern = case.pattern.nan_to_num(0.0)
    with pytest.warns(UserWarning, match="pad tokens .* no attention_mask"):
        analyze(layer_cache(clean_pattern, case.v), tokens=tokens, model=Model())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        analyze(case.cache(), tokens=tokens, model=Model(), attention_mask=case.attention_mask)
    expect_error(lambda: analyze(case.cache(), tokens=tokens[:, :3], model=Model()), "tokens must be")


# --- 3. layer indices validated alike ---------------------------------------------------------


@pytest.mark.parametrize("layers", [[0.7], [True], ["0"], [0, 0], [-1], 0])
def test_layer_indices_are_validated(layers):
    cache = make_case(86).cache()
    expect_error(lambda: analyze(cache, layers=layers), "layers")
    from tl_geometry.inputs.cache import check_layer_indices

    expect_error(lambda: check_layer_indices(layers, 30), "layers")


def test_numpy_layer_indices_are_accepted():
    cache = make_case(87).cache()
    assert analyze(cache, layers=[np.int64(0)]).layers == (0,)
    assert analyze(cache, layers=np.array([0])).layers == (0,)


# --- 4. degenerate shapes and dtypes ---------------------------------------------------------


def test_zero_heads_and_zero_width_values_are_refused():
    case = make_case(88)
    expect_error(lambda: analyze(layer_cache(case.pattern[:, :0], case.v)), "empty")
    expect_error(lambda: analyze(layer_cache(case.pattern, case.v[..., :0])), "d_head = 0")


def test_meta_and_float8_tensors_are_refused():
    case = make_case(89)
    expect_error(lambda: analyze(layer_cache(case.pattern.to("meta"), case.v.to("meta"))), "meta")
    if hasattr(torch, "float8_e4m3fn"):
        expect_error(lambda: analyze(layer_cache(case.pattern.to(torch.float8_e4m3fn), case.v)),
                     "floating-point tensor")


@pytest.mark.parametrize("kwargs,match", [
    ({"n_values": (2, 10**20)}, "n_values"),
    ({"bounds": "yes"}, "bounds must be True or False"),
    ({"progress": "yes"}, "progress must be"),
    ({"backend": "gpu"}, "backend must be"),
])
def test_bad_options_are_refused(kwargs, match):
    expect_error(lambda: analyze(make_case(90).cache(), **kwargs), match, kind=ValueError)


# --- 5. numeric loss ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e155, 1e-200])
def test_values_whose_squares_overflow_or_underflow_are_refused(scale):
    case = make_case(91)
    v = case.v.double() * scale
    expect_error(lambda: analyze(layer_cache(case.pattern.double(), v)), "overflow or underflow",
                 "Rescale v")


def test_moderate_rescaling_changes_no_f_score():
    case = make_case(92)
    base = analyze(case.cache())
    for scale in (1e-60, 1e60):
        scaled = analyze(layer_cache(case.pattern.double(), case.v.double() * scale))
        torch.testing.assert_close(scaled.f_score, base.f_score)
        torch.testing.assert_close(scaled.sink_norm_ratio, base.sink_norm_ratio)


def test_infinite_kappa_is_kept():
    """Every non-sink value zero: κ = ‖v_sink‖ / 0 = +∞ is the answer, not a missing value."""
    case = make_case(93, batch=1)
    v = case.v.clone()
    v[:, 1:] = 0
    result = analyze(layer_cache(case.pattern, v))
    assert torch.isinf(result.sink_norm_ratio).all()


# --- fuzz: only clear errors, documented NaN or warnings; nothing mutated ----------------------


@st.composite
def corrupted_caches(draw):
    seed = draw(st.integers(0, 10_000))
    padding = draw(st.sampled_from([None, "left", "right"]))
    case = make_case(seed, batch=draw(st.integers(1, 3)), n_pos=draw(st.integers(2, 7)),
                     n_heads=2, n_kv=draw(st.sampled_from([1, 2])), d=3, padding=padding,
                     dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.float64])))
    pattern, v = case.pattern.clone(), case.v.clone()
    mask = case.attention_mask
    for _ in range(draw(st.integers(0, 3))):
        target = draw(st.sampled_from(["pattern", "v"]))
        x = pattern if target == "pattern" else v
        index = tuple(draw(st.integers(0, n - 1)) for n in x.shape)
        x[index] = draw(st.sampled_from([float("nan"), float("inf"), -1.0, 3.0, 0.0, 1e30]))
    shape_change = draw(st.sampled_from([None, "v-batch", "pattern-query", "v-3d", "mask-len"]))
    if shape_change == "v-batch":
        v = v[:1] if v.shape[0] > 1 else torch.cat([v, v])
    elif shape_change == "pattern-query":
        pattern = pattern[:, :, :-1]
    elif shape_change == "v-3d":
        v = v.flatten(2)
    elif shape_change == "mask-len" and mask is not None:
        mask = mask[:, 1:]
    if draw(st.booleans()) and mask is not None:
        mask = mask.flip(-1)  # the wrong side
    return pattern, v, mask


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corrupted_caches(), st.sampled_from(BACKENDS), st.sampled_from(["last", "all"]))
def test_fuzzed_caches_give_clear_errors_or_numbers(data, backend, queries):
    pattern, v, mask = data
    cache = layer_cache(pattern, v)
    before = {k: x.clone() for k, x in cache.items()}
    mask_before = None if mask is None else mask.clone()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            result = analyze(cache, attention_mask=mask, backend=backend, queries=queries)
    except ValueError:  # CacheError included: the message names the problem
        pass
    else:
        # Accepted input gives numbers in their ranges, or NaN where SPEC says undefined.
        for name in ("precision", "recall", "f_score"):
            x = result.metric(name)
            assert ((x >= 0) & (x <= 1) | torch.isnan(x)).all(), name
        assert ((result.sink_mass >= 0) & (result.sink_mass <= 1.01) | torch.isnan(result.sink_mass)).all()
        assert torch.isfinite(result.vote_counts).all()
    for k, x in cache.items():
        assert torch.equal(x.nan_to_num(123.0), before[k].nan_to_num(123.0)), k
    if mask is not None:
        assert torch.equal(mask, mask_before)
