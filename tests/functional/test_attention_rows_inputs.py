"""Inputs ``attention_rows`` / ``attention_row_block`` / ``attention_row_blocks`` cannot answer.

Each is refused with a ``ValueError`` / ``TypeError`` raised by ``functional/attention.py``
itself, whose message names the problem and the fix: never a raw error from inside torch, never
rows renormalised over the wrong keys. The inputs they accept beyond the obvious ones (a 0/1 key
mask of integer or float dtype, a window longer than the sequence, numpy scalars) give the same
rows as their plain forms, and the caller's tensors are left as they were.

The error tests switch off the suite's run-time jaxtyping check (see ``test_bad_input.py``), which
would refuse some shapes before the module's own checks run: users never run with it, and get
these messages. The accepted inputs are checked with it on, so the annotations accept them too.
"""

from __future__ import annotations

from pathlib import Path

import jaxtyping
import numpy as np
import pytest
import torch

from tl_geometry.functional import attention as attention_module
from tl_geometry.functional import attention_row_block, attention_row_blocks, attention_rows

MODULE = Path(attention_module.__file__).resolve()
ENTRIES = ["rows", "block", "blocks"]


@pytest.fixture
def as_users_run_it(monkeypatch):
    """No pytest-only run-time type checking; restored after the test."""
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)


def _qk(batch=2, n_pos=6, n_heads=4, n_kv=2, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, n_pos, n_heads, d, generator=g),
            torch.randn(batch, n_pos, n_kv, d, generator=g))


def _call(entry, q, k, **kwargs):
    """One of the three entry points; ``attention_row_blocks`` must refuse when called, before
    the first block is asked for."""
    kwargs = {"scale": 0.5, **kwargs}
    if entry == "rows":
        queries = kwargs.pop("queries", torch.tensor([[1, 3]] * len(q)))
        return attention_rows(q, k, queries, **kwargs)
    if entry == "block":
        return attention_row_block(q, k, kwargs.pop("start", 0), kwargs.pop("stop", 2), **kwargs)
    return attention_row_blocks(q, k, block=kwargs.pop("block", 2), **kwargs)


def _expect(call, kind, match):
    with pytest.raises(kind, match=match) as info:
        call()
    assert Path(info.traceback[-1].path).resolve() == MODULE, "raised from inside torch"


# Finding 1: q, k, key_mask and queries are checked against each other.
Q, K = _qk()
MISMATCHED = {
    "shorter keys": ({"k": K[:, :4]}, r"differ in positions.*one key per position"),
    "longer keys": ({"k": torch.cat([K, K], 1)}, r"differ in positions.*one key per position"),
    "keys of a smaller batch": ({"k": K[:1]}, r"differ in batch.*keys of the same sequences"),
    "queries of a smaller batch": ({"q": Q[:1]}, r"differ in batch.*keys of the same sequences"),
    "d_head": ({"k": K[..., :2]}, r"differ in d_head.*q and k of the same layer"),
    "key mask 9 long for 6 positions": ({"key_mask": torch.ones(2, 9, dtype=torch.bool)},
                                        r"key_mask has shape \(2, 9\).*6 positions.*pass the mask"),
    "key mask 5 long": ({"key_mask": torch.ones(2, 5, dtype=torch.long)},
                        r"key_mask has shape \(2, 5\).*pass the mask"),
    "key mask of one sequence": ({"key_mask": torch.ones(1, 6, dtype=torch.bool)},
                                 r"key_mask has shape \(1, 6\).*batch 2.*pass the mask"),
}


@pytest.mark.usefixtures("as_users_run_it")
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", MISMATCHED)
def test_q_k_mask_and_queries_must_match(entry, case):
    change, match = MISMATCHED[case]
    q, k = change.get("q", Q), change.get("k", K)
    kwargs = {key: value for key, value in change.items() if key not in ("q", "k")}
    _expect(lambda: _call(entry, q, k, **kwargs), ValueError, match)


@pytest.mark.usefixtures("as_users_run_it")
@pytest.mark.parametrize(("queries", "match"), [
    (torch.tensor([[1, 3]]), r"queries has batch 1.*one row of query positions per sequence"),
    (torch.tensor([[1, 3]] * 3), r"queries has batch 3.*one row of query positions per sequence"),
])
def test_queries_must_have_one_row_per_sequence(queries, match):
    _expect(lambda: attention_rows(Q, K, queries, scale=0.5), ValueError, match)


# Finding 2: scale, window and softcap.
NAN, INF = float("nan"), float("inf")
BAD_OPTIONS = [
    ({"scale": NAN}, ValueError, r"scale=nan must be finite and positive: the logit scale"),
    ({"scale": INF}, ValueError, r"scale=inf must be finite and positive"),
    ({"scale": 0.0}, ValueError, r"scale=0.0 must be finite and positive"),
    ({"scale": -0.5}, ValueError, r"scale=-0.5 must be finite and positive"),
    ({"scale": True}, TypeError, r"scale=True \(bool\) must be a real number: the logit scale"),
    ({"scale": "0.5"}, TypeError, r"scale='0.5' \(str\) must be a real number"),
    ({"scale": torch.tensor(0.5)}, TypeError, r"scale=.* \(Tensor\) must be a real number"),
    ({"window": NAN}, TypeError, r"window=nan \(float\) must be a positive int number of keys"),
    ({"window": 1.5}, TypeError, r"window=1.5 \(float\) must be a positive int"),
    ({"window": 4.0}, TypeError, r"window=4.0 \(float\) must be a positive int"),
    ({"window": True}, TypeError, r"window=True \(bool\) must be a positive int"),
    ({"window": 0}, ValueError, r"window=0 must be a positive number of keys \(or None"),
    ({"window": -(10**20)}, ValueError, r"must be a positive number of keys"),
    ({"softcap": INF}, ValueError, r"softcap=inf must be finite and positive.*None for no cap"),
    ({"softcap": NAN}, ValueError, r"softcap=nan must be finite and positive"),
    ({"softcap": 0.0}, ValueError, r"softcap=0.0 must be finite and positive"),
    ({"softcap": -1.0}, ValueError, r"softcap=-1.0 must be finite and positive"),
    ({"softcap": True}, TypeError, r"softcap=True \(bool\) must be a real number"),
]


@pytest.mark.usefixtures("as_users_run_it")
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize(("kwargs", "kind", "match"), BAD_OPTIONS,
                         ids=[f"{next(iter(o))}={next(iter(o.values()))!r}" for o, _, _ in BAD_OPTIONS])
def test_scale_window_and_softcap_are_checked(entry, kwargs, kind, match):
    _expect(lambda: _call(entry, Q, K, **kwargs), kind, match)


@pytest.mark.usefixtures("as_users_run_it")
@pytest.mark.parametrize("entry", ENTRIES)
def test_numpy_scalars_and_ints_are_accepted(entry):
    def rows(**kwargs):
        got = _call(entry, Q, K, **kwargs)
        return torch.cat([r for _, r in got], 2) if entry == "blocks" else got

    plain = rows(scale=2.0, window=3, softcap=1.5)
    for kwargs in ({"scale": 2}, {"scale": np.float32(2.0)}, {"scale": np.int64(2)},
                   {"window": np.int64(3)}, {"softcap": np.float64(1.5)}):
        assert torch.equal(rows(**{"scale": 2.0, "window": 3, "softcap": 1.5, **kwargs}), plain)


@pytest.mark.parametrize("window", [6, 7, 10**20, 2**63, 10**400])
def test_a_window_beyond_the_positions_restricts_nothing(window):
    queries = torch.tensor([[5, 0, 3], [2, 4, 5]])
    plain = attention_rows(Q, K, queries, scale=0.5)
    assert torch.equal(attention_rows(Q, K, queries, scale=0.5, window=window), plain)
    for start, rows in attention_row_blocks(Q, K, block=4, scale=0.5, window=window):
        assert torch.equal(rows, attention_row_block(Q, K, start, min(start + 4, 6), scale=0.5))
    torch.testing.assert_close(attention_row_block(Q, K, 0, 6, scale=0.5, window=window),
                               attention_rows(Q, K, torch.arange(6).expand(2, -1), scale=0.5),
                               rtol=1e-14, atol=1e-15)


# Finding 3: what used to fail deep inside torch.
META_Q, META_K = Q.to("meta"), K.to("meta")
RAW = {
    "key mask of 2s": ({"key_mask": torch.full((2, 6), 2)}, ValueError,
                       r"key_mask holds 2, not only 0 and 1: pass a boolean \(or 0/1\) mask"),
    "key mask of 0.5": ({"key_mask": torch.full((2, 6), 0.5)}, ValueError,
                        r"key_mask holds 0.5, not only 0 and 1: pass a boolean \(or 0/1\) mask"),
    "key mask with NaN": ({"key_mask": torch.tensor([[1.0] * 5 + [NAN]] * 2)}, ValueError,
                          r"key_mask holds nan, not only 0 and 1"),
    "complex key mask": ({"key_mask": torch.ones(2, 6, dtype=torch.complex64)}, TypeError,
                         r"key_mask has dtype torch.complex64: pass a boolean \(or 0/1\) mask"),
    "key mask as a list": ({"key_mask": [[1] * 6] * 2}, TypeError,
                           r"key_mask must be a torch.Tensor \[batch, pos\]"),
    "1-D key mask": ({"key_mask": torch.ones(6, dtype=torch.bool)}, ValueError,
                     r"key_mask must be 2-D \[batch, pos\].*got shape \(6,\)"),
    "3-D q": ({"q": Q[0]}, ValueError, r"q must be 4-D \[batch, pos, head, d_head\].*Reshape it"),
    "5-D k": ({"k": K[None]}, ValueError, r"k must be 4-D \[batch, pos, kv_head, d_head\]"),
    "q as a list": ({"q": Q.tolist()}, TypeError, r"q must be a torch.Tensor"),
    "integer q": ({"q": Q.long()}, TypeError, r"q has dtype torch.int64.*cast with .float\(\)"),
    "integer k": ({"k": K.int()}, TypeError, r"k has dtype torch.int32.*cast with .float\(\)"),
    "bool k": ({"k": K > 0}, TypeError, r"k has dtype torch.bool.*cast with .float\(\)"),
    "window=True": ({"window": True}, TypeError, r"window=True \(bool\) must be a positive int"),
    "meta q and k": ({"q": META_Q, "k": META_K}, ValueError,
                     r"q is on the meta device: meta tensors hold no data; pass real tensors"),
    "meta k": ({"k": META_K}, ValueError, r"k is on the meta device: meta tensors hold no data"),
    "meta key mask": ({"key_mask": torch.ones(2, 6, dtype=torch.bool, device="meta")}, ValueError,
                      r"key_mask is on the meta device: meta tensors hold no data"),
    "meta sinks": ({"sinks": torch.zeros(4, device="meta")}, ValueError,
                   r"sinks is on the meta device: meta tensors hold no data"),
    "sinks as a list": ({"sinks": [0.0] * 4}, TypeError, r"sinks must be a tensor of one logit"),
}


@pytest.mark.usefixtures("as_users_run_it")
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", RAW)
def test_no_raw_errors_from_inside_torch(entry, case):
    change, kind, match = RAW[case]
    q, k = change.get("q", Q), change.get("k", K)
    kwargs = {key: value for key, value in change.items() if key not in ("q", "k")}
    _expect(lambda: _call(entry, q, k, **kwargs), kind, match)


@pytest.mark.usefixtures("as_users_run_it")
@pytest.mark.parametrize(("entry", "kwargs", "kind", "match"), [
    ("rows", {"queries": torch.tensor([1, 3])}, ValueError,
     r"queries must be 2-D \[batch, n_query\].*got shape \(2,\).*batch axis"),
    ("rows", {"queries": torch.tensor([[[1]], [[3]]])}, ValueError, r"queries must be 2-D"),
    ("rows", {"queries": torch.tensor([[1.0], [3.0]])}, TypeError,
     r"queries has dtype torch.float32.*cast with .long\(\)"),
    ("rows", {"queries": [[1], [3]]}, TypeError, r"queries must be a torch.Tensor"),
    ("rows", {"queries": torch.zeros(2, 1, dtype=torch.long, device="meta")}, ValueError,
     r"queries is on the meta device: meta tensors hold no data"),
    ("blocks", {"block": 2.5}, TypeError, r"block=2.5 \(float\) must be a positive int number of queries"),
    ("blocks", {"block": True}, TypeError, r"block=True \(bool\) must be a positive int"),
    ("blocks", {"block": 0}, ValueError, r"block=0 must be a positive number of queries"),
    ("block", {"start": 1.5}, TypeError, r"start=1.5 \(float\) must be an int query position"),
    ("block", {"stop": True}, TypeError, r"stop=True \(bool\) must be an int query position"),
    ("block", {"start": 4, "stop": 9}, ValueError, r"must lie in \[0, 6\): pass 0 ≤ start < stop ≤ 6"),
])
def test_queries_block_start_and_stop_are_checked(entry, kwargs, kind, match):
    _expect(lambda: _call(entry, Q, K, **kwargs), kind, match)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
@pytest.mark.usefixtures("as_users_run_it")
@pytest.mark.parametrize("entry", ENTRIES)
def test_everything_on_one_device(entry):
    _expect(lambda: _call(entry, Q, K.cuda()), ValueError, r"q is on cpu but k is on cuda.*one device")
    _expect(lambda: _call(entry, Q.cuda(), K.cuda(), key_mask=torch.ones(2, 6, dtype=torch.bool)),
            ValueError, r"key_mask is on cpu but q is on cuda.*key_mask.to\(q.device\)")
    if entry == "rows":
        _expect(lambda: _call(entry, Q.cuda(), K.cuda()), ValueError,
                r"queries is on cpu but q is on cuda.*queries.to\(q.device\)")


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.uint8, torch.float32, torch.float16],
                         ids=str)
def test_a_0_1_key_mask_of_any_dtype_gives_the_bool_masks_rows(entry, dtype):
    """The tokenizer's ``attention_mask`` (int64 0/1) or a float one is the bool mask; the
    caller's tensors keep their values and dtypes."""
    bool_mask = torch.tensor([[False, False, True, True, True, True], [True] * 5 + [False]])
    mask = bool_mask.to(dtype)
    q, k = _qk(n_heads=4, n_kv=1)
    before = [x.clone() for x in (q, k, mask)]

    def rows(key_mask):
        got = _call(entry, q, k, window=4, key_mask=key_mask)
        return torch.cat([r for _, r in got], 2) if entry == "blocks" else got

    expected = rows(bool_mask)  # query 0 of sequence 0 sees no key: a NaN row
    for same_mask in (mask, mask.transpose(0, 1).contiguous().transpose(0, 1)):
        torch.testing.assert_close(rows(same_mask), expected, rtol=0, atol=0, equal_nan=True)
    for x, kept in zip((q, k, mask), before):
        assert x.dtype == kept.dtype and torch.equal(x, kept)
