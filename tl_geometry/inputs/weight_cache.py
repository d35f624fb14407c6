"""The weight cache: a GGUF model's de-quantised weights, kept as safetensors for the next load.

De-quantising a GGUF file costs 20–90 s in every process (SmolLM2-135M to Qwen2.5-Coder-0.5B on
two cores), and converting its tokenizer 10–25 s more. The first load writes what came out —
the transformers model (``save_pretrained``: ``config.json``, ``*.safetensors``) and its
tokenizer — into ``<cache>/weights/<entry>/``; later processes read that folder, which takes a
few seconds.

- **Key.** An entry is named by the GGUF file's sha256 and size and the dtype loaded, so a
  changed file, or another dtype, gets its own entry.
- **Checked on every load.** A ``manifest.json`` written last records each file's size and
  sha256. An entry whose manifest is missing or unreadable, or whose files differ from it
  (partial, truncated, edited), is reported with a warning, removed and rebuilt, never used.
  Sizes are compared on every load; a file is re-hashed (about 1.4 GB/s) whenever its size or
  mtime differs from when it was last hashed, so an unchanged entry costs no hashing, and any
  write to a file (which moves its mtime) is caught.
- **Atomic.** An entry is written into a temporary folder beside it and renamed into place
  when complete, so a crash or a second process filling the same entry at once never leaves a
  partial entry under the real name; the second rename finds the entry there and keeps it.
- **Off switch.** ``load_model(..., weight_cache=False)`` or ``TL_GEOMETRY_WEIGHT_CACHE=0``.
  Delete ``<cache>/weights`` (or the whole cache folder) to free the space; nothing else
  refers to it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .model_files import atomic_write_text, cache_dir, file_sha256, hash_file, remember_sha256

__all__ = ["ENV", "EntryKey", "enabled", "entry_key", "lookup", "store", "weights_root"]

ENV = "TL_GEOMETRY_WEIGHT_CACHE"
MANIFEST = "manifest.json"
FORMAT = 1
_OFF = {"0", "false", "no", "off"}
_STALE_AFTER_S = 24 * 3600  # temporary folders older than this belong to a process that died


def enabled(option: bool | None = None) -> bool:
    """Whether to use the cache: ``option`` when given, else ``$TL_GEOMETRY_WEIGHT_CACHE`` (on
    unless ``0``, ``false``, ``no`` or ``off``)."""
    if option is not None:
        return bool(option)
    return os.environ.get(ENV, "1").strip().lower() not in _OFF


def weights_root() -> Path:
    """The folder holding the entries: ``<cache>/weights``."""
    return cache_dir() / "weights"


@dataclass(frozen=True)
class EntryKey:
    """What an entry holds: the weights of the GGUF file with this sha256 and size, in ``dtype``."""

    sha256: str
    size: int
    dtype: str  # "float32", "bfloat16", ...
    source: str = ""  # the GGUF file's name, recorded for people reading the manifest

    @property
    def name(self) -> str:
        return f"{self.sha256[:32]}-{self.size}-{self.dtype}"


def entry_key(gguf: Path, dtype: str) -> EntryKey:
    """The key of ``gguf``'s weights in ``dtype``; hashes the file once (remembered by mtime)."""
    return EntryKey(file_sha256(gguf), gguf.stat().st_size, dtype, gguf.name)


def _problem(folder: Path, key: EntryKey) -> str | None:
    """What is wrong with the entry in ``folder``, or ``None`` when every file checks out."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        source = manifest["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return "incomplete (no readable manifest)"
    if manifest.get("format") != FORMAT:
        return f"in cache format {manifest.get('format')!r}, not {FORMAT}"
    if (source.get("sha256"), source.get("size"), manifest.get("dtype")) != (key.sha256, key.size, key.dtype):
        return "for another source file or dtype"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"missing {name}"
        if path.stat().st_size != want["size"]:
            return f"damaged ({name} has {path.stat().st_size:,} bytes, not {want['size']:,})"
        if file_sha256(path) != want["sha256"]:
            return f"damaged ({name} does not match its recorded sha256)"
    return None


def _discard(folder: Path) -> None:
    """Take ``folder`` out of use at once (a rename), then delete it."""
    grave = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}.stale")
    try:
        folder.rename(grave)
    except FileNotFoundError:  # another process removed it first
        return
    shutil.rmtree(grave, ignore_errors=True)


def _sweep(root: Path) -> None:
    """Delete temporary and discarded folders that a killed process left behind."""
    now = time.time()
    for path in root.glob(".*"):
        try:
            old = now - path.stat().st_mtime > _STALE_AFTER_S
        except OSError:  # another process removed it meanwhile
            continue
        if path.suffix in (".tmp", ".stale") and old:
            shutil.rmtree(path, ignore_errors=True)


def lookup(key: EntryKey) -> Path | None:
    """The entry folder for ``key`` when it exists and checks out; a damaged one is removed."""
    folder = weights_root() / key.name
    if not folder.exists():
        return None
    problem = _problem(folder, key)
    if problem is None:
        return folder
    warnings.warn(f"The weight cache entry {folder} is {problem}; it is removed and rebuilt from "
                  f"{key.source or 'the GGUF file'}.", stacklevel=3)
    _discard(folder)
    return None


def _manifest(folder: Path, key: EntryKey) -> str:
    from importlib.metadata import version

    files = {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": hash_file(path)}
        for path in sorted(folder.rglob("*")) if path.is_file()
    }
    return json.dumps({
        "format": FORMAT,
        "source": {"name": key.source, "sha256": key.sha256, "size": key.size},
        "dtype": key.dtype,
        "transformers": version("transformers"),
        "files": files,
    }, indent=1)


def store(key: EntryKey, write: Callable[[Path], None]) -> Path:
    """Fill the entry for ``key``: ``write(folder)`` saves the files, then the manifest is added
    and the folder renamed into place. Returns the entry folder (this one, or an equal one that
    another process put there first). ``OSError`` (disk full, read-only cache) propagates, with
    nothing left behind.
    """
    root = weights_root()
    root.mkdir(parents=True, exist_ok=True)
    _sweep(root)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{key.name}.", suffix=".tmp"))
    final = root / key.name
    try:
        write(tmp)
        atomic_write_text(tmp / MANIFEST, _manifest(tmp, key))
        try:
            tmp.rename(final)
        except OSError:  # the name is taken: another process finished first, or a damaged entry
            if lookup(key) is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remember(final)
    return final


def _remember(folder: Path) -> None:
    """Remember the digests just computed, under the files' final paths (a rename keeps mtimes),
    so the next load does not hash them again."""
    files = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
    for name, want in files.items():
        remember_sha256(folder / name, want["sha256"])
