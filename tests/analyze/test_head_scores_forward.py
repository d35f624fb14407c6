"""``head_scores`` scores each layer inside the forward (SPEC §9): one layer's pattern at a time,
the forward ended after the last layer's pattern (no logits), the hooks gone on any exit, and
the scores those of every layer's cached pattern (``run_with_cache``), batched or not.
"""

from __future__ import annotations

import importlib
import weakref

import numpy as np
import pytest
import torch
from shared_checks import spy_head_score_inputs
from test_bos_and_scores_refusals import tiny
from transformer_lens.hook_points import HookPoint

import tl_geometry
from tl_geometry.engine.block import PatternRows
from tl_geometry.engine.sink_choice import choose_sink, first_keys_mass
from tl_geometry.functional import head_scores as F

_head_scores = importlib.import_module("tl_geometry.analyze.head_scores")
PATTERN = "blocks.{layer}.attn.hook_pattern"


def _spy_patterns(model, seen: list[list[int]]):
    """Hooks on every ``hook_pattern`` that record, per forward, how many earlier layers'
    patterns are still alive when a layer's pattern is formed: weak references to their storage,
    which a view or a detached copy (a cache's) keeps alive."""
    alive: list[weakref.ref] = []

    def spy(pattern, hook):
        layer = int(hook.name.split(".")[1])
        if layer == 0:
            alive.clear()
            seen.append([])
        seen[-1].append(sum(ref() is not None for ref in alive))
        alive.append(weakref.ref(pattern.untyped_storage()))

    return [(PATTERN.format(layer=layer), spy) for layer in range(model.cfg.n_layers)]


def _fires(name: str, fired: list[str]):
    return name, lambda x, hook: fired.append(name)


def _hook_counts(model) -> dict[str, int]:
    return {name: len(point.fwd_hooks) for name, point in model.hook_dict.items() if point.fwd_hooks}


@pytest.mark.parametrize("with_bos", [True, False])
def test_one_layer_pattern_at_a_time_and_the_forward_ends_at_the_last(with_bos):
    model = tiny(with_bos)
    last = model.cfg.n_layers - 1
    seen: list[list[int]] = []
    fired: list[str] = []
    after = f"blocks.{last}.attn.hook_z"  # right after the last pattern, in the same layer
    with model.hooks(fwd_hooks=[*_spy_patterns(model, seen), _fires(after, fired)]):
        scores = tl_geometry.head_scores(model, seq_len=24, repeat=4)
        assert _hook_counts(model) == {**{PATTERN.format(layer=layer): 1 for layer in range(last + 1)},
                                       after: 1}  # head_scores' own hooks are gone
    # Repeated, text, 64-token and retrieval windows; without BOS one more forward (sink="auto").
    assert len(seen) == 4 + (not with_bos) and all(counts == [0] * (last + 1) for counts in seen)
    assert fired == [] and len(scores) == 12


def test_a_model_error_passes_through_and_the_hooks_are_removed():
    model = tiny(True)

    class Broken(RuntimeError):
        pass

    def broken(pattern, hook):
        raise Broken

    with model.hooks(fwd_hooks=[(PATTERN.format(layer=1), broken)]), pytest.raises(Broken):
        tl_geometry.head_scores(model, seq_len=24, repeat=4)
    assert _hook_counts(model) == {}
    assert len(tl_geometry.head_scores(model, seq_len=24, repeat=4)) == 12  # nothing left behind


def test_a_layer_without_its_pattern_is_a_named_error():
    model = tiny(True)
    model.blocks[2].attn.hook_pattern = HookPoint()  # the named hook point no longer runs
    with pytest.raises(ValueError, match=r"fired hook_pattern on layers \[0, 1\], not once on each of 0..2"):
        tl_geometry.head_scores(model, seq_len=24, repeat=4)


# --- against every layer's cached pattern, on the session's real models --------------------------
def _cached(model, tokens) -> list[torch.Tensor]:
    names = [PATTERN.format(layer=layer) for layer in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    return [cache[n] for n in names]


def _reference(model, seen, scores) -> dict[str, np.ndarray]:
    """The scores of SPEC §9 from ``run_with_cache`` patterns of the sequences head_scores ran."""
    repeated, windows, with_needle = seen[:3]
    R, start, layer_window = scores.attrs["repeat"], int(scores.attrs["trained_with_bos"]), \
        scores.attrs["window"] or [None] * model.cfg.n_layers
    _, queries, keys = F.retrieval_layout(windows.shape[1])
    out: dict[str, list[torch.Tensor]] = {name: [] for name in F.SCORE_NAMES}
    for layer, (rep, win, needle) in enumerate(zip(*(_cached(model, t) for t in seen[:3]))):
        w = layer_window[layer]
        out["previous_token"].append(F.previous_token_score(rep, start, w))
        out["duplicate_token"].append(F.duplicate_token_score(rep, R, start, w))
        out["induction"].append(F.induction_score(rep, R, start, w))
        out["sink_rate"].append(F.sink_rate(win, w))
        out["retrieval"].append(F.argmax_share(needle, queries, keys, w))
    assert repeated.shape[1] == start + 2 * R and with_needle.shape[1] == windows.shape[1] + 48
    return {name: torch.cat(v).numpy() for name, v in out.items()}


@pytest.mark.real_model
@pytest.mark.parametrize("attention", ["pattern", "recompute"])
@pytest.mark.parametrize("budget", [None, 1])
def test_scores_equal_those_of_every_cached_layer(real, monkeypatch, attention, budget):
    """64-token windows (Sink^ε reads them: no forward apart); ``budget=1``: one sequence per
    forward, the means weighted by batch. The recompute path reads no pattern at all, and its
    weights (float64 from the captured queries and keys) equal the cached ones to 1e-6."""
    model = real.model
    if budget is not None:
        monkeypatch.setattr(_head_scores, "PATTERN_BUDGET" if attention == "pattern" else "CAPTURE_TOKENS", budget)
    seen = spy_head_score_inputs(monkeypatch)
    fired: list[str] = []
    alive: list[list[int]] = []
    with model.hooks(fwd_hooks=[*_spy_patterns(model, alive), _fires("unembed.hook_in", fired)]):
        scores = tl_geometry.head_scores(model, seq_len=64, repeat=8, seed=3, attention=attention)
    assert scores.attrs["attention"] == attention
    kinds: dict[int, list[torch.Tensor]] = {}  # the batches of each kind of sequence, joined
    for tokens in seen:
        kinds.setdefault(tokens.shape[1], []).append(tokens)
    seen = [torch.cat(batches) for batches in kinds.values()]
    assert [tuple(t.shape) for t in seen] == [(8, 17), (8, 64), (8, 112)]
    # No logits, and no earlier layer's pattern alive when a layer's is formed (none at all
    # formed by the recompute path).
    assert fired == [] and all(counts == [0] * model.cfg.n_layers for counts in alive)
    assert len(alive) == (0 if attention == "recompute" else 3 if budget is None else 24)
    assert sum(len(b) for b in kinds.values()) == (3 if budget is None else 24)
    want = _reference(model, seen, scores)
    for name, values in want.items():
        np.testing.assert_allclose(scores[name].to_numpy(), values, rtol=0, atol=1e-6, err_msg=name)
    rates = torch.tensor(scores["sink_rate"].to_numpy())
    assert scores.attrs["sink_epsilon"] == F.sink_epsilon(rates)


@pytest.mark.real_model
@pytest.mark.parametrize("attention", ["pattern", "recompute"])
def test_auto_sink_equals_the_choice_from_every_cached_layer(smollm2, monkeypatch, attention):
    """``sink="auto"`` chooses from every layer's first-keys mass, read inside the forward."""
    model = smollm2.model
    windows = tl_geometry.text_windows(model, n_seqs=3, seq_len=48)
    for budget in ("PATTERN_BUDGET", "CAPTURE_TOKENS"):  # the choice made per batch
        monkeypatch.setattr(_head_scores, budget, 1)
    scores = tl_geometry.head_scores(model, windows=windows, repeat=4, sink="auto", attention=attention)
    patterns = _cached(model, windows)
    is_token = torch.ones(windows.shape, dtype=torch.bool)
    sinks = choose_sink([first_keys_mass(PatternRows(p), is_token, None) for p in patterns]).tolist()
    assert scores.attrs["sink"] == {"rule": "auto", "positions": sinks}
    t = torch.arange(48)
    want = torch.cat([torch.stack([F.mean_weight(p[b:b + 1], t[t > s], torch.full_like(t[t > s], s))
                                   for b, s in enumerate(sinks)]).nanmean(0) for p in patterns])
    np.testing.assert_allclose(scores["sink_rate_selected"].to_numpy(), want.numpy(), rtol=0, atol=1e-6)
