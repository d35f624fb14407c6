"""The budget-matched policy test of benchmarks/bench_truncation.py (SPEC §10): its budgets, its
calibrated tail-mass curves, its greedy allocation, its verdicts and its top-N hook (no model)."""

from __future__ import annotations

import importlib
import itertools
import sys

import pytest
import torch
from repo_paths import REPO

from tl_geometry.capacity import TopNPolicy, sparsify_pattern

sys.path.insert(0, str(REPO / "benchmarks"))
bench = importlib.import_module("bench_truncation")


# --- budgets ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_pos", [1, 5, 64])
def test_kept_curve_counts_min_of_n_and_keys(n_pos):
    curve = bench.kept_curve(n_pos)
    for n in range(1, n_pos + 1):
        expected = sum(min(n, t + 1) for t in range(n_pos)) / n_pos
        assert curve[n - 1].item() == pytest.approx(expected)


def test_kept_curve_caps_at_the_window():
    # T = 6, w = 2: queries see 1, 2, 2, 2, 2, 2 keys.
    curve = bench.kept_curve(6, window=2)
    assert curve.tolist() == pytest.approx([1.0, 11 / 6, 11 / 6, 11 / 6, 11 / 6, 11 / 6])


def test_policy_budget_is_the_librarys_kept_keys():
    gen = torch.Generator().manual_seed(0)
    n = torch.randint(0, 40, (4, 3), generator=gen)  # 0: every key
    for n_pos in (16, 33):
        assert bench.policy_budget(n, n_pos) == pytest.approx(TopNPolicy(n).kept_keys(n_pos))
    assert bench.policy_budget(torch.full((2, 2), 8), 1024) == pytest.approx(8 - 8 * 7 / 2048)


def test_policy_budget_reads_each_layers_window():
    n = torch.tensor([[4, 4], [4, 4]])
    assert bench.policy_budget(n, 6, [2, None]) == pytest.approx(
        (bench.kept_curve(6, 2)[3] + bench.kept_curve(6)[3]).item() / 2)


# --- calibration curves ----------------------------------------------------------------------------
def test_tail_mass_curve_is_the_weight_outside_the_top_n():
    gen = torch.Generator().manual_seed(1)
    rows = torch.softmax(torch.randn(3, 5, 7, generator=gen), -1)
    rows[0, 0, 4:] = 0.0  # a query with 4 keys
    tau = bench.tail_mass_curve(rows)
    for idx in [(0, 0), (1, 2), (2, 4)]:
        row = rows[idx].double()
        for n in range(1, 8):
            expected = row.sum() - row.sort(descending=True).values[:n].sum()
            assert tau[idx][n - 1].item() == pytest.approx(expected.item(), abs=1e-12)
    assert (tau[0, 0, 3:] == 0).all()  # exactly 0 once the top N hold every positive weight
    assert (tau[..., :-1] >= tau[..., 1:]).all()


# --- greedy allocation -----------------------------------------------------------------------------
def _curves(drops: list[list[float]]) -> torch.Tensor:
    """τ at N = 1 … K from the drops of each step (τ(K) = 0)."""
    d = torch.tensor(drops, dtype=torch.float64)
    return torch.cat([d.flip(1).cumsum(1).flip(1), torch.zeros(len(drops), 1, dtype=torch.float64)], 1)


def test_greedy_prefers_the_head_whose_tau_drops_faster():
    tau = _curves([[0.01, 0.01, 0.01, 0.01], [0.3, 0.2, 0.1, 0.05]])  # head 1 is steep
    cost = torch.arange(1, 6, dtype=torch.float64).expand(2, 5)
    n, total = bench.greedy_allocation(tau, cost, target=2 + 3)
    assert n.tolist() == [1, 4]
    assert total == 5


def test_greedy_meets_the_budget_and_is_optimal_on_convex_curves():
    gen = torch.Generator().manual_seed(2)
    drops = torch.rand(4, 5, generator=gen).sort(1, descending=True).values  # convex τ(N)
    tau = _curves(drops.tolist())
    cost = torch.arange(1, 7, dtype=torch.float64).expand(4, 6)
    table = tau.tolist()
    for target in (4, 7, 13, 20):
        n, total = bench.greedy_allocation(tau, cost, target)
        assert total == target  # unit steps: the budget is met exactly
        achieved = sum(table[u][k - 1] for u, k in enumerate(n.tolist()))
        best = min(sum(table[u][k - 1] for u, k in enumerate(ks))
                   for ks in itertools.product(range(1, 7), repeat=4) if sum(ks) == target)
        assert achieved == pytest.approx(best, abs=1e-12)


def test_greedy_undoes_an_overshooting_last_step_when_that_lands_nearer():
    tau = _curves([[0.5]])  # N = 1 → 2 is the only step, costing 10 keys
    cost = torch.tensor([[1.0, 11.0]])
    assert bench.greedy_allocation(tau, cost, target=4)[0].tolist() == [1]
    assert bench.greedy_allocation(tau, cost, target=8)[0].tolist() == [2]


def test_greedy_never_takes_a_step_that_keeps_no_key():
    tau = _curves([[0.2, 0.0, 0.0], [0.1, 0.1, 0.1]])
    cost = torch.tensor([[1.0, 2.0, 2.0, 2.0], [1.0, 2.0, 3.0, 4.0]])  # head 0 has 2 keys at most
    n, total = bench.greedy_allocation(tau, cost, target=100)
    assert n.tolist() == [2, 4] and total == 6  # out of reach: everything kept, then stop


def test_allocate_matches_the_budget_per_head_and_per_layer():
    gen = torch.Generator().manual_seed(3)
    n_pos = 64
    rows = torch.softmax(3 * torch.randn(4, 3, 32, n_pos, generator=gen), -1)
    tau = bench.tail_mass_curve(rows).mean(2)  # [layer, head, N]
    budget = bench.policy_budget(torch.full((4, 3), 6), n_pos)
    for by in ("head", "layer"):
        n, actual = bench.allocate(tau, n_pos, budget, by)
        assert actual == pytest.approx(bench.policy_budget(n, n_pos))
        assert abs(actual - budget) < 0.5
        if by == "layer":
            assert (n == n[:, :1]).all()
    with pytest.raises(ValueError):
        bench.allocate(tau, n_pos, budget, "query")


# --- intervals and verdicts ------------------------------------------------------------------------
def test_paired_and_verdicts():
    base = torch.linspace(3.0, 4.0, 32, dtype=torch.float64)
    lower = base - 0.05 + 0.001 * torch.sin(torch.arange(32.0)).double()
    out = bench.paired(lower, base)
    assert out["mean"] == pytest.approx(-0.05, abs=1e-3)
    assert out["ci95"][1] < 0 and bench.verdict(out["ci95"]) == "held"
    assert bench.verdict(bench.paired(base + 0.05, base)["ci95"]) == "not held"
    assert bench.verdict([-0.01, 0.02]) == "undecided"
    assert bench.paired(lower, base) == out  # seeded


# --- the top-N hook keeps the library's keys ------------------------------------------------------
def test_cut_equals_the_librarys_sparsify_pattern_with_ties_and_zeros():
    gen = torch.Generator().manual_seed(4)
    for trial in range(40):
        n_key = int(torch.randint(2, 30, (1,), generator=gen))
        n_query = int(torch.randint(1, n_key + 1, (1,), generator=gen))
        logits = torch.randint(-3, 3, (2, 3, n_query, n_key), generator=gen).float()  # many ties
        causal = torch.ones(n_query, n_key, dtype=torch.bool).tril(n_key - n_query)
        pattern = torch.softmax(logits.masked_fill(~causal, -torch.inf), -1)
        if trial % 2:
            pattern = pattern.masked_fill(torch.rand(pattern.shape, generator=gen) < 0.2, 0.0)
        for n in {1, 2, 3, n_key - 1, n_key, n_key + 5} - {0}:
            assert torch.equal(bench._cut(pattern, n), sparsify_pattern(pattern, n)), (trial, n)
    pattern = torch.softmax(torch.randn(1, 2, 300, 300, generator=gen), -1).tril()
    pattern = pattern / pattern.sum(-1, keepdim=True)
    assert torch.equal(bench._cut(pattern, 280), sparsify_pattern(pattern, 280))  # the kthvalue path


def test_topn_hooks_apply_each_heads_n():
    gen = torch.Generator().manual_seed(5)
    pattern = torch.softmax(torch.randn(1, 3, 8, 8, generator=gen), -1).tril()
    pattern = pattern / pattern.sum(-1, keepdim=True)
    policy = torch.tensor([[2, 0, 5], [0, 0, 0]])
    hooks = bench.topn_hooks(policy)
    assert [name for name, _ in hooks] == ["blocks.0.attn.hook_pattern"]  # layer 1 stays dense
    out = hooks[0][1](pattern)
    assert torch.equal(out[:, 0], sparsify_pattern(pattern[:, 0], 2))
    assert torch.equal(out[:, 1], pattern[:, 1])
    assert torch.equal(out[:, 2], sparsify_pattern(pattern[:, 2], 5))
