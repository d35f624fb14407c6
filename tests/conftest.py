"""Session-scoped real models: each is loaded once per test session, on small inputs."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

# The shared helpers beside this file (tests/reference.py, tests/cases.py, tests/repo_paths.py, ...)
# and every folder of test modules (tests/<package folder>/): a test imports another test module's
# helpers by its name (``from test_ablation import TinyLM``), whichever files pytest was given.
_TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_TESTS), *sorted({str(p.parent) for p in _TESTS.glob("*/test_*.py")})]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

N_SEQS, SEQ_LEN = 3, 40


#: The session fixtures that load a real model: a test that uses one (directly or through another
#: fixture) is marked ``real_model``, which ``bash scripts/dev.sh test --fast`` leaves out.
REAL_MODEL_FIXTURES = frozenset({"smollm2", "gemma3", "real"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


@dataclass
class RealModel:
    name: str
    model: Any  # TransformerBridge
    tokens: torch.Tensor
    hf_logits: torch.Tensor  # logits of the plain HF model, computed before it was wrapped
    cache: Any  # ActivationCache with hook_pattern, hook_v and hook_z


def _real_model(name: str) -> RealModel:
    import tl_geometry
    from tl_geometry.inputs.models import _bridge_from_hf, load_hf_model

    hf_model, tokenizer = load_hf_model(name)
    tokens = tl_geometry.text_windows(tokenizer, n_seqs=N_SEQS, seq_len=SEQ_LEN)
    with torch.no_grad():
        hf_logits = hf_model(tokens).logits
    model = _bridge_from_hf(name, hf_model, tokenizer, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        _, cache = model.run_with_cache(
            tokens, names_filter=lambda n: tl_geometry.CACHE_NAMES_FILTER(n) or n.endswith("attn.hook_z")
        )
    return RealModel(name, model, tokens, hf_logits, cache)


@pytest.fixture(scope="session")
def smollm2() -> RealModel:
    return _real_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3() -> RealModel:
    return _real_model("gemma3-270m")


@pytest.fixture(params=["smollm2", "gemma3"])
def real(request) -> RealModel:
    return request.getfixturevalue(request.param)


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A user cache of the test's own (``TL_GEOMETRY_CACHE``), never the user's, with no weight
    cache setting inherited from the environment."""
    from tl_geometry.inputs import weight_cache

    folder = tmp_path / "cache"
    monkeypatch.setenv("TL_GEOMETRY_CACHE", str(folder))
    monkeypatch.delenv(weight_cache.ENV, raising=False)
    return folder


@pytest.fixture
def no_model_load(monkeypatch):
    """Any attempt to load weights fails the test (the CLI catches ValueError, not
    AssertionError): what a test of a refusal "before the model loads" runs under."""
    import tl_geometry
    from tl_geometry.inputs import models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded although an argument was bad")

    monkeypatch.setattr(tl_geometry, "load_model", refuse, raising=False)
    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "load_hf_model", refuse)
