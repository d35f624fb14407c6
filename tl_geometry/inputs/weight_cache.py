"""The weight cache: a GGUF model's de-quantised weights, kept as safetensors for the next load.

The first load writes the de-quantised model (``save_pretrained``) into
``<cache>/weights/<entry>/``, named by the GGUF file's sha256 and size and the dtype, which later
processes read in seconds instead of 30–110 s. A ``manifest.json``, written last, records each
file's size and sha256: an entry that differs from it is reported, removed and rebuilt. Entries
are written into a temporary folder and renamed into place; files are removed by unlink, never
truncated (truncating a memory-mapped file kills its readers with SIGBUS). What the cache owns,
and so what :func:`clear` removes, is recognised by name and kind (docs/pitfalls.md, "The weight
cache"); no symbolic link is followed. Off: ``load_model(..., weight_cache=False)`` or
``TL_GEOMETRY_WEIGHT_CACHE=0``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import stat
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .model_files import (
    MEMO_NAME,
    MEMO_TEMPORARY,
    CacheFolderError,
    atomic_write_text,
    cache_dir,
    cache_origin,
    file_sha256,
    file_stamp,
    hash_file,
    not_a_folder,
    recorded_digests,
    remember_sha256,
)

__all__ = [
    "ENV",
    "Cleared",
    "EntryKey",
    "Problem",
    "Tally",
    "Usage",
    "clear",
    "enabled",
    "entry_key",
    "lookup",
    "store",
    "usage",
    "verify",
    "weights_root",
]

ENV = "TL_GEOMETRY_WEIGHT_CACHE"
MANIFEST = "manifest.json"
#: Written first into every entry this cache fills: the proof that it may delete the folder. Not
#: listed in the manifest (it says who wrote the folder, not what the weights are).
MARKER = ".tl_geometry_entry"
FORMAT = 1
#: The names the cache gives what it writes under ``weights/``: entries, the folders a fill writes
#: into, and entries renamed away to be deleted.
_ENTRY_NAME = re.compile(r"[0-9a-f]{32}-[0-9]+-[A-Za-z0-9_]+")
_TEMPORARY = re.compile(rf"\.(?:{_ENTRY_NAME.pattern})\.[A-Za-z0-9_]+\.tmp")
_DISCARDED = re.compile(rf"\.(?:{_ENTRY_NAME.pattern})\.[0-9a-f]{{8}}\.stale")
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
    path: str = ""  # the GGUF file's absolute path, re-hashed by verify()

    @property
    def name(self) -> str:
        return f"{self.sha256[:32]}-{self.size}-{self.dtype}"


def entry_key(gguf: Path, dtype: str) -> EntryKey:
    """The key of ``gguf``'s weights in ``dtype``; hashes the file once per stamp (size, mtime,
    ctime, inode, device), so any change to the file is seen."""
    return EntryKey(file_sha256(gguf), gguf.stat().st_size, dtype, gguf.name, str(gguf.absolute()))


def _problems(folder: Path, hash_of: Callable[[Path], str], everything: bool = False) -> Iterator[Problem]:
    """What is wrong with the entry in ``folder``, one problem at a time (a load stops at the
    first): its manifest, each file it lists (``hash_of``: a file's sha256), and with
    ``everything`` (:func:`verify`) the files it does not list and the GGUF file it was made from."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        files, source = manifest["files"], manifest["source"]
        wanted = {str(name): (int(want["size"]), str(want["sha256"])) for name, want in files.items()}
        key = EntryKey(str(source["sha256"]), int(source["size"]), str(manifest["dtype"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        yield Problem("corrupt", folder, "incomplete (no readable manifest)")
        return
    if manifest.get("format") != FORMAT:
        yield Problem("stale", folder, f"in cache format {manifest.get('format')!r}, not {FORMAT}")
        return
    if folder.name != key.name:
        yield Problem("corrupt", folder, f"its manifest is that of entry {key.name}")
    for name, (size, sha256) in wanted.items():
        path = folder / name
        if not path.is_file():
            yield Problem("corrupt", path, "missing")
        elif path.stat().st_size != size:
            yield Problem("corrupt", path, f"{path.stat().st_size:,} bytes, not {size:,}")
        elif hash_of(path) != sha256:
            yield Problem("corrupt", path, "does not match its recorded sha256")
    if not everything:
        return
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and name not in (MANIFEST, MARKER) and name not in wanted:
            yield Problem("corrupt", path, "a file the entry's manifest does not list")
    origin = source.get("path")
    if isinstance(origin, str) and origin:  # entries written before paths were recorded: unknown
        gguf = Path(origin)
        if not gguf.is_file():
            yield Problem("stale", folder, f"made from {gguf}, which is gone")
        elif gguf.stat().st_size != key.size or hash_of(gguf) != key.sha256:
            yield Problem("stale", folder, f"made from {gguf}, which has changed since (loading it "
                                           "now makes another entry)")


def _is_kind(path: Path, test: Callable[[int], bool]) -> bool:
    """Whether ``path`` itself (not a symbolic link's target) passes the ``stat`` mode ``test``."""
    try:
        return test(path.lstat().st_mode)
    except OSError:
        return False


_is_folder = functools.partial(_is_kind, test=stat.S_ISDIR)
_is_file = functools.partial(_is_kind, test=stat.S_ISREG)


def _written_here(folder: Path) -> bool:
    """Whether ``folder`` is an entry this cache wrote (not a symbolic link): its name, and the
    marker or an older entry's manifest."""
    if not _ENTRY_NAME.fullmatch(folder.name) or not _is_folder(folder):
        return False
    if _is_file(folder / MARKER):
        return True
    if not _is_file(folder / MANIFEST):
        return False
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "format" in manifest and isinstance(manifest.get("source"), dict)


def _discard(folder: Path) -> None:
    """Take ``folder`` out of use at once (a rename), then delete it."""
    grave = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}.stale")
    try:
        folder.rename(grave)
    except FileNotFoundError:  # another process removed it first
        return
    shutil.rmtree(grave, ignore_errors=True)


def _is_old(path: Path) -> bool:
    """Whether ``path`` was last written over a day ago (a temporary of a process that died)."""
    try:
        return time.time() - path.lstat().st_mtime > _STALE_AFTER_S
    except OSError:  # another process removed it meanwhile
        return False


def _is_temporary(path: Path) -> bool:
    """Whether ``path``, in ``weights/``, is a folder a fill writes into (``.{entry}.{random}.tmp``)
    or an entry renamed away to be deleted (``.{entry}.{8 hex}.stale``), not a link to one."""
    return bool(_TEMPORARY.fullmatch(path.name) or _DISCARDED.fullmatch(path.name)) and _is_folder(path)


def lookup(key: EntryKey) -> Path | None:
    """The entry folder for ``key`` when it exists and checks out; a damaged one is removed, and
    one the cache did not write (:func:`_written_here`) is neither used nor removed."""
    folder = weights_root() / key.name
    if not _written_here(folder):  # missing, or the user's: neither used nor removed (store() says so)
        return None
    problem = next(_problems(folder, file_sha256), None)
    if problem is None:
        return folder
    warnings.warn(f"The weight cache entry {folder} failed its check ({problem}); it is removed and "
                  f"rebuilt from {key.source or 'the GGUF file'}.", stacklevel=3)
    _discard(folder)
    return None


def _manifest(folder: Path, key: EntryKey) -> str:
    from importlib.metadata import version

    files = {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": hash_file(path)}
        for path in sorted(folder.rglob("*")) if path.is_file() and path != folder / MARKER
    }
    return json.dumps({
        "format": FORMAT,
        "source": {"name": key.source, "path": key.path, "sha256": key.sha256, "size": key.size},
        "dtype": key.dtype,
        "transformers": version("transformers"),
        "files": files,
    }, indent=1)


def store(key: EntryKey, write: Callable[[Path], None]) -> Path:
    """Fill the entry for ``key`` (``write(folder)`` saves the files, the manifest is added, the
    folder renamed into place) and return it, or an equal one another process put there first;
    errors propagate with nothing left behind."""
    root = weights_root()
    blocked = not_a_folder(root)
    if blocked is not None:
        raise NotADirectoryError(f"{blocked[0]} is {blocked[1]}, not a folder: the weight cache keeps "
                                 f"its entries in {root}; move it away")
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):  # removed meanwhile: nothing to sweep
        for path in list(root.iterdir()):  # what a killed process left behind
            if _is_temporary(path) and _is_old(path):
                shutil.rmtree(path, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{key.name}.", suffix=".tmp"))
    final = root / key.name
    try:
        # First, before any weights: whatever happens next, the folder says the cache wrote it.
        (tmp / MARKER).write_text("A tl_geometry weight-cache entry (tl_geometry.inputs.weight_cache)."
                                  "\n", encoding="utf-8")
        write(tmp)
        atomic_write_text(tmp / MANIFEST, _manifest(tmp, key))
        try:
            tmp.rename(final)
        except OSError:  # the name is taken: another process finished first, or a damaged entry
            if lookup(key) is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            if os.path.lexists(final) and not _written_here(final):
                raise FileExistsError(f"{final} stands where a weight-cache entry goes, and the cache "
                                      f"did not write it (no {MARKER} or manifest): move it away") from None
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # The digests just computed, under the files' final paths (renaming the folder leaves its
    # files' stamps as they were), so that the next load does not hash them again.
    for name, want in json.loads((final / MANIFEST).read_text(encoding="utf-8"))["files"].items():
        remember_sha256(final / name, want["sha256"])
    return final


# --- verify, usage, clear ------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """What :func:`verify` found wrong with one item (``path``: the entry folder or the file):
    ``kind`` ``"corrupt"`` (its bytes are not those recorded) or ``"stale"`` (whole, but the GGUF
    file it was made from has changed or gone since; ``cache verify`` does not fail on it)."""

    kind: str
    path: Path
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.path}: {self.detail}"


def verify() -> list[Problem]:
    """Re-hash, in full, everything the cache records a digest of; list what does not match: an
    entry's files against its manifest (``corrupt``), the GGUF file it was made from (``stale``),
    every remembered digest still in force (``corrupt``). Nothing is changed; empty lists mean
    everything checks out."""
    _check_subfolders()
    done: dict[str, str] = {}  # each file read once (several entries share a source)

    def hash_of(path: Path) -> str:
        stamp = file_stamp(path)
        if stamp not in done:
            done[stamp] = hash_file(path)
        return done[stamp]

    problems: list[Problem] = []
    root = weights_root()
    for folder in sorted(p for p in root.iterdir() if _written_here(p)) if root.is_dir() else ():
        problems.extend(_problems(folder, hash_of, everything=True))
    for record in recorded_digests():
        try:
            if record.in_force() and hash_of(record.path) != record.sha256:
                problems.append(Problem("corrupt", record.path, f"does not match the sha256 remembered "
                                        f"in {record.memo}, although its size, times and inode do"))
        except OSError:  # removed meanwhile: the record is no longer used
            continue
    return problems


@dataclass
class Tally:
    """How many items, and how many bytes in all."""

    count: int = 0
    size: int = 0


@dataclass
class Usage:
    """What the cache owns, by kind, and what lies in its folders that it did not write
    (``foreign``: left alone by :func:`clear`)."""

    root: Path
    origin: str  # how the root was chosen, in words
    entries: Tally
    assembled: Tally
    digests: Tally
    temporary: Tally
    foreign: list[Path] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Bytes in all."""
        return sum(t.size for t in (self.entries, self.assembled, self.digests, self.temporary))

    def add(self, kind: str, size: int) -> None:
        """Count one item of ``kind`` (a tally's name) and its bytes."""
        tally = getattr(self, kind)
        tally.count += 1
        tally.size += size


def _size(path: Path) -> int:
    """Bytes of a file, or of every file under a folder; a symbolic link counts as itself, and
    what is gone meanwhile counts 0."""
    try:
        if not _is_folder(path):
            return path.lstat().st_size
        total = 0
        for top, folders, files in os.walk(path):  # links to folders are listed, not entered
            for name in (*folders, *files):
                info = os.lstat(os.path.join(top, name))
                total += 0 if stat.S_ISDIR(info.st_mode) else info.st_size
        return total
    except OSError:
        return 0


#: The built-in models' assembled GGUF files, ``{folder under the cache: file name}``. The model
#: table fills it when it is imported (it imports this module, so the names are handed down).
ASSEMBLED: dict[str, str] = {}

_SUBFOLDERS = {"weights": "the weight-cache entries", "sha256": "the remembered file digests"}


def _check_subfolders() -> None:
    """Raise :class:`~tl_geometry.inputs.model_files.CacheFolderError` when ``weights`` or
    ``sha256`` is neither a folder nor a symbolic link (the user's, never followed)."""
    for name, holds in _SUBFOLDERS.items():
        folder = cache_dir() / name
        blocked = None if folder.is_symlink() else not_a_folder(folder)
        if blocked is not None:
            raise CacheFolderError(f"{blocked[0]} is {blocked[1]}, not a folder: the cache keeps {holds} "
                                   "there. Move it away (or set TL_GEOMETRY_CACHE to another folder)")


def _file_named(pattern: re.Pattern[str]) -> Callable[[Path], bool]:
    """Whether a path is a regular file (not a link) whose whole name matches ``pattern``."""
    return lambda path: _is_file(path) and pattern.fullmatch(path.name) is not None


def _owned() -> tuple[list[tuple[str, Path]], list[Path]]:
    """Every file and folder the cache wrote, with its kind (a field of :class:`Usage`): in each
    folder, the first kind whose test it passes; and what else lies there (foreign, as is a
    symbolic link in a folder's place). No link is followed."""
    _check_subfolders()
    folders: list[tuple[Path, dict[str, Callable[[Path], bool]]]] = [
        (weights_root(), {"entries": _written_here, "temporary": _is_temporary}),
        (cache_dir() / "sha256", {"digests": _file_named(MEMO_NAME),
                                  "temporary": _file_named(MEMO_TEMPORARY)}),
        *((cache_dir() / model, {"assembled": _file_named(re.compile(re.escape(name))), "temporary":
           _file_named(re.compile(rf"\.{re.escape(name)}\.[A-Za-z0-9_]+\.tmp"))})
          for model, name in sorted(ASSEMBLED.items())),
    ]
    items: list[tuple[str, Path]] = []
    foreign: list[Path] = []
    for folder, kinds in folders:
        if folder.is_symlink():
            foreign.append(folder)
        for path in sorted(folder.iterdir()) if _is_folder(folder) else ():
            kind = next((kind for kind, owns in kinds.items() if owns(path)), None)
            if kind is None:
                foreign.append(path)
            else:
                items.append((kind, path))
    return items, foreign


def _new_usage() -> Usage:
    return Usage(cache_dir(), cache_origin(), Tally(), Tally(), Tally(), Tally())


def usage() -> Usage:
    """Where the cache is, how that was chosen, and what it owns (counts and bytes)."""
    items, foreign = _owned()
    found = _new_usage()
    for kind, path in items:
        found.add(kind, _size(path))
    found.foreign = foreign
    return found


@dataclass
class Cleared:
    """What :func:`clear` removed, kept (temporaries of loads that may still run), could not
    remove (one message each), and left alone as not its own (``foreign``)."""

    removed: Usage
    kept: Usage
    errors: list[str]
    foreign: list[Path] = field(default_factory=list)


def clear() -> Cleared:
    """Empty the cache of what it wrote (:func:`_owned`), except temporaries less than a day old
    (of loads that may still run); everything else is left alone and listed in ``foreign``. Files
    are unlinked, never truncated; a cache path that is not a folder raises
    :class:`~tl_geometry.inputs.model_files.CacheFolderError` before anything is removed."""
    items, foreign = _owned()
    done = Cleared(_new_usage(), _new_usage(), [], foreign)
    for kind, path in items:
        size = _size(path)
        if kind == "temporary" and path.name.endswith(".tmp") and not _is_old(path):
            into = done.kept
        else:
            try:  # unlinked, never truncated; no symbolic link followed
                if kind == "entries":
                    _discard(path)  # renamed away first, so that no load finds it half deleted
                elif _is_folder(path):
                    shutil.rmtree(path)  # refuses a link; links inside are unlinked, their targets kept
                else:
                    path.unlink(missing_ok=True)
            except FileNotFoundError:  # another process removed it first
                pass
            except OSError as err:
                done.errors.append(f"{path}: {err.strerror or err}")
                continue
            into = done.removed
        into.add(kind, size)
    for folder in (*(cache_dir() / model for model in ASSEMBLED), weights_root(), cache_dir() / "sha256"):
        if _is_folder(folder):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty
    return done
