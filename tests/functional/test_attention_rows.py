"""Attention rows recomputed from q and k (``functional.attention``) against a slow reference.

The reference loops over sequences, heads and queries and writes the softmax of each row out
in plain float64 arithmetic: causal mask, sliding window, padding, GQA grouping, softcapping
and an attention-sink logit in the denominator.
"""

from __future__ import annotations

import math

import pytest
import torch

from tl_geometry.functional import (
    NO_QUERY,
    attention_row_block,
    attention_row_blocks,
    attention_rows,
    visible_keys,
)
from tl_geometry.functional.attention import _validate


def _reference_row(q, k, b, h, t, *, scale, window=None, softcap=None, sinks=None, key_mask=None):
    """One row ``α_t·`` of head ``h`` in sequence ``b``, written out key by key."""
    n_pos, n_heads, n_kv = k.shape[1], q.shape[2], k.shape[2]
    n = h // (n_heads // n_kv)
    logits = {}
    for i in range(n_pos):
        if i > t or (window is not None and i <= t - window):
            continue
        if key_mask is not None and not key_mask[b, i]:
            continue
        x = scale * sum(float(q[b, t, h, j]) * float(k[b, i, n, j]) for j in range(q.shape[3]))
        if softcap is not None:
            x = softcap * math.tanh(x / softcap)
        logits[i] = x
    extra = [float(sinks[h])] if sinks is not None else []
    if not logits and not extra:
        return [math.nan] * n_pos
    peak = max([*logits.values(), *extra])
    denominator = sum(math.exp(x - peak) for x in [*logits.values(), *extra])
    return [math.exp(logits[i] - peak) / denominator if i in logits else 0.0 for i in range(n_pos)]


def _reference(q, k, queries, **kwargs):
    batch, n_query = queries.shape
    out = torch.full((batch, q.shape[2], n_query, k.shape[1]), math.nan, dtype=torch.float64)
    for b in range(batch):
        for h in range(q.shape[2]):
            for j in range(n_query):
                t = int(queries[b, j])
                if t >= 0:
                    out[b, h, j] = torch.tensor(_reference_row(q, k, b, h, t, **kwargs), dtype=torch.float64)
    return out


def _qk(seed=0, batch=2, n_pos=7, n_heads=6, n_kv=2, d=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_pos, n_heads, d, generator=g).to(dtype)
    k = torch.randn(batch, n_pos, n_kv, d, generator=g).to(dtype)
    return q, k


CASES = {
    "plain": {},
    "window": {"window": 3},
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": torch.tensor([0.0, 2.0, -1.0, 5.0, 0.5, -3.0])},
    "padding": {"key_mask": torch.tensor([[False, False, True, True, True, True, True]] * 2)},
    "everything": {"window": 2, "softcap": 0.7, "sinks": torch.linspace(-2, 2, 6),
                   "key_mask": torch.tensor([[True] * 7, [False] + [True] * 6])},
}


@pytest.mark.parametrize("case", CASES)
def test_rows_match_the_reference(case):
    q, k = _qk()
    kwargs = {"scale": 0.6, **CASES[case]}
    queries = torch.tensor([[6, 0, 3, -1], [2, 2, 5, 1]])
    rows = attention_rows(q, k, queries, **kwargs)
    assert rows.dtype == torch.float64 and rows.shape == (2, 6, 4, 7)
    torch.testing.assert_close(rows, _reference(q, k, queries, **kwargs), rtol=1e-12, atol=1e-12,
                               equal_nan=True)


def test_no_query_rows_are_nan_and_a_masked_out_row_is_nan_or_all_sink():
    q, k = _qk(n_heads=2, n_kv=1)
    queries = torch.tensor([[-1, 1], [-1, 1]])
    mask = torch.tensor([[False, False, True, True, True, True, True]] * 2)
    rows = attention_rows(q, k, queries, scale=1.0, key_mask=mask)
    assert math.isnan(NO_QUERY) and rows.isnan().all()
    with_sinks = attention_rows(q, k, queries, scale=1.0, key_mask=mask, sinks=torch.zeros(2))
    assert with_sinks[:, :, 0].isnan().all() and (with_sinks[:, :, 1] == 0).all()


@pytest.mark.parametrize("seed", range(5))
def test_properties_sum_gqa_and_masks(seed):
    q, k = _qk(seed, n_pos=9)
    everything = torch.arange(9).expand(2, -1)
    rows = attention_rows(q, k, everything, scale=0.3)
    torch.testing.assert_close(rows.sum(-1), torch.ones(2, 6, 9, dtype=torch.float64))
    assert (rows.triu(1) == 0).all()  # causal
    # GQA: the same as repeating each KV head for its query heads.
    repeated = k.repeat_interleave(3, dim=2)
    torch.testing.assert_close(rows, attention_rows(q, repeated, everything, scale=0.3),
                               rtol=0, atol=1e-14)
    # The full pattern's softmax, written with one matrix product.
    full = torch.einsum("bthd,bihd->bhti", q.double(), repeated.double()) * 0.3
    full = full.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), -torch.inf).softmax(-1)
    torch.testing.assert_close(rows, full, rtol=0, atol=1e-14)
    # A window of 2 keeps the query and the key before it, and renormalises over them.
    windowed = attention_rows(q, k, everything, scale=0.3, window=2)
    assert (windowed.tril(-2) == 0).all()
    # Sinks take mass away from the keys and nothing else: rows are the plain rows × (1 − sink).
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(seed))
    sunk = attention_rows(q, k, everything, scale=0.3, sinks=sinks)
    kept = sunk.sum(-1, keepdim=True)
    assert ((kept > 0) & (kept < 1)).all()
    torch.testing.assert_close(sunk / kept, rows, rtol=0, atol=1e-13)


def test_blocks_cover_every_query_once_and_equal_the_rows():
    q, k = _qk(3, n_pos=10)
    kwargs = {"scale": 0.4, "window": 4, "sinks": torch.zeros(6)}
    everything = attention_rows(q, k, torch.arange(10).expand(2, -1), **kwargs)
    starts = []
    for start, rows in attention_row_blocks(q, k, block=3, **kwargs):
        starts.append(start)
        # Only the keys a block can see are summed, so the softmax sums round in another order.
        torch.testing.assert_close(rows, everything[:, :, start:start + 3], rtol=1e-14, atol=1e-15)
        assert bool((rows == 0).eq(everything[:, :, start:start + 3] == 0).all())  # zeros stay exact
    assert starts == [0, 3, 6, 9]
    with pytest.raises(ValueError, match="block"):
        next(attention_row_blocks(q, k, block=0, scale=1.0))


def test_one_block_is_that_block_bit_for_bit():
    """``attention_row_block`` computes one block alone, exactly as ``attention_row_blocks`` does:
    the votes re-read from it settle exact ties as the whole pass would."""
    q, k = _qk(4, n_pos=11)
    kwargs = {"scale": 0.7, "window": 5}
    for start, rows in attention_row_blocks(q, k, block=4, **kwargs):
        one = attention_row_block(q, k, start, min(start + 4, 11), **kwargs)
        assert torch.equal(one, rows)
    for start, stop in [(-1, 2), (3, 3), (5, 12)]:
        with pytest.raises(ValueError, match="must lie in"):
            attention_row_block(q, k, start, stop, scale=1.0)


def test_low_precision_inputs_are_computed_in_float64_and_not_modified():
    q, k = _qk(1, dtype=torch.bfloat16)
    q_before, k_before = q.clone(), k.clone()
    queries = torch.tensor([[6, 5], [4, 3]])
    rows = attention_rows(q, k, queries, scale=0.5, softcap=2.0)
    torch.testing.assert_close(rows, _reference(q, k, queries, scale=0.5, softcap=2.0),
                               rtol=1e-12, atol=1e-12)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def test_visible_keys():
    mask = torch.tensor([[True, False, True, True]])
    got = visible_keys(torch.tensor([[3, 0, -1]]), 4, window=3, key_mask=mask)
    assert got.int().tolist() == [[[0, 0, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]]]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"queries": torch.tensor([[7]])}, "queries must lie"),
    ({"queries": torch.tensor([[-2]])}, "queries must lie"),
    ({"window": 0}, "window"),
    ({"softcap": 0.0}, "softcap"),
])
def test_bad_arguments_name_the_problem(kwargs, match):
    q, k = _qk()
    kwargs = {"queries": torch.tensor([[1]] * 2), "scale": 1.0, **kwargs}
    if kwargs["queries"].shape[0] == 1:
        kwargs["queries"] = kwargs["queries"].expand(2, -1)
    with pytest.raises(ValueError, match=match):
        attention_rows(q, k, **kwargs)


def test_sinks_need_one_logit_per_query_head():
    # Under pytest the jaxtyping shapes refuse this first; users get the ValueError.
    q, k = _qk()
    with pytest.raises(ValueError, match="one logit per query head"):
        _validate(q, k, scale=1.0, window=None, softcap=None, sinks=torch.zeros(3), key_mask=None)


def test_heads_must_be_a_multiple_of_kv_heads():
    q, k = _qk(n_heads=5, n_kv=2)
    with pytest.raises(ValueError, match="multiple"):
        attention_rows(q, k, torch.zeros(2, 1, dtype=torch.long), scale=1.0)
