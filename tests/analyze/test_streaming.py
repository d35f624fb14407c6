"""analyze_model (inside the forward pass) equals analyze_heads on the cache of the same forwards;
torchrun too.

Like is compared with like: a forward of one batch is not bit for bit the forward of another on
every CPU (the kernels' round-off depends on the batch's shape, about 1e-6 in α), and a top-N
near-tie that flips moves a margin by a whole unit. So the cache each test analyses comes from
the very batches (and thread count) that the streaming run forwards; what is left to differ is
the engine's own path, which must agree to 1e-6.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from shared_checks import assert_same_analysis

import tl_geometry

pytestmark = pytest.mark.real_model
def _cache_in_batches(model, tokens, batch_size, mask=None, threads=None) -> dict[str, torch.Tensor]:
    """``hook_pattern`` / ``hook_v`` of ``tokens`` forwarded ``batch_size`` sequences at a time
    (as ``analyze_model`` batches them), concatenated over the batch: the cache of the very
    forwards the streaming run makes."""
    parts: dict[str, list[torch.Tensor]] = {}
    before = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        for start in range(0, tokens.shape[0], batch_size):
            extra = {} if mask is None else {"attention_mask": mask[start:start + batch_size]}
            with torch.no_grad():
                _, cache = model.run_with_cache(tokens[start:start + batch_size],
                                                names_filter=tl_geometry.CACHE_NAMES_FILTER, **extra)
            for name, tensor in cache.items():
                parts.setdefault(name, []).append(tensor)
    finally:
        torch.set_num_threads(before)
    return {name: torch.cat(chunks) for name, chunks in parts.items()}


@pytest.fixture(scope="module")
def cache_in_twos(smollm2) -> dict[str, torch.Tensor]:
    return _cache_in_batches(smollm2.model, smollm2.tokens, 2)


@pytest.mark.parametrize("queries", ["last", "all"])
def test_streaming_equals_cache_analysis(smollm2, cache_in_twos, queries):
    options = dict(n_values=(1, 2, 4, 8), queries=queries, random_samples=3, bounds=queries == "last")
    cached = tl_geometry.analyze_heads(cache_in_twos, **options)
    streamed = tl_geometry.analyze_model(smollm2.model, smollm2.tokens, batch_size=2, **options)
    assert_same_analysis(cached, streamed)
    assert streamed.metadata["cache_type"] == "streaming"


@pytest.mark.parametrize("shuffle", ["norms", "unselected"])
def test_streaming_takes_the_null_of_the_cache_analysis(smollm2, cache_in_twos, shuffle):
    options = dict(n_values=(1, 2, 4, 8), random_samples=0, shuffle_samples=3, shuffle=shuffle, layers=[0, 29])
    cached = tl_geometry.analyze_heads(cache_in_twos, **options)
    streamed = tl_geometry.analyze_model(smollm2.model, smollm2.tokens, batch_size=2, **options)
    assert_same_analysis(cached, streamed)
    assert streamed.shuffle == cached.shuffle == shuffle


def test_every_null_from_one_forward_equals_its_own_run(smollm2, monkeypatch):
    """analyze_model_nulls: one forward pass, each null bit for bit its own analyze_model run
    (the random baseline and bounds on the values analysis alone)."""
    options = dict(n_values=(1, 2, 4), shuffle_samples=3, layers=[0, 13], batch_size=2)
    forward = type(smollm2.model).__call__
    calls = []
    monkeypatch.setattr(type(smollm2.model), "__call__", lambda *a, **k: calls.append(1) or forward(*a, **k))
    together = tl_geometry.analyze_model_nulls(smollm2.model, smollm2.tokens, random_samples=2, bounds=True,
                                               **options)
    assert len(calls) == -(-smollm2.tokens.shape[0] // 2)  # one forward per batch, not per null
    assert list(together) == ["values", "norms", "directions", "unselected"]
    monkeypatch.setattr(type(smollm2.model), "__call__", forward)
    for kind, result in together.items():
        main = kind == "values"
        alone = tl_geometry.analyze_model(smollm2.model, smollm2.tokens, shuffle=kind, bounds=main,
                                          random_samples=2 if main else 0, **options)
        assert_same_analysis(result, alone, tol=0)
        assert result.shuffle == kind and (result.bounds is not None) == main


@pytest.mark.parametrize("nulls,match", [
    ("norms", "sequence"), ((), "non-empty"), (("values", "sizes"), "unknown"), (("norms", "norms"), "duplicates"),
])
def test_analyze_model_nulls_refuses_bad_null_lists(smollm2, nulls, match):
    with pytest.raises(ValueError, match=match):
        tl_geometry.analyze_model_nulls(smollm2.model, smollm2.tokens, nulls=nulls)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_streaming_texts_with_padding_equal_masked_cache(smollm2, batch_size):
    model = smollm2.model
    texts = ["The river rose slowly through the night.", "Bread needs flour, water, salt and time to rise well."]
    streamed = tl_geometry.analyze_model(model, texts, batch_size=batch_size, n_values=(1, 2, 4),
                                         random_samples=2, layers=[0, 7, 29])
    enc = model.tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    bos = torch.full((2, 1), model.tokenizer.bos_token_id)
    tokens = torch.cat([bos, enc["input_ids"]], 1)
    mask = torch.cat([torch.ones(2, 1, dtype=torch.long), enc["attention_mask"]], 1)
    assert (mask == 0).any()  # the shorter text is padded
    cache = _cache_in_batches(model, tokens, batch_size, mask)
    cached = tl_geometry.analyze_heads(cache, attention_mask=mask, n_values=(1, 2, 4), random_samples=2,
                                       layers=[0, 7, 29])
    assert_same_analysis(cached, streamed)


def test_streaming_rejects_bad_arguments(smollm2):
    with pytest.raises(ValueError, match="batch_size"):
        tl_geometry.analyze_model(smollm2.model, smollm2.tokens, batch_size=0)
    with pytest.raises(ValueError, match="token"):
        tl_geometry.analyze_model(smollm2.model, smollm2.tokens.float())
    with pytest.raises(ValueError, match="layers"):
        tl_geometry.analyze_model(smollm2.model, smollm2.tokens, layers=[99])


@pytest.mark.parametrize("kwargs,match", [
    ({"layers": [0.7]}, "layers"), ({"layers": [True]}, "layers"), ({"layers": ["0"]}, "layers"),
    ({"layers": [0, 0]}, "duplicates"), ({"shard": (0, 0)}, "shard"),
    ({"shard": (0, 2)}, "process group"), ({"bounds": "yes"}, "bounds"),
])
def test_streaming_validates_like_analyze_heads_before_any_forward(smollm2, monkeypatch, kwargs, match):
    """Refused before the first forward pass (which would take the whole run to fail)."""
    monkeypatch.setattr(type(smollm2.model), "__call__", lambda *a, **k: pytest.fail("forward ran"))
    with pytest.raises(ValueError, match=match):
        tl_geometry.analyze_model(smollm2.model, smollm2.tokens, **kwargs)


def test_streaming_refuses_token_ids_outside_the_vocabulary(smollm2):
    tokens = smollm2.tokens.clone()
    tokens[0, 3] = smollm2.model.cfg.d_vocab
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        tl_geometry.analyze_model(smollm2.model, tokens)
    result = tl_geometry.analyze_model(smollm2.model, smollm2.tokens, layers=[np.int64(2)],
                                       n_values=(2,), random_samples=1)
    assert result.layers == (2,)


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(
    os.path.join(os.path.dirname(sys.executable), "torchrun")), reason="torchrun not installed")
def test_torchrun_two_gloo_processes_equal_one(smollm2, tmp_path):
    """`torchrun --nproc-per-node 2 -m tl_geometry analyze` shards windows and all-reduces."""
    out = tmp_path / "dist.pt"
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "--master-port", "29517", "-m", "tl_geometry", "analyze",
         "--n-seqs", "4", "--seq-len", "24", "--n-values", "1,2,4", "--random-samples", "3",
         "--save", str(out)],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    distributed = tl_geometry.HeadAnalysis.load(out)
    assert distributed.metadata["world_size"] == 2
    tokens = tl_geometry.text_windows(smollm2.model, n_seqs=4, seq_len=24)
    # Each rank forwards its contiguous half (one batch of 2) on one thread: the same forwards here.
    cache = _cache_in_batches(smollm2.model, tokens, 2, threads=1)
    single = tl_geometry.analyze_heads(cache, n_values=(1, 2, 4), random_samples=3)
    assert_same_analysis(single, distributed)
