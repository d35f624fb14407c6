"""Inputs refused before any heavy work, with an error that names the problem and the fix, and
``sink="auto"`` that does not move with ``layers=``.

* ``capture_attention``: ``logsumexp`` must be a bool; float, 1-D, out-of-vocabulary or meta
  tokens and a mask of another shape are refused before the forward;
* ``queries=`` positions that no window holds are named in a warning before any forward (all
  of them: every per-query figure is NaN, the engine's own documented case);
* ``from_hf``: values whose shape fits both layouts (as many positions as KV heads) are refused
  until ``values_layout=`` names the layout; both layouts give the same analysis;
* ``sink=``: one check for every front door (``analyze_heads``, ``analyze_model``,
  ``head_scores``), its positions against the windows included, before any forward;
* ``sink="auto"`` chooses from every layer whatever ``layers=`` analyses (SPEC §1).

Synthetic caches and tiny models, and the session's SmolLM2 (3 windows of 40 tokens) where a
real model's sink is the point.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings

import pytest
import torch
from cases import make_case
from test_ablation import TinyLM
from test_bos_and_scores_refusals import tiny as tiny_scored

import tl_geometry
from tl_geometry.engine.block import PatternRows
from tl_geometry.engine.sink_choice import choose_sink, first_keys_mass
from tl_geometry.inputs import from_hf
from tl_geometry.inputs.cache import CacheError
from tl_geometry.inputs.capture import capture_attention
from tl_geometry.inputs.facts import model_facts

# The modules (the package exports functions of the same names).
_from_cache = importlib.import_module("tl_geometry.analyze.from_cache")
_head_scores = importlib.import_module("tl_geometry.analyze.head_scores")

QUIET = {"n_values": (1, 2), "random_samples": 0, "shuffle_samples": 0}


class Heavy(AssertionError):
    """Raised where the heavy work (a forward, a layer's analysis) would start."""


def _refuse(*args, **kwargs):
    raise Heavy("heavy work ran although an argument was bad")


# --- capture_attention: its arguments before the forward ----------------------------------------
def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama():
    return _tiny_llama()


TOKENS = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kwargs, match", [
    pytest.param({"logsumexp": "no"}, r"logsumexp must be True or False, got 'no'.*logsumexp=True", id="logsumexp-str"),
    pytest.param({"logsumexp": 1}, r"logsumexp must be True or False, got 1", id="logsumexp-int"),
    pytest.param({"tokens": TOKENS.float()}, r"integer token ids, got dtype torch.float32.*tokens.long\(\)",
                 id="float-tokens"),
    pytest.param({"tokens": TOKENS[0]}, r"\[batch, pos\] integer token ids, got shape \[6\].*tokens\[None\]",
                 id="1-d-tokens"),
    pytest.param({"tokens": TOKENS + 64}, r"token ids from 64 to .*outside the model's vocabulary \[0, 64\)",
                 id="out-of-vocabulary"),
    pytest.param({"tokens": torch.zeros(2, 6, dtype=torch.long, device="meta")}, r"meta tensor.*real token ids",
                 id="meta-tokens"),
    pytest.param({"tokens": TOKENS.tolist()}, r"\[batch, pos\] tensor of token ids, got list.*torch.tensor",
                 id="list-tokens"),
    pytest.param({"attention_mask": torch.ones(2, 5)}, r"attention_mask must be .* shaped like tokens \(\[2, 6\]\)",
                 id="mask-shape"),
])
def test_capture_attention_refuses_bad_arguments_before_the_forward(llama, kwargs, match):
    embedded = []
    hook = llama.model.embed_tokens.register_forward_pre_hook(lambda module, inputs: embedded.append(1))
    seen = []
    args = {"tokens": TOKENS, **kwargs}
    try:
        with pytest.raises(ValueError, match=match):
            capture_attention(llama, args.pop("tokens"), seen.append, **args)
    finally:
        hook.remove()
    assert embedded == [] and seen == []  # nothing ran


def test_capture_attention_still_takes_numpy_bools_and_its_plain_inputs(llama):
    import numpy as np

    seen = []
    capture_attention(llama, TOKENS, seen.append, attention_mask=torch.ones(2, 6, dtype=torch.long),
                      logsumexp=np.bool_(False))
    assert sorted(c.layer for c in seen) == [0, 1]


# --- queries=: positions that no window holds ---------------------------------------------------
ALL_PAST = r"queries names positions \[100\] but every window holds 48 real tokens.*no query is read.*NaN.*below 48"


def test_query_positions_past_every_window_warn_naming_the_length_before_any_layer(monkeypatch):
    """No query read at all is the engine's own case (every per-query figure NaN, tested in
    test_sink_position): it is kept, and said before the first layer's analysis."""
    monkeypatch.setattr(_from_cache, "analyze_layer", _refuse)
    case = make_case(201, batch=2, n_pos=48)
    with pytest.warns(UserWarning, match=ALL_PAST), pytest.raises(Heavy):
        tl_geometry.analyze_heads(case.cache(), queries=[100], **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monkeypatch.undo()
        result = tl_geometry.analyze_heads(case.cache(), queries=[100], **QUIET)
    assert result.f_score.isnan().all()  # what the warning says


def test_query_positions_past_every_window_warn_before_the_forward(monkeypatch):
    model = TinyLM().eval()
    monkeypatch.setattr(model, "forward", _refuse)
    tokens = torch.randint(3, 40, (2, 48), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match=ALL_PAST), pytest.raises(Heavy):
        tl_geometry.analyze_model(model, tokens, queries=[100], **QUIET)


def test_some_positions_past_every_window_are_named_and_the_others_read():
    """A padded batch reads in each window the positions it holds (documented); a position no
    window holds is named in a warning, and the result is the one without it."""
    case = make_case(202, batch=2, n_pos=14, padding="left")
    with pytest.warns(UserWarning, match=r"queries positions \[20\] lie past every window.*longest window holds 11"):
        with_20 = tl_geometry.analyze_heads(case.cache(), attention_mask=case.attention_mask, queries=[0, 3, 20],
                                            **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # N beyond the first queries
        without = tl_geometry.analyze_heads(case.cache(), attention_mask=case.attention_mask, queries=[0, 3],
                                            **QUIET)
    torch.testing.assert_close(with_20.f_score, without.f_score, equal_nan=True)


# --- from_hf: the values' layout ----------------------------------------------------------------
def _hf_like(n_pos: int, n_kv: int, n_heads: int = 8, batch: int = 2, d_head: int = 5, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    attentions = tuple(torch.randn(batch, n_heads, n_pos, n_pos, generator=g).masked_fill(~causal, -torch.inf)
                       .softmax(-1) for _ in range(2))
    values = tuple(torch.randn(batch, n_kv, n_pos, d_head, generator=g) for _ in range(2))
    return attentions, values


def _same_analysis(a, b) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weak sinks of random patterns, N beyond a short window
        x, y = tl_geometry.analyze_heads(a, **QUIET), tl_geometry.analyze_heads(b, **QUIET)
    assert torch.equal(x.scores.nan_to_num(-9), y.scores.nan_to_num(-9)) and x.labels == y.labels
    assert torch.equal(x.sink.nan_to_num(-9), y.sink.nan_to_num(-9))


def test_from_hf_refuses_values_that_fit_both_layouts():
    """T = 4 positions and 4 KV heads: [batch, pos, kv_head, d] read as [batch, kv_head, pos, d]
    would give each head another head's values; the layout must be named."""
    attentions, values = _hf_like(n_pos=4, n_kv=4)
    tl_values = tuple(v.transpose(1, 2) for v in values)
    for given in (values, tl_values):
        with pytest.raises(CacheError, match=r"values\[0\] has shape \(2, 4, 4, 5\).*fits both.*"
                                             r"values_layout='hf' or values_layout='tl'"):
            from_hf(attentions, given)
    named_tl = from_hf(attentions, tl_values, values_layout="tl")
    named_hf = from_hf(attentions, values, values_layout="hf")
    for name in named_hf:
        assert torch.equal(named_tl[name], named_hf[name])
    assert named_tl["blocks.0.attn.hook_v"] is tl_values[0]  # as given: no copy
    _same_analysis(named_tl, named_hf)


def test_from_hf_unambiguous_layouts_give_the_analysis_of_before():
    attentions, values = _hf_like(n_pos=7, n_kv=2)
    before = {name: t.clone() for name, t in from_hf(attentions, values).items()}
    tl_values = tuple(v.transpose(1, 2).contiguous() for v in values)
    _same_analysis(from_hf(attentions, values), before)
    _same_analysis(from_hf(attentions, values, values_layout="hf"), before)
    _same_analysis(from_hf(attentions, tl_values, values_layout="tl"), before)
    with pytest.raises(CacheError, match=r"looks like \[batch, pos, kv_head, d_head\].*values_layout='tl'"):
        from_hf(attentions, tl_values)  # unnamed, as before: refused with the fix


def test_one_position_fits_both_layouts_alike():
    """With a single position both readings are the same tensor: nothing to refuse."""
    attentions, values = _hf_like(n_pos=1, n_kv=1)
    cache = from_hf(attentions, values)
    assert torch.equal(cache["blocks.0.attn.hook_v"], values[0].transpose(1, 2))


@pytest.mark.parametrize("layout, values, match", [
    ("nhwc", None, r"values_layout must be 'hf' .* 'tl' .* or None"),
    ("tl", "hf", r"values_layout='tl' expects \[batch, pos, kv_head, d_head\] with pos = 7.*values_layout='hf'"),
    ("hf", "tl", r"expected \[batch, kv_head, pos, d_head\] with pos = 7"),
])
def test_from_hf_named_layouts_are_checked(layout, values, match):
    attentions, hf_values = _hf_like(n_pos=7, n_kv=2)
    given = tuple(v.transpose(1, 2) for v in hf_values) if values == "tl" else hf_values
    with pytest.raises(CacheError, match=match):
        from_hf(attentions, given, values_layout=layout)


# --- sink=: one check for every front door, before any forward ----------------------------------
BAD_SINKS = [
    pytest.param(2**63, r"sink position 9223372036854775808 is past the end of any window.*sink='auto'",
                 id="too-large"),
    pytest.param(torch.tensor(0, device="meta"), r"sink is a meta tensor.*no values.*sink=0 or sink='auto'",
                 id="meta"),
    pytest.param(torch.tensor([1.5]), r"sink must be None .*'auto'.*got a torch.float32 tensor", id="float-tensor"),
    pytest.param(torch.tensor([1j]), r"sink must be None .*got a torch.complex64 tensor", id="complex-tensor"),
    pytest.param([2**70], r"sink position 1180591620717411303424 is past the end of any window", id="too-large-list"),
    pytest.param([], r"sink must be None .*got no position", id="empty"),
    pytest.param(1000, r"sink position 1000 is past the end of window 0 \(\d+ real tokens\).*sink='auto'",
                 id="past-the-window"),
    pytest.param([0, 1, 2, 3, 4, 5, 6], r"sink gives 7 positions for \d+ windows: give one position per window",
                 id="per-window-count"),
]


@pytest.mark.parametrize("sink, match", BAD_SINKS)
def test_analyze_heads_checks_sink_before_any_layer_is_analysed(monkeypatch, sink, match):
    monkeypatch.setattr(_from_cache, "analyze_layer", _refuse)
    case = make_case(203, batch=2, n_pos=40)
    with pytest.raises(ValueError, match=match):
        tl_geometry.analyze_heads(case.cache(), sink=sink, **QUIET)


@pytest.mark.parametrize("attention", ["pattern", "recompute"])
@pytest.mark.parametrize("sink, match", BAD_SINKS)
def test_analyze_model_checks_sink_before_the_forward(monkeypatch, sink, match, attention):
    """Batches of one: a window past its sink in the last batch is refused before the first
    batch's forward, not after it."""
    from tl_geometry.analyze import from_model

    model = TinyLM().eval()
    monkeypatch.setattr(model, "forward", _refuse)
    monkeypatch.setattr(from_model, "capture_attention", _refuse)
    facts = dataclasses.replace(model_facts(model), can_recompute=True)  # both paths reach their forward
    monkeypatch.setattr(from_model, "model_facts", lambda model: facts)
    tokens = torch.randint(3, 40, (3, 40), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=match):
        tl_geometry.analyze_model(model, tokens, sink=sink, batch_size=1, attention=attention, **QUIET)


def test_analyze_model_checks_every_windows_sink_before_the_first_batch(monkeypatch):
    model = TinyLM().eval()
    monkeypatch.setattr(model, "forward", _refuse)
    tokens = torch.randint(3, 40, (3, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[2, 30:] = 0  # the last window holds 30 tokens
    with pytest.raises(ValueError, match=r"sink position 35 is past the end of window 2 \(30 real tokens\)"):
        tl_geometry.analyze_model(model, tokens, attention_mask=mask, sink=35, batch_size=1, **QUIET)


@pytest.mark.parametrize("sink, match", BAD_SINKS)
def test_head_scores_checks_sink_before_the_first_forward(monkeypatch, sink, match):
    """head_scores ran its forwards first and read the given positions last (about 40 s in on
    a real model): they are now read against the text windows before any."""
    monkeypatch.setattr(_head_scores, "_forward", _refuse)
    with pytest.raises(ValueError, match=match):
        tl_geometry.head_scores(tiny_scored(True), seq_len=16, repeat=4, sink=sink)


def test_every_front_door_goes_through_the_one_sink_check(monkeypatch):
    """analyze_heads, analyze_model and head_scores read sink= through one function."""
    from tl_geometry.analyze import sink as _sink

    calls = []
    given = _sink.check
    monkeypatch.setattr(_sink, "check", lambda sink: (calls.append(sink), given(sink))[1])
    monkeypatch.setattr(_head_scores, "_forward", _refuse)
    model = TinyLM().eval()
    monkeypatch.setattr(model, "forward", _refuse)
    tokens = torch.randint(3, 40, (2, 40), generator=torch.Generator().manual_seed(2))
    for call in (lambda: tl_geometry.analyze_heads(make_case(204, batch=2, n_pos=40).cache(), sink="bad", **QUIET),
                 lambda: tl_geometry.analyze_model(model, tokens, sink="bad", **QUIET),
                 lambda: tl_geometry.head_scores(tiny_scored(True), seq_len=16, repeat=4, sink="bad")):
        with pytest.raises(ValueError, match=r"sink must be None .*got 'bad'"):
            call()
    assert calls == ["bad"] * 3


# --- sink="auto" whatever layers= is --------------------------------------------------------------
def _layer_zero_alone(cache, mask) -> list[int]:
    """What the choice was before: layer 0's first keys alone."""
    return choose_sink([first_keys_mass(PatternRows(cache["blocks.0.attn.hook_pattern"]), mask, None)]).tolist()


@pytest.mark.real_model
def test_auto_sink_of_layer_0_is_the_sink_of_every_layer_on_smollm2(smollm2):
    """SmolLM2's layer 0 alone would choose keys 30, 31, 30 (its most attended early tokens);
    over every layer the sink is BOS. An analysis of layer 0 reports BOS, from all 30 layers,
    by the cache, the recompute and the pattern path alike."""
    mask = torch.ones(smollm2.tokens.shape, dtype=torch.bool)
    every = choose_sink([first_keys_mass(PatternRows(smollm2.cache[f"blocks.{layer}.attn.hook_pattern"]), mask, None)
                         for layer in range(30)]).tolist()
    assert every == [0, 0, 0] and _layer_zero_alone(smollm2.cache, mask) != every  # layer 0 alone differs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layer 0's sink check is weak, as it says
        results = [tl_geometry.analyze_heads(smollm2.cache, sink="auto", model=smollm2.model, layers=[0], **QUIET),
                   *(tl_geometry.analyze_model(smollm2.model, smollm2.tokens, sink="auto", layers=[0],
                                               attention=attention, **QUIET)
                     for attention in ("recompute", "pattern"))]
    for result in results:
        record = result.metadata["sink"]
        assert record["positions"] == [0, 0, 0] and record["chosen_from_layers"] == list(range(30))
    assert "position 0 of every window, chosen as each window's most attended" in results[0].summary()


def test_auto_sink_does_not_move_with_layers_on_the_pattern_path():
    """TinyLM's layer 0 alone chooses other keys than its three layers: the analysis of layer 0
    reports the three layers' choice and names them."""
    model = TinyLM().eval()
    tokens = torch.randint(3, 40, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        every = tl_geometry.analyze_model(model, tokens, sink="auto", **QUIET).metadata["sink"]
        first = tl_geometry.analyze_model(model, tokens, sink="auto", layers=[0], **QUIET).metadata["sink"]
        cached = tl_geometry.analyze_heads(cache, sink="auto", layers=[0], **QUIET).metadata["sink"]
    assert _layer_zero_alone(cache, torch.ones(3, 40, dtype=torch.bool)) != every["positions"]  # it would move
    assert every["positions"] == first["positions"] == cached["positions"]
    assert every["chosen_from_layers"] == first["chosen_from_layers"] == cached["chosen_from_layers"] == [0, 1, 2]


def test_a_cache_of_some_layers_chooses_from_those_and_says_so():
    model = TinyLM().eval()
    tokens = torch.randint(3, 40, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    only_0 = {k: v for k, v in cache.items() if k.startswith("blocks.0.attn.hook_")}
    with pytest.warns(UserWarning, match=r"sink='auto' chose each window's sink from layers \[0\] only, 1 of "
                                         r"the model's 3.*chosen_from_layers"):
        result = tl_geometry.analyze_heads(only_0, sink="auto", model=model, **QUIET)
    assert result.metadata["sink"]["chosen_from_layers"] == [0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a weak sink at 0 in this random model, as it says
        given = tl_geometry.analyze_heads(only_0, sink=0, model=model, **QUIET).metadata["sink"]
    assert given["chosen_from_layers"] is None
