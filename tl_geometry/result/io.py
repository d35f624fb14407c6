"""Versioned, checked result files for :class:`~tl_geometry.result.HeadAnalysis`.

A file is a ``torch.save`` dict read back with ``torch.load(weights_only=True)`` (a crafted
pickle is refused, never executed): ``format``, ``axes`` and ``names`` (every axis label, so a
file is read by name, never by position), the tensors, ``layers``, the metadata as JSON and
``checksum`` (:func:`checksum`). On load everything is checked; any problem raises
:class:`ResultFileError` naming the file. An older file loads with the fields its version lacks
(:data:`_FIELD_SINCE`, :data:`_ADDED_IN`) ``None`` or NaN; one that holds what a later format
added is refused (relabelled to skip its checksum); format 1 (no axis labels) loads with a warning.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
import warnings
from enum import Enum
from pathlib import Path, PurePath
from typing import Any

import torch
from torch import Tensor

from ..functional.figures import added_since
from .schema import AXES, COUNT_FIELDS, OPTIONAL, check_fields, names

#: The result file format: 9, where the last fields came in (:data:`_FIELD_SINCE`), or the
#: ``since`` of a figure added later (:func:`~tl_geometry.functional.figures.added_since`).
FORMAT_VERSION = max([9, *(v for added in added_since().values() for v in added.values())])
FORMAT = f"tl_geometry.HeadAnalysis/{FORMAT_VERSION}"
_FORMAT_PREFIX = "tl_geometry.HeadAnalysis/"
#: The first format version that stores a checksum.
_CHECKSUM_SINCE = 3
#: The labels format 1 used (it did not save them): what its axes meant.
_FORMAT1_NAMES = {
    "group": ("top", "random", "sink_removed", "sink_in", "sink_out"),
    "metric": ("precision", "recall", "f_score", "margin", "inversions"),
    "sink_field": ("mass", "norm_ratio", "cosine", "mean_cosine", "share"),
    "vote": ("current", "sink", "other"),
    "bound_kind": ("inversion", "certified", "predicted"),
    "bound_metric": ("precision", "recall", "f_score"),
    "regime_field": ("norm_cv", "kappa", "a", "decay", "b", "fit_mae"),
    "class": ("Retriever", "Mixer", "Reset"),
}
#: Labels that a format version added to a named axis: a file of an earlier version lacks them
#: by construction, so they are filled (NaN) without a warning.
_ADDED_IN: dict[str, dict[str, int]] = {**added_since(), "window_group": {"sink_in": 9, "sink_out": 9}}
#: Entries of the payload (and of its ``axes`` / ``names``) by the format version that added
#: them: a file of an earlier version cannot hold them, so one that does was relabelled.
_FIELD_SINCE: dict[str, int] = {
    "axes": 2, "names": 2, "paired": 2, "paired_field": 2,
    "checksum": 3, "sequence_votes": 4, "truncation_p90": 5, "truncation_metric": 5,
    "beyond_votes": 6, "block_votes": 6, "window_scores": 6, "window_sink": 6, "window_group": 6,
    "window_bounds": 7, "baseline_se": 8, "se_kind": 8, "local_sink": 9, "local_field": 9,
}
#: Tensors in metadata up to this many elements are stored as (nested) lists.
MAX_METADATA_TENSOR = 10_000
_TUPLE, _ITEMS = "__tuple__", "__items__"


class ResultFileError(ValueError):
    """A file that is not a readable, consistent tl_geometry result; the message names the file
    and the problem."""


def encode_metadata(value: Any, where: str = "metadata") -> Any:
    """``value`` as JSON-ready data that :func:`decode_metadata` turns back into it: plain data
    and tuple / non-string keys exactly; paths, dtypes, devices → ``str``; sets → sorted lists;
    enums → their value; small tensors and arrays → nested lists; else ``ValueError``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [encode_metadata(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {_TUPLE: items}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and set(value) not in ({_TUPLE}, {_ITEMS}):
            return {k: encode_metadata(v, f"{where}[{k!r}]") for k, v in value.items()}
        items = []
        for k, v in value.items():
            if not (k is None or isinstance(k, (bool, int, float, str, tuple))):
                raise ValueError(f"{where}: key {k!r} ({type(k).__name__}) cannot be saved; "
                                 "use str, int, float, bool or tuple keys.")
            items.append([encode_metadata(k, f"{where} key"), encode_metadata(v, f"{where}[{k!r}]")])
        return {_ITEMS: items}
    if isinstance(value, (PurePath, torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (set, frozenset)):
        return [encode_metadata(v, where) for v in sorted(value, key=repr)]
    if isinstance(value, Enum):
        return encode_metadata(value.value, where)
    if isinstance(value, Tensor) or type(value).__module__ == "numpy":
        size = value.numel() if isinstance(value, Tensor) else getattr(value, "size", 1)
        if size > MAX_METADATA_TENSOR:
            raise ValueError(f"{where}: an array of {size} elements is too large for metadata "
                             f"(at most {MAX_METADATA_TENSOR}); save it in a separate file.")
        plain = value.detach().cpu().tolist() if isinstance(value, Tensor) else value.tolist()
        return encode_metadata(plain, where)
    raise ValueError(f"{where}: a {type(value).__name__} cannot be saved in a result file; "
                     "store it as str, int, float, bool, None, list, tuple or dict.")


def decode_metadata(value: Any) -> Any:
    """Inverse of :func:`encode_metadata` (tuples and non-string keys come back as they were)."""
    if isinstance(value, list):
        return [decode_metadata(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(decode_metadata(v) for v in value[_TUPLE])
        if set(value) == {_ITEMS}:
            return {_hashable(decode_metadata(k)): decode_metadata(v) for k, v in value[_ITEMS]}
        return {k: decode_metadata(v) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def checksum(payload: dict[str, Any]) -> str:
    """SHA-256 (hex) of every entry of ``payload`` but ``"checksum"``, by sorted key: a tensor
    as its dtype, shape and raw bytes, anything else as canonical JSON."""
    digest = hashlib.sha256()
    for key in sorted(payload):
        if key == "checksum":
            continue
        value = payload[key]
        digest.update(json.dumps(key).encode())
        if isinstance(value, Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"tensor {flat.dtype} {list(value.shape)}".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        else:
            digest.update(json.dumps(value, sort_keys=True, allow_nan=True).encode())
    return digest.hexdigest()


def writable_path(path: Path, example: str = "analysis.pt") -> Path:
    """``path`` if a file can be written there; else a ``ValueError`` naming the path and the fix
    (``example``: the file name suggested inside a folder)."""
    if path.is_dir():
        raise ValueError(f"cannot save to {path}: it is a folder. Give a file path, e.g. "
                         f"{path / example}.")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"cannot save to {path}: {parent} is a file, not a folder. "
                                 "Choose a path whose folders are folders.")
            break
    return path


def save(fields: dict[str, Any], path: str | Path) -> Path:
    """Write ``fields`` (the HeadAnalysis dataclass fields) to ``path``, atomically (written
    beside it and renamed)."""
    path = writable_path(Path(path))
    metadata = json.dumps(encode_metadata(fields["metadata"]), allow_nan=True)
    payload: dict[str, Any] = {
        "format": FORMAT,
        "axes": {k: list(v) for k, v in AXES.items()},
        "names": {k: list(v) for k, v in names().items()},
        "layers": list(fields["layers"]),
        "metadata": metadata,
    }
    for key in AXES:
        value = fields[key]
        payload[key] = None if value is None else value.detach().cpu()
    payload["checksum"] = checksum(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    # open(..., "xb") rather than mkstemp: the file gets the usual umask permissions, not 0600
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            torch.save(payload, f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def load(path: str | Path) -> dict[str, Any]:
    """Read and check a result file; returns the HeadAnalysis constructor's keyword arguments."""
    path = Path(path)

    def fail(problem: str) -> ResultFileError:
        return ResultFileError(f"{path}: {problem}")

    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.pt") if p.is_file())[:3]
        hint = (f"; it holds {', '.join(inside)}" if inside else "")
        raise fail(f"is a folder, not a result file{hint}. Give the result file inside it, e.g. "
                   f"HeadAnalysis.load({str(path / (inside[0] if inside else 'analysis.pt'))!r}).")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such result file.")

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, empty, text, foreign pickle: torch/pickle raise anything
        raise fail(f"not a readable tl_geometry result file ({type(exc).__name__}: {_detail(exc)}). "
                   "Write it with HeadAnalysis.save.") from None
    fmt = payload.get("format") if isinstance(payload, dict) else None
    if not isinstance(fmt, str) or not fmt.startswith(_FORMAT_PREFIX):
        what = (f"a {type(payload).__name__}" if not isinstance(payload, dict)
                else f"a dict of format {fmt!r}" if fmt is not None else "a dict without 'format'")
        raise fail(f"holds {what}, not a saved tl_geometry HeadAnalysis.")
    text = fmt[len(_FORMAT_PREFIX):]
    version = int(text) if text.isascii() and text.isdigit() else 0
    if version < 1:
        raise fail(f"format {fmt!r} is not a valid version (a positive integer); the file is "
                   "damaged or was not written by tl_geometry.")
    if version > FORMAT_VERSION:
        raise fail(f"format {fmt!r} is newer than this tl_geometry reads ({FORMAT}); "
                   "upgrade tl_geometry.")
    _check_devices(payload, fail)
    _check_fields_of(payload, version, fail)
    if version >= _CHECKSUM_SINCE:  # a changed byte anywhere is refused
        saved = payload.get("checksum")
        try:
            actual = checksum(payload)
        except Exception as exc:  # an entry torch or json cannot digest: anything may be raised
            raise fail(f"holds an entry that is not a tensor or plain data ({_detail(exc)}); save "
                       "the analysis again with HeadAnalysis.save.") from None
        if saved != actual:
            what = "has no checksum" if saved is None else "does not match its checksum"
            raise fail(f"its contents {what}: the file was changed or damaged after it was saved. "
                       "Restore a good copy or run the analysis again.")
    if version == 1:  # format 1 did not save its axis labels: its fixed ones
        warnings.warn(f"{path}: format 1 (tl_geometry 0.1, no axis labels); read with that "
                      "format's names. Save it again to upgrade.", UserWarning, stacklevel=3)
        saved_names: Any = dict(_FORMAT1_NAMES)
    else:
        axes = payload.get("axes")
        # A file from an earlier 0.2 build may lack an optional field added since (e.g. paired).
        if not isinstance(axes, dict) or any(
            axes.get(k) != list(v) for k, v in AXES.items() if k in axes or k not in OPTIONAL
        ) or set(axes) - set(AXES):
            raise fail(f"its axis labels {axes!r} differ from this version's {AXES!r}.")
        saved_names = payload.get("names")
    missing = [k for k in ("layers", "metadata", *AXES) if k not in payload and k not in OPTIONAL]
    if missing or not isinstance(saved_names, dict):
        raise fail(f"incomplete: missing {missing or ['names']}.")
    try:
        metadata = decode_metadata(json.loads(payload["metadata"]))
    except (TypeError, ValueError) as exc:
        raise fail(f"its metadata is not valid JSON ({exc}).") from None
    if not isinstance(metadata, dict):
        raise fail(f"its metadata is a {type(metadata).__name__}, not a dict.")
    fields: dict[str, Any] = {"layers": payload["layers"], "metadata": metadata}
    for key in AXES:
        value = payload.get(key)
        if value is None and key in OPTIONAL:
            fields[key] = None
        elif not isinstance(value, Tensor):
            raise fail(f"{key} is a {type(value).__name__}, not a tensor.")
        else:
            fields[key] = _align(key, value, saved_names, fail, version)
    try:
        fields["layers"], fields["n_values"] = check_fields(fields)
    except ValueError as exc:
        raise fail(f"inconsistent contents: {exc}") from None
    for key in COUNT_FIELDS:
        if fields[key] is not None and not (fields[key] >= 0).all():  # NaN fails too
            raise fail(f"{key} must hold counts ≥ 0.")
    return fields


def _check_devices(payload: dict[str, Any], fail: Any) -> None:
    """Refuse tensors without readable data (``meta``, not on the CPU) anywhere in the payload."""
    stack: list[tuple[str, Any]] = [(str(k), v) for k, v in payload.items()]
    stack += [(f"a key ({type(k).__name__})", k) for k in payload]
    while stack:
        where, value = stack.pop()
        if isinstance(value, Tensor):
            if value.is_meta or value.device.type != "cpu":
                raise fail(f"{where} is a {value.device.type} tensor with no readable data; save the "
                           "analysis again from real tensors.")
        elif isinstance(value, dict):
            stack += [(f"{where}[{k!r}]", v) for k, v in value.items() if not isinstance(k, Tensor)]
            stack += [(f"a key of {where}", k) for k in value if isinstance(k, Tensor)]
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]


def _check_fields_of(payload: dict[str, Any], version: int, fail: Any) -> None:
    """Refuse a file that holds entries added by a later format: a newer file relabelled."""
    saved = payload.get("names")
    held = [k for d in (payload, payload.get("axes"), saved) if isinstance(d, dict)
            for k in d if isinstance(k, str)]
    later = {k: _FIELD_SINCE[k] for k in held if _FIELD_SINCE.get(k, 0) > version}
    for axis, added in _ADDED_IN.items():
        labels = saved.get(axis) if isinstance(saved, dict) else None
        if isinstance(labels, (list, tuple)):
            later.update({x: added[x] for x in labels if isinstance(x, str) and added.get(x, 0) > version})
    if later:
        what = ", ".join(f"{k} (format {v})" for k, v in sorted(later.items(), key=lambda kv: (kv[1], kv[0])))
        raise fail(f"says format {version} but holds what later formats added: {what}. A file of "
                   f"format {version} cannot hold them: it was relabelled or damaged. Restore a good "
                   "copy or run the analysis again.")


def _detail(exc: Exception) -> str:
    """The first line of ``exc``'s message (at most 200 characters), or its type's name."""
    return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__


def _align(key: str, value: Tensor, saved: dict[str, Any], fail: Any,
           version: int = FORMAT_VERSION) -> Tensor:
    """``value`` with its named axes re-ordered to this version's labels, by name: a missing label
    is filled (NaN, 0 for counts; a warning unless a later format added it), an extra dropped."""
    if value.ndim != len(AXES[key]):
        raise fail(f"{key} has shape {list(value.shape)}; expected axes {list(AXES[key])}.")
    for dim, axis in enumerate(AXES[key]):
        current = names().get(axis)
        if current is None:  # a coordinate axis (layer, head, n)
            continue
        labels = saved.get(axis)
        if not isinstance(labels, (list, tuple)) or len(labels) != value.shape[dim]:
            raise fail(f"{key} has {value.shape[dim]} entries on its {axis} axis but the file "
                       f"names them {labels!r}.")
        labels = list(labels)
        if labels == list(current):
            continue
        if any(not isinstance(x, str) for x in labels) or len(set(labels)) != len(labels):
            raise fail(f"{key}: the file's {axis} labels {labels!r} are not distinct names, so "
                       "its entries cannot be told apart. Restore a good copy or run the analysis again.")
        lacking = [x for x in current if x not in labels]
        extra = [x for x in labels if x not in current]
        added_since = _ADDED_IN.get(axis, {})
        unexpected = [x for x in lacking if added_since.get(x, 0) <= version]
        if unexpected or extra:
            warnings.warn(f"{key}: the file's {axis} labels differ from this version's; "
                          f"filled {lacking or 'none'}, dropped {extra or 'none'}.",
                          UserWarning, stacklevel=4)
        fill = 0.0 if key in COUNT_FIELDS else math.nan
        shape = list(value.shape)
        shape[dim] = len(current)
        dtype = value.dtype if value.is_floating_point() or fill == 0 else torch.float64
        out = torch.full(shape, fill, dtype=dtype)
        for i, name in enumerate(current):
            if name in labels:
                out.select(dim, i).copy_(value.select(dim, labels.index(name)))
        value = out
    return value
