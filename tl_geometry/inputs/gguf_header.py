"""Read a GGUF file's header without loading it: is the file whole (the tensors' bytes end inside
the file, so a truncated download is refused up front, not with a bare ``struct.error`` from
transformers), and what does it say.

Format (version 2 and 3; little-endian): ``b"GGUF"``, u32 version, u64 tensor count, u64
key/value count, the key/values, the tensor infos, padding to ``general.alignment`` (32), data.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GGUFHeaderError", "GGUFInfo", "read_gguf_info"]

MAGIC = b"GGUF"
_SCALARS = {  # GGUF value type → struct format; 8 (string) and 9 (array) are read apart
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class GGUFHeaderError(ValueError):
    """The file is not a whole GGUF file; the message says where it breaks off."""


@dataclass(frozen=True)
class GGUFInfo:
    """What the header of a GGUF file says, and where its tensor data ends (``None`` where a
    tensor's quantisation type is unknown to the installed ``gguf``); ``add_bos_token`` is
    ``tokenizer.ggml.add_bos_token`` (``None`` where the file does not say)."""

    size: int
    version: int
    architecture: str | None
    context_length: int | None
    n_tensors: int
    data_end: int | None
    add_bos_token: bool | None = None


class _Reader:
    """Sequential little-endian reads from a buffer; reading past its end raises GGUFHeaderError."""

    def __init__(self, buffer: Any, size: int) -> None:
        self.buffer, self.size, self.pos = buffer, size, 0

    def take(self, fmt: str) -> Any:
        width = struct.calcsize(fmt)
        self._need(width)
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += width
        return value

    def skip(self, n_bytes: int) -> None:
        self._need(n_bytes)
        self.pos += n_bytes

    def string(self) -> bytes:
        length = self.take("<Q")
        self.skip(length)
        return bytes(self.buffer[self.pos - length:self.pos])

    def _need(self, n_bytes: int) -> None:
        if self.pos + n_bytes > self.size:
            raise GGUFHeaderError(f"the header breaks off: it needs byte {self.pos + n_bytes:,} but "
                                  f"the file has {self.size:,} bytes")

    def value(self, kind: int) -> Any:
        """One metadata value; arrays are skipped (``None``): the header checks need none of them."""
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GGUFHeaderError(f"unknown metadata value type {kind} at byte {self.pos:,}")
        item, count = self.take("<I"), self.take("<Q")
        if item in _SCALARS:  # fixed width: one jump
            self.skip(count * struct.calcsize(_SCALARS[item]))
        else:  # strings (a vocabulary) or nested arrays: walk them
            for _ in range(count):
                self.value(item)
        return None


def _tensor_bytes(kind: int, shape: tuple[int, ...]) -> int | None:
    """Bytes of one tensor of quantisation type ``kind``; ``None`` if the type is unknown here."""
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ImportError, ValueError, KeyError):
        return None
    return math.prod(shape) // block * type_size


def _parse(reader: _Reader, size: int) -> GGUFInfo:
    if bytes(reader.buffer[:4]) != MAGIC:
        raise GGUFHeaderError("it does not start with 'GGUF'")
    reader.skip(4)
    version = reader.take("<I")
    if version not in (2, 3):
        raise GGUFHeaderError(f"GGUF version {version} is not read here (versions 2 and 3 are)")
    n_tensors, n_kv = reader.take("<Q"), reader.take("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = reader.string().decode("utf-8", "replace")
        meta[key] = reader.value(reader.take("<I"))
    ends: list[int | None] = []
    for _ in range(n_tensors):
        reader.string()  # the tensor's name
        shape = tuple(reader.take("<Q") for _ in range(reader.take("<I")))
        kind, offset = reader.take("<I"), reader.take("<Q")
        nbytes = _tensor_bytes(kind, shape)
        ends.append(None if nbytes is None else offset + nbytes)
    alignment = meta.get("general.alignment") or _DEFAULT_ALIGNMENT
    data_start = -(-reader.pos // alignment) * alignment
    known = [end for end in ends if end is not None]
    data_end = data_start + max(known, default=0) if len(known) == len(ends) else None
    arch = meta.get("general.architecture")
    architecture = arch.decode("utf-8", "replace") if isinstance(arch, bytes) else None
    context = meta.get(f"{architecture}.context_length") if architecture else None
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    return GGUFInfo(size, version, architecture, int(context) if isinstance(context, int) else None,
                    n_tensors, data_end, add_bos if isinstance(add_bos, bool) else None)


def read_gguf_info(path: str | Path) -> GGUFInfo:
    """The header of the GGUF file at ``path``; reads no tensor data. Raises
    :class:`GGUFHeaderError` (a ``ValueError``) for a file that is not GGUF, breaks off inside its
    header, or ends before its tensors do; ``OSError`` if it cannot be read.

    Example:
        >>> read_gguf_info("model.gguf").context_length  # doctest: +SKIP
        8192
    """
    path = Path(path)
    with path.open("rb") as handle:
        size = path.stat().st_size
        if size < 4:
            raise GGUFHeaderError(f"it has only {size} byte(s); a GGUF header has at least 24")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            info = _parse(_Reader(buffer, size), size)
    if info.data_end is not None and info.data_end > size:
        raise GGUFHeaderError(f"it is truncated: its tensors end at byte {info.data_end:,} but the "
                              f"file has {size:,} bytes")
    return info
