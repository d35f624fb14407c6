"""Votes of recomputed rows read from queries and keys (``engine.key_votes``): the source-winner
votes of SPEC §5 equal those of the float64 rows bit for bit, near and exact ties included, and
the fast path declines wherever its reasoning does not hold."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tl_geometry.engine import check_options, checks, key_votes
from tl_geometry.engine.backend import NUMBA, TORCH
from tl_geometry.engine.block import AttentionRows, KeyedRows, QueryKeys
from tl_geometry.engine.layer import analyze_layer
from tl_geometry.engine.options import NO_WINDOW
from tl_geometry.engine.sink_choice import check_reading
from tl_geometry.functional.attention import attention_row_blocks, attention_rows
from tl_geometry.functional.heads import sink_positions

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _rows_votes(qk: QueryKeys, is_token, sink, norms, group_size):
    """The reference: the float64 rows in blocks of ``qk.block`` queries, read by the pattern
    path's kernel."""
    blocks = attention_row_blocks(qk.q, qk.k, block=qk.block, scale=qk.scale, window=qk.window,
                                  key_mask=qk.key_mask)
    window = NO_WINDOW if qk.window is None else qk.window
    return checks.check_and_vote(blocks, is_token, sink, norms, group_size, NUMBA, window=window,
                                 reading=check_reading(is_token, qk.window, sink))


@st.composite
def layers(draw):
    """Queries, keys and value norms of one layer, with what makes votes hard: repeated keys and
    values (exact ties between categories), zero values, integer entries, padding, windows, GQA."""
    batch, n_pos = draw(st.integers(1, 2)), draw(st.integers(2, 40))
    n_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    d = draw(st.integers(1, 9))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = draw(st.sampled_from([0.05, 0.5, 3.0]))
    q = torch.randn(batch, n_pos, n_kv * group, d, generator=gen) * draw(st.sampled_from([0.1, 1.0, 8.0]))
    k = torch.randn(batch, n_pos, n_kv, d, generator=gen)
    v_norm = torch.rand(batch, n_kv, n_pos, generator=gen, dtype=torch.float64) + 0.1
    if draw(st.booleans()):
        q, k = q.round(), k.round()
    if draw(st.booleans()):  # the sink's key and value repeated: sink against other, exactly tied
        k[:, 1::2] = k[:, :1]
        v_norm[:, :, 1::2] = v_norm[:, :, :1]
    if draw(st.booleans()):
        v_norm[:, :, ::3] = 0.0
    is_token = torch.ones(batch, n_pos, dtype=torch.bool)
    pad = draw(st.integers(0, n_pos - 1))
    if pad:
        is_token[0, :pad] = False
        k[0, :pad] = torch.nan  # never read as a key
        q[0, :pad] = torch.nan
        v_norm[0, :, :pad] = 0.0
    window = draw(st.one_of(st.none(), st.integers(1, n_pos)))
    qk = QueryKeys(q, k, scale, window, is_token.clone() if pad else None, draw(st.integers(1, n_pos)))
    return qk, is_token, sink_positions(is_token), v_norm, group


@SETTINGS
@given(case=layers())
def test_votes_from_keys_equal_the_float64_rows(case):
    qk, is_token, sink, norms, group = case
    before = [x.clone() for x in (qk.q, qk.k, is_token, sink, norms)]
    got = key_votes.check_and_vote(qk, is_token, sink, norms, group, qk.window, NUMBA)
    for x, y in zip(before, (qk.q, qk.k, is_token, sink, norms)):  # the caller's tensors are read only
        torch.testing.assert_close(y, x, rtol=0, atol=0, equal_nan=True)
    want_votes = _rows_votes(qk, is_token, sink, norms, group)[1]
    assert got is not None
    assert torch.equal(got[1], want_votes)
    checks.raise_for_stats(got[0], 0, 0, mask_given=qk.key_mask is not None, window=qk.window)


@SETTINGS
@given(case=layers(), rows=st.integers(1, 7))
def test_votes_from_block_logits_equal_the_float64_rows(case, rows):
    """Long layers take their logits from matrix products of blocks of queries with the keys
    they see (``key_votes._vote_by_blocks``); forced here on short ones, with blocks of a few
    queries: the same votes as the float64 rows, bit for bit, ties and windows included."""
    qk, is_token, sink, norms, group = case
    taken = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(key_votes, "BLAS_MIN_KEYS", 0)
        mp.setattr(key_votes, "LOGIT_BLOCK_ROWS", rows)
        by_blocks = key_votes._vote_by_blocks
        mp.setattr(key_votes, "_vote_by_blocks", lambda *a: (taken.append(1), by_blocks(*a)))
        got = key_votes.check_and_vote(qk, is_token, sink, norms, group, qk.window, NUMBA)
    assert taken and got is not None
    assert torch.equal(got[1], _rows_votes(qk, is_token, sink, norms, group)[1])
    checks.raise_for_stats(got[0], 0, 0, mask_given=qk.key_mask is not None, window=qk.window)


def test_block_logits_only_under_ieee_float32_products(monkeypatch):
    """A lowered float32 matrix-product precision would break the margin test's bound: the votes
    then come from the compiled loop."""
    monkeypatch.setattr(key_votes, "BLAS_MIN_KEYS", 0)
    assert key_votes._ieee_matmul()
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert not key_votes._ieee_matmul()
    finally:
        torch.set_float32_matmul_precision(before)


def test_ties_are_read_from_the_float64_rows(monkeypatch):
    """Every other key repeats the sink's key and value: "sink" and "other" tie exactly, no
    margin settles them, and those rows (only those) are read from their float64 rows."""
    q = torch.randn(1, 30, 2, 8, generator=torch.Generator().manual_seed(0))
    k = torch.randn(1, 30, 1, 8, generator=torch.Generator().manual_seed(1))
    k[:, 1::2] = k[:, :1]
    norms = torch.ones(1, 1, 30, dtype=torch.float64)
    is_token = torch.ones(1, 30, dtype=torch.bool)
    sink = torch.tensor([0])
    rechecked = []
    recheck = key_votes._recheck
    monkeypatch.setattr(key_votes, "_recheck", lambda qk, uncertain, *a: (rechecked.append(int(uncertain.sum())),
                                                                        recheck(qk, uncertain, *a)))
    qk = QueryKeys(q, k, 0.5, None, None, 7)
    got = key_votes.check_and_vote(qk, is_token, sink, norms, 2, None, NUMBA)
    assert got is not None and rechecked and 0 < rechecked[0] < 2 * 29
    assert torch.equal(got[1], _rows_votes(qk, is_token, sink, norms, 2)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float32_logits_settle_only_what_their_error_bound_allows(dtype):
    """A float32 capture's logits are summed in float32 (u = 2⁻²⁴): a lead of 2⁻²² over the
    runner-up is inside their error bound, so that row is read in float64 (and counted); the
    same numbers as a float64 capture are settled by their float64 logits. The votes are the
    float64 rows' either way."""
    q = torch.zeros(1, 3, 1, 4, dtype=dtype)
    k = torch.zeros(1, 3, 1, 4, dtype=dtype)
    q[0, 2, 0, 0] = 1.0
    k[0, :, 0, 0] = torch.tensor([1.0, 1.0 + 2.0**-22, 0.5], dtype=dtype)  # the sink, another key, the query
    q[0, 1, 0, 1], k[0, 1, 0, 1] = 1.0, 3.0  # query 1 votes for itself by a wide margin
    norms = torch.ones(1, 1, 3, dtype=torch.float64)
    is_token = torch.ones(1, 3, dtype=torch.bool)
    qk = QueryKeys(q, k, 1.0, None, None, 2)
    got = key_votes.check_and_vote(qk, is_token, torch.tensor([0]), norms, 1, None, NUMBA)
    assert got is not None
    assert got[2] == (1 if dtype == torch.float32 else 0)
    assert torch.equal(got[1], _rows_votes(qk, is_token, torch.tensor([0]), norms, 1)[1])
    assert got[1][0, 0, 2] == 2  # key 1 wins


def test_a_near_tie_within_float32_round_off_is_settled_in_float64(monkeypatch):
    """Two keys whose scores differ by 1e-12 (far below float32's resolution): the float64 rows
    decide, and the fast path must not guess."""
    d = 4
    q = torch.zeros(1, 3, 1, d, dtype=torch.float64)
    q[0, 2, 0, 0] = 1.0
    k = torch.zeros(1, 3, 1, d, dtype=torch.float64)
    # The sink, another key, the query itself:
    k[0, :, 0, 0] = torch.tensor([1.0, 1.0 + 1e-12, 0.5], dtype=torch.float64)
    q[0, 1, 0, 1], k[0, 1, 0, 1] = 1.0, 3.0  # query 1 votes for itself by a wide margin
    norms = torch.ones(1, 1, 3, dtype=torch.float64)
    is_token = torch.ones(1, 3, dtype=torch.bool)
    qk = QueryKeys(q, k, 1.0, None, None, 2)
    rechecked = []
    recheck = key_votes._recheck
    monkeypatch.setattr(key_votes, "_recheck", lambda qk, uncertain, *a: (rechecked.append(int(uncertain.sum())),
                                                                        recheck(qk, uncertain, *a)))
    got = key_votes.check_and_vote(qk, is_token, torch.tensor([0]), norms, 1, None, NUMBA)
    want = _rows_votes(qk, is_token, torch.tensor([0]), norms, 1)[1]
    assert rechecked == [1]
    assert got is not None and torch.equal(got[1], want)
    # Each query's vote (0 itself, 1 the sink, 2 another key, -1 none): query 0 has no other
    # key, query 1 votes for itself, query 2 for key 1, which wins by 1e-12 in float64.
    assert want[0, 0].tolist() == [-1, 0, 2]


@pytest.mark.parametrize("change", ["window", "mask", "nan_query", "inf_key", "no_keys", "torch"])
def test_the_fast_path_declines_where_its_reasoning_does_not_hold(change):
    """A window or key mask other than the layer's, or a non-finite query or key at a real
    position: the rows must be read, so that their checks name the problem. The torch backend
    has no vote from keys: it reads the rows too."""
    q, k = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 1, 4)
    is_token = torch.ones(1, 6, dtype=torch.bool)
    norms = torch.ones(1, 1, 6, dtype=torch.float64)
    qk = QueryKeys(q, k, 0.5, None, None, 7)
    window, backend = None, NUMBA
    if change == "window":
        window = 3
    elif change == "mask":
        is_token[0, 0] = False
    elif change == "nan_query":
        q[0, 3, 1, 0] = torch.nan
    elif change == "inf_key":
        k[0, 2, 0, 1] = torch.inf
    elif change == "torch":
        backend = TORCH
    else:
        qk = None
    assert key_votes.check_and_vote(qk, is_token, sink_positions(is_token), norms, 2, window, backend) is None


class KeyedCompactRows:
    """A recomputing source: the chosen rows and the vote blocks from ``attention_rows``, and its
    queries and keys."""

    def __init__(self, qk: QueryKeys) -> None:
        self.qk = qk

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.qk.q.shape[0], self.qk.q.shape[2], self.qk.q.shape[1]

    @property
    def device(self) -> torch.device:
        return self.qk.q.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64

    def rows(self, b0: int, b1: int, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qk = self.qk
        mask = None if qk.key_mask is None else qk.key_mask[b0:b1]
        rows = attention_rows(qk.q[b0:b1], qk.k[b0:b1], queries, scale=qk.scale, window=qk.window, key_mask=mask)
        return rows, torch.arange(queries.shape[1]).expand_as(queries)

    def blocks(self, b0: int, b1: int) -> Iterator[tuple[int, torch.Tensor]]:
        qk = self.qk
        mask = None if qk.key_mask is None else qk.key_mask[b0:b1]
        yield from attention_row_blocks(qk.q[b0:b1], qk.k[b0:b1], block=qk.block, scale=qk.scale,
                                        window=qk.window, key_mask=mask)

    def query_keys(self, b0: int, b1: int) -> QueryKeys | None:
        qk = self.qk
        return QueryKeys(qk.q[b0:b1], qk.k[b0:b1], qk.scale, qk.window,
                         None if qk.key_mask is None else qk.key_mask[b0:b1], qk.block)


class PlainRows(KeyedCompactRows):
    """The same source without its queries and keys: the votes are read from the rows."""

    query_keys = None  # type: ignore[assignment]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("window", [None, 4])
def test_a_layer_from_keys_equals_the_layer_from_rows(padded, window):
    """The whole layer (votes, checks, scores) through the engine, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    batch, n_pos, n_heads, n_kv, d = 2, 14, 4, 2, 6
    q = torch.randn(batch, n_pos, n_heads, d, generator=gen)
    k = torch.randn(batch, n_pos, n_kv, d, generator=gen)
    v = torch.randn(batch, n_pos, n_kv, d, generator=gen)
    k[:, 5] = k[:, 0]  # an exact tie with the sink
    v[:, 5] = v[:, 0]
    is_token = torch.ones(batch, n_pos, dtype=torch.bool)
    if padded:
        is_token[1, :3] = False
    qk = QueryKeys(q, k, 0.4, window, is_token.clone() if padded else None, 3)
    opts = check_options(n_values=(1, 2, 4), queries="all", random_samples=3, shuffle_samples=2, seed=1,
                         distance="euclidean", space="value", rank_by="attention", bounds=False, backend="numba")
    kwargs = dict(layer=0, mask_given=padded, window=window)
    keyed, plain = KeyedCompactRows(qk), PlainRows(qk)
    assert isinstance(keyed, KeyedRows) and isinstance(plain, AttentionRows) and not isinstance(plain, KeyedRows)
    sink = sink_positions(is_token)
    want = analyze_layer(plain, v, is_token, sink, opts, **kwargs)
    got = analyze_layer(keyed, v, is_token, sink, opts, **kwargs)
    for name, a, b in zip(want._fields, want, got):
        # How many rows the keys could not settle, and the sink check's reading: the rows path
        # reads every row, the keys path none.
        if name not in ("votes_rechecked", "first_keys"):
            torch.testing.assert_close(b, a, equal_nan=True, rtol=0, atol=0, msg=name)
    assert want.votes_rechecked == 0 and got.first_keys is None and want.first_keys is not None
