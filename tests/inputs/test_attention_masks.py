"""Attention masks and padding: a mask with a hole is refused everywhere, before any forward;
texts are padded on the right whatever the tokenizer's ``padding_side``, and the caller's
tokenizer is left as it was.

A hole (a 0 between 1s of one row) has no single meaning: TransformerLens takes the positions
from the mask's running count, the Hugging Face forward (``attention="recompute"``) from the
plain index, so the two attention paths gave different numbers on the same input.
"""

from __future__ import annotations

import pytest
import torch
from cases import make_case
from shared_checks import assert_same_analysis

import tl_geometry
from tl_geometry import CacheError
from tl_geometry.analyze.from_model import _as_tokens
from tl_geometry.inputs.cache import check_attention_mask

HOLE = r"padding inside sequence\(s\) \[{rows}\].*padding must be contiguous at the start or end of each row; " \
       r"split the sequence or drop the hole"
TEXTS = ["A short one.", "A much longer second text, with a few more words in it than the first."]


def _hole_mask(batch: int, n_pos: int, rows=(0,), at: int = 5) -> torch.Tensor:
    mask = torch.ones(batch, n_pos, dtype=torch.long)
    for b in rows:
        mask[b, at] = 0
    return mask


# --- the check itself (no model) ------------------------------------------------------------


@pytest.mark.parametrize("row", [
    [1] * 5 + [0] + [1] * 10,  # the fuzz's mask
    [0, 1, 0, 1],  # left padding, then a hole
    [1, 0, 1, 0, 0],  # a hole, then right padding
    [0, 0, 1, 1, 0, 0, 1, 0],
])
def test_a_hole_is_refused_with_the_rows_and_the_fix(row):
    mask = torch.tensor([[1] * len(row), row])
    with pytest.raises(CacheError, match=HOLE.format(rows="1")):
        check_attention_mask(mask, *mask.shape)
    with pytest.raises(CacheError, match=HOLE.format(rows="1")):  # as a list and as bools too
        check_attention_mask(mask.tolist(), *mask.shape)
    with pytest.raises(CacheError, match=HOLE.format(rows="1")):
        check_attention_mask(mask.bool(), *mask.shape)


def test_every_row_with_a_hole_is_named():
    mask = _hole_mask(4, 9, rows=(0, 2))
    with pytest.raises(CacheError, match=HOLE.format(rows="0, 2") + r"\.$"):
        check_attention_mask(mask, 4, 9)


@pytest.mark.parametrize("row", [
    [1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0],
])
def test_padding_at_the_ends_is_accepted(row):
    mask = torch.tensor([[1, 1, 1, 1], row])
    assert torch.equal(check_attention_mask(mask, 2, 4), mask.bool())


def _holed_case():
    """A synthetic cache whose pattern obeys the hole (no mass on it; its own query row NaN), so
    that only the hole can be what is refused."""
    case = make_case(0, batch=2, n_pos=12)
    mask = _hole_mask(2, 12, rows=(1,), at=4)
    logits = torch.randn(case.pattern.shape, generator=torch.Generator().manual_seed(1))
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    pattern = torch.softmax(logits.masked_fill(~(causal & mask.bool()[:, None, None, :]), -torch.inf), -1)
    pattern[1, :, 4] = float("nan")  # the hole's own query is padding: a fully masked row
    return {"blocks.0.attn.hook_pattern": pattern, "blocks.0.attn.hook_v": case.v}, mask


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_analyze_heads_refuses_a_hole(backend):
    cache, mask = _holed_case()
    with pytest.raises(CacheError, match=HOLE.format(rows="1")):
        tl_geometry.analyze_heads(cache, attention_mask=mask, n_values=(1, 2), backend=backend)
    filled = mask.clone()
    filled[1, 4:] = 0  # the same sequence cut at the hole: right padding, accepted
    pattern = cache["blocks.0.attn.hook_pattern"].clone()
    pattern[1, :, 4:] = float("nan")  # queries 0-3 never saw key 4 (causal): their rows stand
    result = tl_geometry.analyze_heads({**cache, "blocks.0.attn.hook_pattern": pattern}, attention_mask=filled,
                                       n_values=(1, 2), backend=backend, random_samples=2)
    assert torch.isfinite(result.scores).any()


# --- the real models: refused before any forward, on both attention paths -------------------


def _no_forward(model, monkeypatch):
    """Any forward (the bridge's, or any torch module's, as the recompute path runs) fails."""
    monkeypatch.setattr(type(model), "__call__", lambda *a, **k: pytest.fail("forward ran"))
    monkeypatch.setattr(torch.nn.Module, "__call__", lambda *a, **k: pytest.fail("forward ran"))


@pytest.mark.real_model
@pytest.mark.parametrize("attention", ["pattern", "recompute", "auto"])
def test_analyze_model_refuses_a_hole_before_any_forward(smollm2, monkeypatch, attention):
    tokens = smollm2.tokens[:, :16]
    mask = _hole_mask(*tokens.shape, rows=(0, 2))  # the fuzz's [1]*5 + [0] + [1]*10 in rows 0 and 2
    _no_forward(smollm2.model, monkeypatch)
    with pytest.raises(CacheError, match=HOLE.format(rows="0, 2")):
        tl_geometry.analyze_model(smollm2.model, tokens, attention_mask=mask, attention=attention)
    with pytest.raises(CacheError, match=HOLE.format(rows="0, 2")):
        tl_geometry.analyze_model_nulls(smollm2.model, tokens, attention_mask=mask, attention=attention)


@pytest.mark.real_model
def test_analyze_heads_refuses_a_hole_in_a_real_cache(smollm2):
    mask = _hole_mask(*smollm2.tokens.shape, rows=(1,), at=7)
    with pytest.raises(CacheError, match=HOLE.format(rows="1")):
        tl_geometry.analyze_heads(smollm2.cache, attention_mask=mask, layers=[0])


# --- texts: right-padded whatever the tokenizer's side; the tokenizer left as it was ---------


def _expected_rows(tokenizer, texts):
    return [[tokenizer.bos_token_id, *tokenizer(t, add_special_tokens=False)["input_ids"]] for t in texts]


@pytest.mark.real_model
@pytest.mark.parametrize("side", ["left", "right"])
def test_texts_are_padded_on_the_right_whatever_the_tokenizer_side(real, monkeypatch, side):
    tokenizer = real.model.tokenizer
    monkeypatch.setattr(tokenizer, "padding_side", side)
    tokens, mask, _ = _as_tokens(real.model, TEXTS, None)
    assert tokenizer.padding_side == side  # the caller's tokenizer is left as it was
    rows = _expected_rows(tokenizer, TEXTS)
    lengths = torch.tensor([len(r) for r in rows])
    assert lengths[0] < lengths[1]  # the short text is padded
    assert tokens.shape == mask.shape == (2, int(lengths.max()))
    assert torch.equal(mask, (torch.arange(tokens.shape[1])[None, :] < lengths[:, None]).long())  # right
    for b, ids in enumerate(rows):
        assert tokens[b, : len(ids)].tolist() == ids  # BOS first, then the text's own tokens


@pytest.mark.real_model
def test_texts_equal_a_same_batch_masked_cache(real):
    """Gemma's tokenizer pads on the left (this failed before); SmolLM2's on the right."""
    model, tokenizer = real.model, real.model.tokenizer
    side = tokenizer.padding_side
    assert side == {"smollm2-135m": "right", "gemma3-270m": "left"}[real.name]  # both sides, unpatched
    layers = [0, model.cfg.n_layers - 1]
    options = dict(n_values=(1, 2, 4), random_samples=2, layers=layers)
    streamed = tl_geometry.analyze_model(model, TEXTS, batch_size=len(TEXTS), **options)
    assert tokenizer.padding_side == side
    tokens, mask, _ = _as_tokens(model, TEXTS, None)
    assert (mask == 0).any() and (mask[:, 0] == 1).all()
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, attention_mask=mask, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    cached = tl_geometry.analyze_heads(cache, attention_mask=mask, model=model, window="auto", **options)
    assert_same_analysis(cached, streamed)
    assert streamed.metadata["attention_mask"] == cached.metadata["attention_mask"]


@pytest.mark.real_model
def test_the_tokenizer_is_left_as_it_was_when_the_run_fails(real):
    tokenizer = real.model.tokenizer
    side = tokenizer.padding_side
    with pytest.raises(ValueError, match="layers"):
        tl_geometry.analyze_model(real.model, TEXTS, layers=[999])
    assert tokenizer.padding_side == side
