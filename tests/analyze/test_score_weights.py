"""The weights ``head_scores`` reads from a capture (:class:`CaptureWeights`) against the whole
float64 pattern of the same queries and keys, read by :class:`PatternWeights`: global and
sliding-window layers, grouped query heads, a softcap, each query's log-sum-exp given or not, and
blocks of one query at a time."""

from __future__ import annotations

import pytest
import torch

from tl_geometry.analyze import score_weights
from tl_geometry.analyze.score_weights import CaptureWeights, PatternWeights
from tl_geometry.functional import head_scores as F
from tl_geometry.functional.attention import attention_rows
from tl_geometry.inputs.capture import AttentionParams, LayerCapture

BATCH, N_POS, HEADS, KV_HEADS, D = 2, 40, 4, 2, 8


def _capture(window: int | None, softcap: float | None, logsumexp: bool) -> LayerCapture:
    g = torch.Generator().manual_seed(0 if window is None else window)
    q = torch.randn(BATCH, N_POS, HEADS, D, generator=g)
    k = torch.randn(BATCH, N_POS, KV_HEADS, D, generator=g)
    params = AttentionParams(scale=0.5, window=window, softcap=softcap, sinks=None, n_heads=HEADS,
                             n_kv_heads=KV_HEADS)
    lse = None
    if logsumexp:  # as the forward's kernel hands it over: float32, over every key up to the query
        logits = torch.einsum("bthd,bihd->bhti", q.double(), k.double().repeat_interleave(2, dim=2)) * 0.5
        causal = torch.ones(N_POS, N_POS, dtype=torch.bool).tril()
        lse = logits.masked_fill(~causal, -torch.inf).logsumexp(-1).float()
    return LayerCapture(0, q, k, k.clone(), params, lse)


def _pattern(c: LayerCapture) -> torch.Tensor:
    every = torch.arange(N_POS).expand(BATCH, -1)
    return attention_rows(c.q, c.k, every, **c.params.row_kwargs())


CASES = [(None, None, True), (None, None, False), (7, None, False), (7, 2.0, False), (None, 2.0, False)]


@pytest.mark.parametrize("block_bytes", [score_weights.BLOCK_BYTES, 1])
@pytest.mark.parametrize("window, softcap, logsumexp", CASES)
def test_capture_weights_equal_the_whole_pattern(monkeypatch, block_bytes, window, softcap, logsumexp):
    monkeypatch.setattr(score_weights, "BLOCK_BYTES", block_bytes)
    c = _capture(window, softcap, logsumexp)
    capture, pattern = CaptureWeights(c), PatternWeights(_pattern(c))
    tol = {"rtol": 0, "atol": 1e-6 if logsumexp else 1e-12}
    repeated = F.second_copy_pairs(N_POS, 20, 1, start=0)
    for pairs in (F.sink_pairs(N_POS), F.previous_token_pairs(N_POS), repeated,
                  (torch.tensor([5, 30, 39]), torch.tensor([5, 29, 0]))):
        torch.testing.assert_close(capture.mean_weight(*pairs, window), pattern.mean_weight(*pairs, window),
                                   equal_nan=True, **tol)
    _, queries, keys = F.retrieval_layout(N_POS - 24, needle=8, repeated=8)
    torch.testing.assert_close(capture.argmax_share(queries, keys, window),
                               pattern.argmax_share(queries, keys, window), equal_nan=True, rtol=0, atol=0)
    wanted = [0, 3, 31]
    torch.testing.assert_close(capture.key_columns(wanted), pattern.key_columns(wanted), **tol)


def test_a_score_no_query_sees_is_nan():
    """Key 0 beyond a window of 3 keys: no pair is seen, the mean and the share are NaN."""
    c = _capture(3, None, False)
    t = torch.arange(10, 20)
    assert CaptureWeights(c).mean_weight(t, torch.zeros_like(t), 3).isnan().all()
    assert CaptureWeights(c).argmax_share(t, torch.zeros_like(t), 3).isnan().all()
