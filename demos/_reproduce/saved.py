"""The study's saved analyses, with only the per-window slices the page reads.

An analysis with ``per_window=True`` keeps every window's means of every group, metric and bound
(SPEC §8): 35 MB per file for Qwen2.5-Coder-0.5B at 64 windows. The page's intervals read a few
of those slices, so the study writes the analysis itself without them
(``<model>__<corpus>.pt``, which :meth:`tl_geometry.HeadAnalysis.load` reads as ever) and the
slices it reads beside it in float32 (``<model>__<corpus>.windows.pt``: about 1 MB per slice for
336 heads). :func:`load` puts them back where they were, NaN in every slice not kept, so the
page reads the arrays it would read from the full analysis (float32 rounding aside: about 1e-7
relative, far below the printed digits).

What is kept (:data:`KEPT`), by the reader that needs it:

- the main analysis: the top group's F, R and F_cc, the random and shuffled groups' F_cc
  (claims 1 and 4, the decomposition), the sink's mass, κ and cosine (claims 2, 3, 4, 5(c)),
  and the shell bounds on F (claim 4);
- a decomposition null: its top and shuffled groups' F_cc (the decomposition of SPEC §3).

Two more fields are left out where nothing reads them: the votes per block of 128 queries
(``block_votes``, the units of the label stability below :data:`MIN_UNITS` sequences: the study
has 64, so its bootstrap resamples sequences), and a null's per-sequence votes (the main
analysis's, bit for bit: the votes do not depend on the null). Both take more room than the
means (``[window, block, layer, head, 3]``).
"""

from __future__ import annotations

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
                          ("random", "f_score_cc"), ("shuffled", "f_score_cc")],
        "window_sink": [("mass",), ("norm_ratio",), ("cosine",)],
        "window_bounds": [("shell", "f_score"), ("shell_n", "f_score")],
    },
    "null": {"window_scores": [("top", "f_score_cc"), ("shuffled", "f_score_cc")]},
}
FIELDS = ("window_scores", "window_sink", "window_bounds")


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
    docstring names), and the slices the page reads (:func:`kept`) beside it, float32."""
    slices: dict[str, dict[str, Any]] = {}
    for field, keys in kept(kind).items():
        value = getattr(result, field)
        if value is None:
            continue
        slices[field] = {"shape": list(value.shape),
                         **{"/".join(k): value[_index(field, k)].float().contiguous() for k in keys}}
    dropped: dict[str, None] = dict.fromkeys(FIELDS)
    votes = result.sequence_votes
    if kind != "values" or (votes is not None and len(votes) >= MIN_UNITS):
        dropped["block_votes"] = None
    if kind != "values":
        dropped["sequence_votes"] = None
    tl_geometry.HeadAnalysis(**{**vars(result), **dropped}).save(path)
    torch.save(slices, windows_path(path))


def load(path: Path, kind: str) -> tl_geometry.HeadAnalysis | None:
    """The analysis at ``path`` with its kept per-window slices put back (NaN elsewhere); None
    where the slices beside it are missing or fewer than today's page reads (:func:`kept`)."""
    result = tl_geometry.HeadAnalysis.load(path)
    side = windows_path(path)
    if not side.exists():
        return None
    slices = torch.load(side, weights_only=True)
    fields: dict[str, torch.Tensor] = {}
    for field, keys in kept(kind).items():
        stored = slices.get(field)
        if stored is None:
            if field == "window_bounds" and result.bounds is None:
                continue
            return None
        full = torch.full(stored["shape"], float("nan"), dtype=torch.float32)
        for key in keys:
            name = "/".join(key)
            if name not in stored:
                return None
            full[_index(field, key)] = stored[name]
        fields[field] = full
    return tl_geometry.HeadAnalysis(**{**vars(result), **fields})
