"""Edges of ``ablate_heads`` / ``HeadAblation``: no heads at all, and the context protocol misused."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_ablation import TinyLM

import tl_geometry


@pytest.fixture(scope="module")
def tiny() -> TinyLM:
    return TinyLM().eval()


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(3))


def _loss(model, tokens) -> float:
    with torch.no_grad():
        return float(model(tokens, return_type="loss"))


@pytest.mark.parametrize("heads", [[], (), torch.zeros(3, 4, dtype=torch.bool)],
                         ids=["empty-list", "empty-tuple", "all-false-mask"])
def test_no_heads_warns_and_changes_nothing(tiny, tokens, heads):
    with pytest.warns(UserWarning, match="got no heads .* does nothing"):
        ablation = tl_geometry.ablation.ablate_heads(tiny, heads)
    assert list(ablation) == [] and ablation.heads == []
    base = _loss(tiny, tokens)
    with ablation:
        assert not any(hp.fwd_hooks for hp in tiny.hook_dict.values())  # nothing installed
        assert _loss(tiny, tokens) == base


def test_some_heads_do_not_warn(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ablation = tl_geometry.ablation.ablate_heads(tiny, [(0, 1)])
    assert ablation.heads == [(0, 1)]


def test_exit_without_enter_is_a_clear_error(tiny):
    ablation = tl_geometry.ablation.ablate_heads(tiny, [(1, 2)])
    with pytest.raises(RuntimeError, match=r"__exit__ was called without a matching __enter__.*with ablate_heads"):
        ablation.__exit__(None, None, None)
    # Still usable afterwards, and a second exit after a full with-block is refused the same way.
    with ablation:
        assert any(hp.fwd_hooks for hp in tiny.hook_dict.values())
    assert not any(hp.fwd_hooks for hp in tiny.hook_dict.values())
    with pytest.raises(RuntimeError, match="without a matching __enter__"):
        ablation.__exit__(None, None, None)


def test_nested_entries_unwind_in_order(tiny, tokens):
    ablation = tl_geometry.ablation.ablate_heads(tiny, [(2, 0)])
    base = _loss(tiny, tokens)
    with ablation:
        ablated = _loss(tiny, tokens)
        with ablation:  # the same ablation twice: hooks stack, the exits pop one each
            pass
        assert _loss(tiny, tokens) == ablated != base
    assert _loss(tiny, tokens) == base


@pytest.mark.parametrize("sweep", ["head_sensitivity", "ablation_vs_random", "sparsification_curve"])
def test_a_bad_reference_batch_is_refused_before_any_forward(tiny, tokens, sweep):
    """The reference batch of ``mode="mean"`` is checked (by the mean-z pass) before the dense
    and ablated forwards of every sweep."""
    forwards = []
    handle = tiny.register_forward_pre_hook(lambda module, args: forwards.append(1))
    extra = {"heads": [(0, 1)]} if sweep == "ablation_vs_random" else {}
    extra |= {"order": tl_geometry.ablation.random_order(3, 4, seed=0)} if sweep == "sparsification_curve" else {}
    try:
        with pytest.raises(ValueError, match="reference_tokens"):
            getattr(tl_geometry.ablation, sweep)(tiny, tokens, mode="mean", reference_tokens=tokens + 100,
                                                 progress=False, **extra)
    finally:
        handle.remove()
    assert forwards == []


def test_the_one_window_warning_comes_before_the_sweep(tiny, tokens, monkeypatch):
    def sweep(*args, **kwargs):
        raise RuntimeError("the sweep started")

    monkeypatch.setattr(tl_geometry.ablation.hooks, "replica_window_losses", sweep)
    with pytest.warns(UserWarning, match="one window with next-token predictions"), \
            pytest.raises(RuntimeError, match="the sweep started"):
        tl_geometry.ablation.head_sensitivity(tiny, tokens[:1], progress=False)
