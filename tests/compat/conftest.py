"""Fixtures of the TransformerLens 3.x compatibility tests (run by ``bash scripts/compat.sh``).

``tl3``: SmolLM2 as a TransformerLens 3.x ``HookedTransformer`` built offline, its cache on the
same token windows as the main suite, and the plain HF model's log-probabilities. ``tl4``: the
same windows through the TransformerLens 4.x ``TransformerBridge``, computed by the main
environment's python (``$TL_GEOMETRY_TL4_PYTHON``) in a subprocess that runs while the
HookedTransformer is being built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from compat_inputs import ANALYSIS, LAYERS, N_SEQS, SEQ_LEN  # noqa: E402


@dataclass
class Hooked:
    model: Any  # HookedTransformer
    hf_model: Any
    tokenizer: Any
    tokens: torch.Tensor
    hf_log_probs: torch.Tensor
    log_probs: torch.Tensor  # the HookedTransformer's, from the same forward as the cache
    cache: Any  # ActivationCache with hook_pattern, hook_v and hook_z


@dataclass
class Bridge:
    transformer_lens: str
    tokens: torch.Tensor
    log_probs: torch.Tensor
    cache: dict[str, torch.Tensor]
    analysis: Any  # HeadAnalysis


@pytest.fixture(scope="session")
def tl4_process(tmp_path_factory) -> Iterator[tuple[subprocess.Popen, Path]]:
    """Starts the TransformerLens 4.x reference run; ``tl4`` collects it (stopped at the end if not)."""
    python = os.environ.get("TL_GEOMETRY_TL4_PYTHON")
    if not python or not Path(python).exists():
        pytest.fail("Set TL_GEOMETRY_TL4_PYTHON to the main environment's python "
                    "(bash scripts/compat.sh does this).")
    out = tmp_path_factory.mktemp("tl4")
    cmd = [python, str(HERE / "bridge_reference.py"), str(out), "--n-seqs", str(N_SEQS),
           "--seq-len", str(SEQ_LEN), "--layers", ",".join(map(str, LAYERS)),
           "--analysis", json.dumps(ANALYSIS)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    yield process, out
    if process.poll() is None:
        process.kill()
        process.communicate()


@pytest.fixture(scope="session")
def tl3(tl4_process) -> Hooked:
    from hooked_llama import hooked_llama

    import tl_geometry
    from tl_geometry.inputs.models import load_hf_model

    hf_model, tokenizer = load_hf_model("smollm2-135m")
    tokens = tl_geometry.text_windows(tokenizer, n_seqs=N_SEQS, seq_len=SEQ_LEN)
    with torch.no_grad():
        hf_log_probs = hf_model(tokens).logits.log_softmax(-1)
    model = hooked_llama(hf_model, tokenizer)
    with torch.no_grad():
        logits, cache = model.run_with_cache(
            tokens, names_filter=lambda n: tl_geometry.CACHE_NAMES_FILTER(n) or n.endswith("attn.hook_z")
        )
    return Hooked(model, hf_model, tokenizer, tokens, hf_log_probs, logits.log_softmax(-1), cache)


@pytest.fixture(scope="session")
def tl4(tl4_process, tl3) -> Bridge:  # after tl3: the two model loads overlap in time
    import tl_geometry

    process, out = tl4_process
    log, _ = process.communicate(timeout=600)
    if process.returncode != 0:
        pytest.fail(f"The TransformerLens 4.x reference run failed:\n{log.decode()[-3000:]}")
    saved = torch.load(out / "bridge.pt", weights_only=True)
    return Bridge(saved["transformer_lens"], saved["tokens"], saved["log_probs"], saved["cache"],
                  tl_geometry.HeadAnalysis.load(out / "analysis.pt"))
