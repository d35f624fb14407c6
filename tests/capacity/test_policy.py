"""Per-head top-N policies (SPEC §10): JSON round trips and refusals, the same hook as a uniform
N head by head, policies from certified budgets, and the predictors of capacity_correlation.

Fast tests use ``TinyLM`` (tests/ablation/test_ablation.py); the real-model tests use the SmolLM2
session fixture on a few tokens."""

from __future__ import annotations

import json
import math

import jaxtyping
import pytest
import torch
from test_capacity import _captured, _reference_rows, tiny_lm

import tl_geometry
from tl_geometry.capacity import (
    KEEP_ALL,
    TopNPolicy,
    capacity_correlation,
    head_geometry,
    top_n_attention,
)
from tl_geometry.capacity.geometry import SCORES


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(2))


def _loss(model, tokens, hooks=None) -> float:
    with torch.no_grad():
        if hooks is None:
            return float(model(tokens, return_type="loss"))
        with hooks:
            return float(model(tokens, return_type="loss"))


# --- the policy object --------------------------------------------------------------------------


def test_json_round_trip_and_the_documented_format(tmp_path):
    policy = TopNPolicy.from_dict({(0, 1): 4, (2, 3): 1, (1, 0): 0}, 3, 4, {"eps": 0.05})
    assert policy.n.tolist() == [[0, 4, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]]
    data = json.loads(policy.to_json())
    assert data == {"format": "tl_geometry.TopNPolicy/1", "n_layers": 3, "n_heads": 4,
                    "heads": [[0, 1, 4], [2, 3, 1]], "metadata": {"eps": 0.05}}
    assert TopNPolicy.from_json(policy.to_json()) == policy
    assert TopNPolicy.load(policy.save(tmp_path / "sub" / "policy.json")) == policy
    assert policy.to_dict() == {(0, 1): 4, (2, 3): 1}
    assert policy.mask.sum() == 2 and "2 sparsified" in repr(policy)
    n = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    from_tensor = TopNPolicy(n)
    n[0, 0] = 7  # the policy holds its own copy
    assert from_tensor.n.dtype == torch.int64 and from_tensor.n.tolist() == [[1, 2], [3, 0]]


def test_kept_keys_counts_every_query_and_dense_heads():
    # 4 positions: queries see 1, 2, 3, 4 keys. N = 2 keeps 1, 2, 2, 2; a dense head 1, 2, 3, 4.
    policy = TopNPolicy(torch.tensor([[2, KEEP_ALL]]))
    assert policy.kept_keys(4) == pytest.approx((7 + 10) / 8)
    assert TopNPolicy.uniform(2, 1, 2).kept_keys(4) == pytest.approx(7 / 4)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: TopNPolicy(torch.tensor([[1.0, 2.0]])), "integer"),
    (lambda: TopNPolicy(torch.tensor([1, 2])), r"integer \[layer, head\] tensor"),
    (lambda: TopNPolicy(torch.tensor([[1, -1]])), "holds -1"),
    (lambda: TopNPolicy(torch.tensor([[True]])), "integer"),
    (lambda: TopNPolicy.from_dict({(0, 5): 2}, 2, 4), r"\(0, 5\) is not a head"),
    (lambda: TopNPolicy.from_dict({(0,): 2}, 2, 4), "must be a \\(layer, head\\) pair"),
    (lambda: TopNPolicy.from_dict({(0, 1): 2.5}, 2, 4), "must be an int"),
    (lambda: TopNPolicy.from_dict({(0, 1): -2}, 2, 4), "is not a number of keys"),
    (lambda: TopNPolicy.from_json("{nope"), "invalid JSON"),
    (lambda: TopNPolicy.from_json('{"format": "other/1"}'), "not a policy of format"),
    (lambda: TopNPolicy.from_json(json.dumps({"format": "tl_geometry.TopNPolicy/1", "n_layers": 2,
                                              "n_heads": 2, "heads": [[0, 0, 1], [0, 0, 2]]})), "listed twice"),
    (lambda: TopNPolicy.from_json(json.dumps({"format": "tl_geometry.TopNPolicy/1", "n_layers": 2,
                                              "n_heads": 2, "heads": [[0, 0]]})), "not a \\[layer, head, N\\]"),
    (lambda: TopNPolicy.from_json(json.dumps({"format": "tl_geometry.TopNPolicy/1", "n_layers": 0,
                                              "n_heads": 2, "heads": []})), "n_layers, n_heads ≥ 1"),
    (lambda: TopNPolicy(torch.tensor([[1]]), {"f": len}).to_json(), "cannot be written as JSON"),
])
def test_bad_policies_are_refused_with_the_problem_named(make, message, monkeypatch):
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)  # the errors users get
    with pytest.raises(ValueError, match=message):
        make()


def test_a_damaged_file_is_named(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"format": "tl_geometry.TopNPolicy/1", "n_layers": 1, "n_heads": 1, "heads": [[0, 3, 2]]}')
    with pytest.raises(ValueError, match=rf"^{path}: policy key \(0, 3\) is not a head"):
        TopNPolicy.load(path)


# --- the hook -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["renormalize", "delete"])
def test_each_head_keeps_its_own_n(tokens, mode):
    model = tiny_lm(2)
    n = torch.tensor([[1, 3, 0, 2], [0, 0, 0, 0], [5, 1, 1, 0]])
    hooks = top_n_attention(model, n, mode)
    assert isinstance(hooks.n, TopNPolicy) and hooks.layers == [0, 2] and "policy" in repr(hooks)
    valid = torch.ones(tokens.shape, dtype=torch.bool)
    for layer in range(3):
        seen = _captured(model, tokens, layer, hooks)
        for h in range(4):
            want = seen["pattern"][:, h] if n[layer, h] == 0 else \
                _reference_rows(seen["pattern"], int(n[layer, h]), mode, valid)[:, h]
            torch.testing.assert_close(seen["used"][:, h], want, rtol=0, atol=1e-6)
            if n[layer, h] == 0:  # a dense head is left bit for bit
                assert torch.equal(seen["used"][:, h], seen["pattern"][:, h])


def test_uniform_policy_is_the_uniform_n_and_dicts_leave_other_heads_dense(tokens):
    model = tiny_lm(1)
    uniform = _loss(model, tokens, top_n_attention(model, 2))
    every = {(layer, h): 2 for layer in range(3) for h in range(4)}
    for policy in (TopNPolicy.uniform(2, 3, 4), torch.full((3, 4), 2), every):
        assert _loss(model, tokens, top_n_attention(model, policy)) == uniform
    one = _loss(model, tokens, top_n_attention(model, 2, heads=[(1, 2)]))
    assert _loss(model, tokens, top_n_attention(model, {(1, 2): 2})) == one


def test_policy_refusals(tokens, monkeypatch):
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    model = tiny_lm(2)
    with pytest.raises(ValueError, match="the model has 3 × 4"):
        top_n_attention(model, torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="its own scope"):
        top_n_attention(model, {(0, 1): 2}, layers=[0])
    with pytest.raises(ValueError, match="sparsifies no head"):
        top_n_attention(model, torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="is not a head of a model with 3 layers"):
        top_n_attention(model, {(3, 0): 2})
    with pytest.raises(ValueError, match="int ≥ 1"):
        top_n_attention(model, 2.0)


def test_policy_from_an_analysis(tokens):
    model = tiny_lm(2)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    result = tl_geometry.analyze_heads(cache, layers=[0, 2], n_values=(1, 2, 4), queries="all",
                                       random_samples=0, shuffle_samples=0)
    policy = TopNPolicy.from_result(result, eps=0.3, n_layers=3)
    budgets = tl_geometry.truncation_budgets(result, eps=0.3)
    assert torch.equal(policy.n[[0, 2]], budgets) and (policy.n[1] == KEEP_ALL).all()
    assert policy.metadata == {"eps": 0.3, "source": "truncation_budgets"}
    assert set(budgets.unique().tolist()) <= {0, 1, 2, 4}
    if policy.mask.any():
        _loss(model, tokens, top_n_attention(model, policy))  # runs through the same hook


# --- the predictors ------------------------------------------------------------------------------


def test_correlation_compares_f_tail_and_error(tokens):
    model = tiny_lm(2)
    geometry = head_geometry(model, tokens, 2)
    assert set(geometry) == set(SCORES) >= {"f_score", "tail_mass", "truncation_error"}
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    analysis = tl_geometry.analyze_heads(cache, n_values=(2,), random_samples=0, shuffle_samples=0)
    for name in ("tail_mass", "truncation_error"):  # the functional form and the engine agree
        torch.testing.assert_close(geometry[name], analysis.metric(name)[..., 0], rtol=1e-9, atol=1e-12)
    corr = capacity_correlation(model, tokens, 2)
    assert set(corr.rho) == set(SCORES)
    table = corr.to_pandas()
    assert {"tail_mass", "truncation_error", "loss_increase"} <= set(table.columns) and len(table) == 12
    text = corr.summary()
    assert "tail_mass" in text and "truncation_error" in text and "expected ρ > 0" in text
    assert all(math.isnan(r) or -1 <= r <= 1 for r in corr.rho.values())


# --- SmolLM2 ------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_smollm2_uniform_policy_equals_uniform_n_and_three_heads_change_the_loss(smollm2):
    model, tokens = smollm2.model, smollm2.tokens[:2, :24]
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    with torch.no_grad():
        with top_n_attention(model, 8):
            uniform = float(model(tokens, return_type="loss"))
        policy = TopNPolicy.uniform(8, n_layers, n_heads)
        with top_n_attention(model, policy):
            same = float(model(tokens, return_type="loss"))
        changed = policy.n.clone()
        changed[0, 0], changed[3, 4], changed[7, 8] = 1, 1, 2
        with top_n_attention(model, TopNPolicy(changed)):
            other = float(model(tokens, return_type="loss"))
    assert same == uniform  # the same hook: exactly the same loss
    assert other != uniform
