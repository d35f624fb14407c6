"""SPEC §6d in ``analyze_heads(bounds=True)``: the shell certificate per (layer, head, N).

The engine's means must equal a slow loop over the queries with ``functional.shell_bounds``
(itself checked against the plain-Python reference in test_shell_bounds.py), averaged like the
engine (per sequence over the chosen queries, then over sequences), on synthetic caches with
GQA / MQA, padding, ties, duplicates and a compressed sink; and they must never exceed the
measured P / R / F: per-instance soundness implies it for means over the same instances (the
bound is defined exactly where the measure is).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from cases import make_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import ref_shell_bounds

import tl_geometry
import tl_geometry.functional as F
from tl_geometry.engine.bounds import separated
from tl_geometry.engine.shell import shell_block
from tl_geometry.functional.selection import top_n_ranks

FIELDS = ("precision", "recall", "f_score")
KINDS = {"shell": lambda n: 0, "shell_n": lambda n: n}


def _analyze(case, **kw):
    mask = case.attention_mask
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # N too large for a short cache: NaN, said once
        return tl_geometry.analyze_heads(case.cache(), attention_mask=mask, bounds=True,
                                         random_samples=0, **kw)


def _loop(case, n_values, *, queries="last", rank_by="attention", W_O=None, reference=False):
    """``{(kind, metric): [head, n]}`` by a loop over sequences, heads and queries."""
    pattern, v = case.pattern.double(), case.v.double()
    batch, n_heads, n_pos, _ = pattern.shape
    real = torch.ones(batch, n_pos, dtype=torch.bool) if case.attention_mask is None \
        else case.attention_mask.bool()
    kv = F.kv_head_index(n_heads, v.shape[2])
    keys = torch.arange(n_pos)
    zeros = torch.zeros(n_heads, len(n_values), dtype=torch.float64)
    sums = {(k, m): zeros.clone() for k in KINDS for m in (*FIELDS, "separated")}
    counts = {key: zeros.clone() for key in sums}
    for b in range(batch):
        last = int(torch.nonzero(real[b]).max())
        chosen = [last] if queries == "last" else [t for t in range(n_pos) if real[b, t]]
        for h in range(n_heads):
            values = v[b, :, kv[h]] if W_O is None else v[b, :, kv[h]] @ W_O[h].double()
            per_seq = {key: [[] for _ in n_values] for key in sums}
            for t in chosen:
                valid = (keys <= t) & real[b]
                alpha = torch.where(valid, pattern[b, h, t], 0.0)
                score = alpha * values.norm(dim=-1) if rank_by == "contribution" else alpha
                ranks = top_n_ranks(score, valid)
                for i, n in enumerate(n_values):
                    selected = (ranks < n) & valid
                    for kind, budget in KINDS.items():
                        if not 1 <= n < int(valid.sum()):
                            continue
                        if reference:
                            ref = ref_shell_bounds(alpha.numpy(), values.numpy(), selected.numpy(),
                                                   valid.numpy(), budget(n))
                            got = [ref[f] for f in FIELDS]
                        else:
                            bound = F.shell_bounds(alpha, values, n, k=budget(n), key_mask=valid,
                                                   selected=selected)
                            got = [float(x) for x in bound]
                        got.append(float(got[0] == 1 and got[1] == 1))
                        for m, x in zip((*FIELDS, "separated"), got):
                            per_seq[(kind, m)][i].append(x)
            for key, lists in per_seq.items():
                for i, xs in enumerate(lists):
                    if xs:
                        sums[key][h, i] += float(np.mean(xs))
                        counts[key][h, i] += 1
    return {key: sums[key] / counts[key] for key in sums}


def _check(result, expected, atol=1e-12):
    for (kind, metric), want in expected.items():
        got = result.bound(kind, metric)[0]
        torch.testing.assert_close(got, want.double(), rtol=0, atol=atol, equal_nan=True,
                                   msg=f"{kind} {metric}")


CASES = {
    "gqa ties": dict(seed=1, n_heads=4, n_kv=2, ties=True),
    "mqa duplicates sink": dict(seed=2, n_heads=3, n_kv=1, duplicates=True, sink=True),
    "left padding": dict(seed=3, padding="left", ties=True),
    "right padding": dict(seed=4, padding="right", duplicates=True),
    "mha": dict(seed=5, n_heads=2, n_kv=2, n_pos=9, d=3),
}


@pytest.mark.parametrize(("name", "queries"), [(name, "last") for name in CASES]
                         + [("gqa ties", "all"), ("left padding", "all")])
def test_engine_equals_a_loop_over_functional_shell_bounds(name, queries):
    case = make_case(**CASES[name])
    n_values = (1, 2, 3, 5, 11)
    result = _analyze(case, n_values=n_values, queries=queries)
    _check(result, _loop(case, n_values, queries=queries))


def test_engine_equals_the_plain_python_reference_with_contribution_ranking_and_output_space():
    """Attention ties and a compressed sink, values in general position: the literal reference."""
    case = make_case(6, n_heads=4, n_kv=2, n_pos=8, ties=True, sink=True)
    W_O = torch.randn(1, 4, 5, 7, generator=torch.Generator().manual_seed(0))
    n_values = (1, 2, 4)
    for kw, loop_kw in (
        (dict(rank_by="contribution"), dict(rank_by="contribution")),
        (dict(space="output", W_O=W_O), dict(W_O=W_O[0])),
    ):
        result = _analyze(case, n_values=n_values, queries="all", **kw)
        _check(result, _loop(case, n_values, queries="all", reference=True, **loop_kw), atol=1e-10)


def test_exact_duplicates_count_against_the_bound():
    """A duplicate of a selected key has D_j = L_j exactly: the reference's float comparison may
    go either way, the engine (like ``shell_bounds``) counts the tie as contamination, so it is
    never above the reference."""
    case = make_case(6, n_heads=4, n_kv=2, n_pos=8, ties=True, duplicates=True, sink=True)
    result = _analyze(case, n_values=(1, 2, 4), queries="all", rank_by="contribution")
    for (kind, metric), want in _loop(case, (1, 2, 4), queries="all", rank_by="contribution",
                                      reference=True).items():
        got = result.bound(kind, metric)[0]
        assert torch.equal(got.isnan(), want.isnan())
        assert (got[~got.isnan()] <= want[~want.isnan()] + 1e-12).all(), (kind, metric)


def _sound(result, tol=1e-12):
    """Mean bound ≤ mean measured (same instances); K = N at least K = 0; separated fractions
    ordered inversion (measured) ≥ shell_n ≥ shell."""
    for kind in KINDS:
        for m in FIELDS:
            bound, measured = result.bound(kind, m), result.metric(m)
            assert torch.equal(bound.isnan(), measured.isnan()), (kind, m)
            ok = ~bound.isnan()
            assert (bound[ok] <= measured[ok] + tol).all(), (kind, m, (bound - measured)[ok].max())
    for m in (*FIELDS, "separated"):
        low, high = result.bound("shell", m), result.bound("shell_n", m)
        ok = ~low.isnan()
        assert (low[ok] <= high[ok] + tol).all(), m
    ok = ~result.shell_n_separated.isnan()
    assert (result.shell_n_separated[ok] <= result.inversion_separated[ok] + tol).all()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), n_pos=st.integers(1, 10), n_kv=st.sampled_from([1, 2]),
       ties=st.booleans(), duplicates=st.booleans(), sink=st.booleans(),
       padding=st.sampled_from([None, "left", "right"]), queries=st.sampled_from(["last", "all"]))
def test_engine_shell_never_exceeds_the_measured_means(seed, n_pos, n_kv, ties, duplicates, sink,
                                                       padding, queries):
    """One sequence with queries="last" is one instance: then this is per-instance soundness."""
    if n_pos < 4:  # the case builder needs room for padding, and a key besides the sink
        padding, sink = None, False
    case = make_case(seed, batch=1 if queries == "last" else 2, n_heads=2, n_kv=n_kv, n_pos=n_pos,
                     d=3, ties=ties, duplicates=duplicates, sink=sink, padding=padding)
    _sound(_analyze(case, n_values=(1, 2, 3, 4, 7), queries=queries))


def test_shell_block_per_instance_never_exceeds_separability():
    """The engine's kernel on its own, instance by instance (no averaging)."""
    g = torch.Generator().manual_seed(11)
    n_g, n_r, n_q, n_key, d = 2, 3, 6, 12, 4
    values = torch.randint(-2, 3, (n_g, n_key, d), generator=g).double()  # duplicates, exact ties
    alpha = torch.randint(0, 5, (n_g, n_r, n_q, n_key), generator=g).double() / 8
    key_mask = torch.rand(n_q, n_key, generator=g) < 0.8
    alpha = torch.where(key_mask, alpha, 0.0)
    ranks = top_n_ranks(alpha, key_mask)
    n_values = [1, 2, 3, 5, 8]
    out = shell_block(alpha, key_mask, ranks, values, n_values)
    for i, n in enumerate(n_values):
        measured = F.separability(alpha, values[:, None, None], n, key_mask=key_mask)
        for kind in range(2):
            for f, m in enumerate(FIELDS):
                b, x = out[..., kind, i, f], getattr(measured, m)
                assert torch.equal(b.isnan(), x.isnan()), (n, kind, m)
                assert (b[~b.isnan()] <= x[~x.isnan()]).all(), (n, kind, m)
        exact = F.shell_bounds(alpha, values[:, None, None], n, k=n, key_mask=key_mask)
        torch.testing.assert_close(out[..., 1, i, :], torch.stack(list(exact), -1), rtol=0, atol=0,
                                   equal_nan=True)


def test_shell_block_memory_is_bounded(monkeypatch):
    """Sub-blocks of queries: the same numbers with a tiny element budget."""
    import tl_geometry.engine.shell as shell

    g = torch.Generator().manual_seed(3)
    values = torch.randn(1, 16, 4, generator=g, dtype=torch.float64)
    alpha = torch.randn(1, 2, 16, 16, generator=g, dtype=torch.float64).softmax(-1)
    key_mask = torch.ones(16, 16, dtype=torch.bool).tril()
    alpha = torch.where(key_mask, alpha, 0.0)
    ranks = top_n_ranks(alpha, key_mask)
    whole = shell_block(alpha, key_mask, ranks, values, [1, 2, 4, 8])
    monkeypatch.setattr(shell, "SHELL_ELEMENTS", 1)
    torch.testing.assert_close(shell_block(alpha, key_mask, ranks, values, [1, 2, 4, 8]), whole,
                               rtol=0, atol=0, equal_nan=True)


def test_separated_indicator():
    b = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.5, 2 / 3], [math.nan] * 3])
    assert separated(b)[:2].tolist() == [1.0, 0.0] and math.isnan(separated(b)[2])


@pytest.mark.parametrize("n_pos", [1, 2])
@pytest.mark.parametrize("queries", ["last", "all"])
def test_tiny_caches_give_nan_bounds(n_pos, queries):
    """One or two positions: N ≥ |keys| is NaN for every bound, never a crash; N = 1 on two
    keys is the trivial Euclidean case (F = 1, and the bounds certify it)."""
    case = make_case(0, n_pos=n_pos, sink=False)
    result = _analyze(case, n_values=(1, 2, 4), queries=queries)
    assert result.bounds.shape[:2] == (5, 4)
    if n_pos == 1:
        assert result.bounds.isnan().all()
        assert result.regime_diagnostic("norm_cv").isnan().all()  # no key besides the sink
    else:
        assert result.bounds[..., 1:].isnan().all()
        for kind in ("inversion", "shell", "shell_n"):
            assert (result.bound(kind, "f_score")[..., 0] == 1).all(), kind
    assert torch.isnan(torch.tensor(result.best_n()["shell_best_n"].to_numpy())).all()
