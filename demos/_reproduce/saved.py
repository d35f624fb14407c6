"""The study's saved analyses, deflated, with only the per-window slices the page reads.

An analysis with ``per_window=True`` keeps every window's means of every group, metric and bound
(SPEC §8): 35 MB per file for Qwen2.5-Coder-0.5B at 64 windows. The page's intervals read a few
of those slices, so the study writes the analysis itself without them
(``<model>__<corpus>.pt``, which :meth:`tl_geometry.HeadAnalysis.load` reads as ever) and the
slices it reads beside it (``<model>__<corpus>.windows.pt``). :func:`load` puts them back where
they were, NaN in every slice not kept, so the page reads the arrays it would read from the full
analysis (float32 rounding aside: about 6e-8 relative, far below the printed digits).

Both files are stored compact, since the study's results are tracked beside the page: every
file's zip entries are deflated (``torch.load`` reads deflated entries as it reads its own files;
3 to 4 times smaller for these figures), and a decomposition null's analysis keeps only the
slices of its ``scores`` the page reads (:data:`NULL_SCORES`), NaN elsewhere. Nothing is rounded:
the analysis keeps its float64 (its certificates compare exactly with its measured means, and
claim 4 ranks heads by bounds that reach 1e-8), the per-window slices float32 (:data:`STORED`;
float16 would move printed digits of the intervals).

What is kept (:data:`KEPT`), by the reader that needs it:

- the main analysis: the top group's F, R and F_cc, the random and shuffled groups' F_cc
  (claims 1 and 4, the decomposition), the sink-in and sink-removed groups' F (claim 3's paired
  ratio per window), the sink's mass, κ and cosine (claims 2, 3, 4, 5(c)), and the regime
  envelope (SPEC §6b, which decides claim 4) and the shell bounds (§6d, reported beside it) on F;
- a decomposition null: its top and shuffled groups' F_cc (the decomposition of SPEC §3).

Two more fields are left out where nothing reads them: the votes per block of 128 queries
(``block_votes``, the units of the label stability below :data:`MIN_UNITS` sequences: the study
has 64, so its bootstrap resamples sequences), and a null's per-sequence votes (the main
analysis's, bit for bit: the votes do not depend on the null). Both take more room than the
means (``[window, block, layer, head, 3]``).

Each side file is tied to its analysis: the analysis's metadata records the SHA-256 of the side
file's bytes (:data:`WINDOWS_SHA256`), and :func:`load` refuses a side file that does not match
(a changed byte, a cut-short file, another run's file) with a :class:`SideFileError` that says how
to regenerate it. The ablation and capacity tables tie their side files the same way, through
:func:`write_side` and :func:`read_side`, with the checksum in their JSON. A side file written
before checksums were recorded (the analysis records none) is read with a warning.
"""

from __future__ import annotations

import hashlib
import io
import os
import uuid
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import tl_geometry
from tl_geometry.functional.taxonomy import MIN_UNITS
from tl_geometry.result.schema import AXES, names

#: Field → the (label, label) pairs of its first two named axes that the page reads, per kind
#: of analysis: ``"values"`` (the main analysis) or a decomposition null.
Kept = Mapping[str, Sequence[tuple[str, ...]]]
KEPT: dict[str, Kept] = {
    "values": {
        "window_scores": [("top", "f_score"), ("top", "recall"), ("top", "f_score_cc"),
                          ("random", "f_score_cc"), ("shuffled", "f_score_cc"),
                          ("sink_in", "f_score"), ("sink_removed", "f_score")],
        "window_sink": [("mass",), ("norm_ratio",), ("cosine",)],
        "window_bounds": [("shell", "f_score"), ("shell_n", "f_score"), ("predicted", "f_score")],
    },
    "null": {"window_scores": [("top", "f_score_cc"), ("shuffled", "f_score_cc")]},
}
FIELDS = ("window_scores", "window_sink", "window_bounds")
#: The (group, metric) slices of a decomposition null's ``scores`` that the page reads (SPEC §3:
#: F∗ of the top-N set, which the nulls share with the main analysis, and of the null itself);
#: a null is saved with NaN in its other slices, which it shares with the main analysis or
#: which nothing reads.
NULL_SCORES = (("top", "f_score_cc"), ("shuffled", "f_score_cc"))
#: Kept slices that a side file may lack and still be read (NaN there): claim 3's and claim 4's
#: envelope's, which side files written before those claims read them (and before result format 9
#: kept the per-window sink-in group) do not hold. Those claims then print their point figures
#: with no interval and no verdict, rather than every saved analysis being recomputed by ``--reuse``.
OPTIONAL_KEPT = {("window_scores", ("sink_in", "f_score")), ("window_scores", ("sink_removed", "f_score")),
                 ("window_bounds", ("predicted", "f_score"))}
#: Sizes of a named axis that side files written by earlier versions have: the 4 per-window
#: groups before result format 9 (today's first four, in the same order).
_EARLIER_SIZES = {"window_group": (4,)}
#: The dtype each per-window field is stored in (float32: about 6e-8 relative, far below the
#: printed digits; the analysis's own means are float64).
STORED: dict[str, torch.dtype] = {"window_scores": torch.float32, "window_sink": torch.float32,
                                  "window_bounds": torch.float32}
#: The metadata key of a saved analysis that records the SHA-256 of its side file's bytes.
WINDOWS_SHA256 = "reproduce_windows_sha256"
#: The key of the ablation and capacity tables' JSON record that holds the SHA-256 of their side
#: file's bytes (None: saved without per-window values; absent: saved before checksums).
TABLES_SHA256 = "windows_sha256"


class SideFileError(ValueError):
    """A ``*.windows.pt`` side file that cannot be read, or does not belong to the saved result
    beside it; the message names the file and how to regenerate it."""


def _regenerate(side: Path) -> str:
    """How to regenerate ``side``: a result whose side file is missing is recomputed by
    ``--reuse`` (a saved analysis without its slices, tables without per-window losses)."""
    return (f"Delete {side} and re-run demos/reproduce.py with the same options and --reuse to "
            "regenerate it (the result it belongs to is recomputed), or re-run without --reuse.")


def write_side(payload: Any, side: Path) -> str:
    """Write ``payload`` (tensors in dicts) to the side file ``side`` and return the SHA-256 (hex)
    of the bytes written, which the result it belongs to records for :func:`read_side`."""
    data = _serialize(payload)
    _write_atomic(data, side)
    return hashlib.sha256(data).hexdigest()


def _serialize(payload: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return _deflate(buffer.getvalue())


def _deflate(data: bytes) -> bytes:
    """``torch.save``'s bytes with every zip entry deflated: ``torch.save`` stores them as they
    are (3 to 4 times larger for these figures), and ``torch.load`` reads deflated entries too."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, \
            zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as target:
        for info in source.infolist():
            entry = zipfile.ZipInfo(info.filename, date_time=info.date_time)  # torch's fixed stamp:
            entry.compress_type = zipfile.ZIP_DEFLATED  # the same bytes for the same analysis
            target.writestr(entry, source.read(info.filename), compresslevel=9)
    return out.getvalue()


def _write_atomic(data: bytes, side: Path) -> None:
    """Write ``data`` to ``side`` beside it and rename: an interrupted save leaves no partial file."""
    side.parent.mkdir(parents=True, exist_ok=True)
    tmp = side.with_name(f".{side.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, side)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_side(side: Path, sha256: Any, owner: Path) -> Any:
    """The payload of the side file ``side``, after checking its bytes against ``sha256``, the
    checksum that ``owner`` (the result it belongs to) recorded when both were written.

    ``sha256=None`` is a side file written before checksums were recorded: read with a
    ``UserWarning``, unchecked. Raises :class:`SideFileError` for a side file whose bytes do not
    match (changed, cut short, or another run's) and for one that ``torch.load`` cannot read
    with ``weights_only=True`` (whatever torch raises for a truncated or foreign file)."""
    data = side.read_bytes()
    if sha256 is None:
        warnings.warn(f"{side} was written without a checksum (by an older demos/reproduce.py), so "
                      f"it is read unchecked: nothing ties it to {owner}. " + _regenerate(side),
                      UserWarning, stacklevel=3)
    elif hashlib.sha256(data).hexdigest() != sha256:
        raise SideFileError(f"{side} does not match the checksum that {owner} recorded for it: it "
                            "was changed, cut short, or written by another run. " + _regenerate(side))
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, edited or foreign: torch and pickle raise anything
        detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise SideFileError(f"{side} is not a readable per-window file ({type(exc).__name__}: "
                            f"{detail}). " + _regenerate(side)) from None


def kept(kind: str) -> Kept:
    """The slices kept for an analysis of ``kind`` (``"values"`` or a null's name)."""
    return KEPT["values" if kind == "values" else "null"]


def windows_path(path: Path) -> Path:
    """The file beside ``path`` that holds its kept per-window slices."""
    return path.with_name(path.name.removesuffix(".pt") + ".windows.pt")


def _index(field: str, key: Sequence[str]) -> tuple[slice | int, ...]:
    """The index of ``key``'s slice of ``field``: every sequence, then ``key``'s labels on the
    named axes after ``sequence``."""
    axes = AXES[field][1:1 + len(key)]
    labels = [names()[axis].index(label) for axis, label in zip(axes, key)]
    return (slice(None), *labels)


def save(result: tl_geometry.HeadAnalysis, path: Path, kind: str) -> None:
    """Write ``result`` to ``path`` without its per-window arrays (nor the votes the module
    docstring names; a null with only its :data:`NULL_SCORES`), and the slices the page reads
    (:func:`kept`) beside it in their :data:`STORED` dtype, both deflated; the analysis records
    the side file's SHA-256 (:data:`WINDOWS_SHA256`)."""
    slices: dict[str, dict[str, Any]] = {}
    for field, keys in kept(kind).items():
        value = getattr(result, field)
        if value is None:
            continue
        slices[field] = {"shape": list(value.shape),
                         **{"/".join(k): value[_index(field, k)].to(STORED[field]).contiguous() for k in keys}}
    dropped: dict[str, None] = dict.fromkeys(FIELDS)
    votes = result.sequence_votes
    if kind != "values" or (votes is not None and len(votes) >= MIN_UNITS):
        dropped["block_votes"] = None
    if kind != "values":
        dropped["sequence_votes"] = None
    side = windows_path(path)
    # The old side file goes first and the new one last: a save cut short leaves an analysis
    # without a side file (recomputed by --reuse), never one beside another's slices.
    side.unlink(missing_ok=True)
    data = _serialize(slices)
    metadata = {**result.metadata, WINDOWS_SHA256: hashlib.sha256(data).hexdigest()}
    compact = {"scores": _only(result.scores, NULL_SCORES)} if kind != "values" else {}
    raw = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.raw")
    try:
        tl_geometry.HeadAnalysis(**{**vars(result), **compact, **dropped, "metadata": metadata}).save(raw)
        _write_atomic(_deflate(raw.read_bytes()), path)
    finally:
        raw.unlink(missing_ok=True)
    _write_atomic(data, side)


def _only(scores: torch.Tensor, keys: Sequence[tuple[str, str]]) -> torch.Tensor:
    """``scores`` (``[group, metric, layer, head, n]``) with NaN outside the ``(group, metric)``
    slices ``keys``."""
    out = torch.full_like(scores, float("nan"))
    for group, metric in keys:
        at = (names()["group"].index(group), names()["metric"].index(metric))
        out[at] = scores[at]
    return out


def load(path: Path, kind: str) -> tl_geometry.HeadAnalysis | None:
    """The analysis at ``path`` with its kept per-window slices put back (NaN elsewhere); None
    where the slices beside it are missing or fewer than today's page reads (:func:`kept`; the
    :data:`OPTIONAL_KEPT` ones aside, NaN where absent).

    Raises :class:`SideFileError` where the side file is not the one the analysis recorded
    (:func:`read_side`) or does not hold per-window slices of this analysis."""
    result = tl_geometry.HeadAnalysis.load(path)
    side = windows_path(path)
    if not side.exists():
        return None
    slices = _checked(read_side(side, result.metadata.get(WINDOWS_SHA256), path), side)
    fields: dict[str, torch.Tensor] = {}
    for field, keys in kept(kind).items():
        stored = slices.get(field)
        if stored is None:
            if field == "window_bounds" and result.bounds is None:
                continue
            return None
        # Today's labels on the named axes (an earlier side file may name fewer, in order).
        shape = [len(names()[axis]) if axis in names() else size
                 for axis, size in zip(AXES[field], stored["shape"])]
        full = torch.full(shape, float("nan"), dtype=torch.float32)
        for key in keys:
            name = "/".join(key)
            if name not in stored:
                if (field, tuple(key)) in OPTIONAL_KEPT:
                    continue
                return None
            value, want = stored[name], full[_index(field, key)].shape
            if not isinstance(value, torch.Tensor) or value.shape != want:
                got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise SideFileError(f"{side}: slice {field}[{name}] is {got}, not {list(want)} as its "
                                    "recorded shape says. " + _regenerate(side))
            full[_index(field, key)] = value
        fields[field] = full
    try:
        return tl_geometry.HeadAnalysis(**{**vars(result), **fields})
    except ValueError as exc:
        raise SideFileError(f"{side}: its slices do not fit the analysis in {path} ({exc}). "
                            + _regenerate(side)) from None


def _checked(slices: Any, side: Path) -> dict[str, dict[str, Any]]:
    """A side file's slices, after checking that they are per-window slices of an analysis: a
    dict of :data:`FIELDS`, each a dict with its full ``shape`` (whose labelled axes have
    today's labels) beside the slices themselves."""
    def refuse(problem: str) -> SideFileError:
        return SideFileError(f"{side} is not an analysis's per-window slices: {problem}. "
                             + _regenerate(side))

    if not isinstance(slices, dict):
        raise refuse(f"it holds a {type(slices).__name__}, not a dict of {', '.join(FIELDS)}")
    if set(slices) - set(FIELDS):
        raise refuse(f"it holds {sorted(map(str, set(slices) - set(FIELDS)))}, not only {', '.join(FIELDS)}")
    for field, stored in slices.items():
        shape = stored.get("shape") if isinstance(stored, dict) else None
        axes = AXES[field]
        if not (isinstance(shape, list) and len(shape) == len(axes)
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape)):
            raise refuse(f"{field} has no shape of {len(axes)} sizes ({', '.join(axes)})")
        for axis, size in zip(axes, shape):
            if axis in names() and size != len(names()[axis]) and size not in _EARLIER_SIZES.get(axis, ()):
                raise refuse(f"{field}'s {axis} axis has {size} labels, today's analyses "
                             f"{len(names()[axis])}")
    return slices


def save_windows(windows: Mapping[str, Any] | None, side: Path) -> str | None:
    """Write the per-window values of ablation or capacity tables (named tensors) to their side
    file ``side`` and return its SHA-256, which their JSON record keeps (:data:`TABLES_SHA256`);
    None, and no side file (an earlier one is removed), for tables without per-window values."""
    if windows is None:
        side.unlink(missing_ok=True)
        return None
    problem = _not_named_tensors(windows)
    if problem:
        raise ValueError(f"tables['windows'] must map names to per-window tensors, but {problem}: "
                         "pass the 'windows' that run() returns.")
    return write_side(dict(windows), side)


def load_windows(record: dict[str, Any], side: Path, owner: Path) -> dict[str, Any] | None:
    """The per-window values of the tables whose JSON record (read from ``owner``) is ``record``,
    from their side file ``side``, checked against the checksum the record keeps (popped from
    it); None where they were saved without any, or the side file is missing (``--reuse`` then
    recomputes the tables). A record without a checksum predates them: its side file is read
    with a warning (:func:`read_side`). Raises :class:`SideFileError` for a side file that does
    not match, cannot be read, or does not hold named tensors."""
    legacy = TABLES_SHA256 not in record
    sha256 = record.pop(TABLES_SHA256, None)
    if (sha256 is None and not legacy) or not side.exists():
        return None  # saved without per-window values: a file at ``side`` is not theirs
    windows = read_side(side, sha256, owner)
    if windows is None and legacy:
        return None  # an older writer saved None for tables without per-window values
    problem = _not_named_tensors(windows)
    if problem:
        raise SideFileError(f"{side} is not a table's per-window values: {problem}. " + _regenerate(side))
    return windows


def _not_named_tensors(windows: Any) -> str | None:
    """What keeps ``windows`` from being a dict of names to tensors (or None), or None."""
    if not isinstance(windows, Mapping):
        return f"it holds a {type(windows).__name__}, not a dict"
    for name, value in windows.items():
        if not isinstance(name, str) or not (value is None or isinstance(value, torch.Tensor)):
            return f"its entry {name!r} is a {type(value).__name__}, not a tensor"
    return None
