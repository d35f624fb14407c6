"""Label stability (:func:`label_stability`), label export (:func:`export_labels`,
docs/labels.md) and agreement with other head scores (:func:`label_agreement`), SPEC §5, §9."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..functional.head_scores import SCORE_NAMES
from ..functional.stats import spearman
from ..functional.taxonomy import (
    CLASSES,
    MIN_UNITS,
    N_RESAMPLES,
    TOO_FEW_UNITS,
    UNSTABLE_BELOW,
    VOTES,
    bootstrap_stability,
    labels_from_votes,
)
from .io import writable_path
from .protocol import AnalysisLike

#: Columns of an exported label file, before the optional score columns (docs/labels.md).
EXPORT_COLUMNS = ("layer", "head", "label", "vote_current", "vote_sink", "vote_other", "margin", "stability")
#: Version of the JSON label file (``"format"`` key).
LABELS_FORMAT = "tl_geometry.labels/1"
#: Heads above this score count as "high" in the cross-tab (SPEC §9).
HIGH_SCORE = 0.3
#: How many missing or repeated heads an error about a score table names.
_SHOWN_HEADS = 5


def label_stability(result: AnalysisLike) -> Float[Tensor, "layer head"]:
    """Share of :data:`N_RESAMPLES` bootstrap resamples (seed 0) that give the head its label
    (SPEC §5). The units resampled (:func:`stability_units`): the sequences where there are at
    least :data:`MIN_UNITS` (8), else each layer's complete blocks of 128 consecutive voting
    queries, pooled over the sequences; the label kept is the head's own, from all its votes.
    NaN — never counted unstable — for every head of a layer with fewer than 8 units ("too few
    units"), of a file without per-sequence votes (format ≤ 3), and for an unlabelled head;
    :func:`stability_note` says why.
    """
    votes = getattr(result, "sequence_votes", None)
    shape = tuple(result.vote_counts.shape[:2])
    if votes is None:
        return torch.full(shape, math.nan, dtype=torch.float64)
    if votes.shape[0] >= MIN_UNITS:
        return bootstrap_stability(votes, N_RESAMPLES, seed=0)
    out = torch.full(shape, math.nan, dtype=torch.float64)
    shown = labels_from_votes(result.vote_counts.to(torch.float64))  # the label the head is shown with
    for li, units in enumerate(_layer_blocks(result)):
        if units is not None:
            out[li] = bootstrap_stability(units, N_RESAMPLES, seed=0, labels=shown[li])
    return out


def _layer_blocks(result: AnalysisLike) -> list[Tensor | None]:
    """Per layer, its complete vote blocks ``[unit, head, 3]`` pooled over the sequences (a
    partial block is stored as zeros), or ``None`` for a result without them."""
    blocks = getattr(result, "block_votes", None)
    if blocks is None:
        return [None] * len(result.layers)
    out = []
    for li in range(blocks.shape[2]):
        layer = blocks[:, :, li].reshape(-1, *blocks.shape[3:])  # [(sequence block), head, 3]
        out.append(layer[layer.sum((-1, -2)) > 0])
    return out


def stability_units(result: AnalysisLike) -> list[tuple[str, int] | None]:
    """Per layer, the unit the label stability resampled and how many there were (SPEC §5):
    ``("sequence", n)`` with 8 or more sequences (or without per-block votes), else
    ``("block", n)``; ``None`` for a file without per-sequence votes (unknown)."""
    votes = getattr(result, "sequence_votes", None)
    if votes is None:
        return [None] * len(result.layers)
    if votes.shape[0] >= MIN_UNITS:
        return [("sequence", int(votes.shape[0]))] * len(result.layers)
    return [("sequence", int(votes.shape[0])) if b is None else ("block", int(b.shape[0]))
            for b in _layer_blocks(result)]


def stability_note(result: AnalysisLike) -> str | None:
    """Why no head has a stability, as shown after "label stability ": ``"not given: too few
    units (3 sequences; ...)"`` or ``"unknown (...)"``; ``None`` when some layer has one (SPEC §5)."""
    votes = getattr(result, "sequence_votes", None)
    if votes is None:
        return "unknown (no per-sequence votes in this result: re-run the analysis)"
    units = stability_units(result)
    if votes.shape[0] >= MIN_UNITS or any(u is not None and u[1] >= MIN_UNITS for u in units):
        return None
    n_seq = int(votes.shape[0])
    most = max((u[1] for u in units if u is not None and u[0] == "block"), default=None)
    blocks = "" if most is None else f", at most {most} complete block{'' if most == 1 else 's'} of 128 queries"
    return (f"not given: {TOO_FEW_UNITS} ({n_seq} sequence{'' if n_seq == 1 else 's'}{blocks}; the bootstrap "
            f"needs at least {MIN_UNITS} sequences or blocks: analyse more or longer sequences to get it)")


def labels_frame(result: AnalysisLike, scores: Any = None):
    """The export table: :data:`EXPORT_COLUMNS` (label ``None`` for an unlabelled head) and,
    with ``scores``, the head-score columns matched on (layer, head)."""
    fractions = result.vote_fractions
    frame = head_frame(result, {
        **{f"vote_{v}": fractions[..., i] for i, v in enumerate(VOTES)},
        "margin": result.label_margin,
        "stability": result.label_stability,
    })
    return frame if scores is None else merge_scores(frame, scores)


def head_frame(result: AnalysisLike, columns: dict[str, Tensor]):
    """A ``DataFrame`` of one row per (layer, head): ``layer, head, label``, then ``columns``
    (``[layer, head]`` tensors, as float64)."""
    import pandas as pd

    return pd.DataFrame({
        "layer": torch.tensor(result.layers).repeat_interleave(result.n_heads).numpy(),
        "head": torch.arange(result.n_heads).repeat(result.n_layers).numpy(),
        "label": [x for row in result.labels for x in row],
        **{name: values.flatten().double().numpy() for name, values in columns.items()},
    })


def merge_scores(frame: Any, scores: Any):
    """``frame`` with the score columns of ``scores`` (a :func:`tl_geometry.head_scores` table)
    joined on ``layer, head`` (checked by :func:`check_scores`, :func:`check_score_heads`)."""
    columns = check_scores(scores)
    check_score_heads(scores, zip(frame["layer"].tolist(), frame["head"].tolist()))
    return frame.merge(scores[["layer", "head", *columns]], on=["layer", "head"], how="left")


def check_scores(scores: Any) -> list[str]:
    """The score columns of a head-score table; ``ValueError`` naming what is missing, or a
    ``layer`` / ``head`` column that does not hold ints."""
    import pandas as pd

    have = set(getattr(scores, "columns", ()))
    if not isinstance(scores, pd.DataFrame) or not {"layer", "head"} <= have:
        raise ValueError("scores must be a DataFrame with layer and head columns, as "
                         "tl_geometry.head_scores(model) returns; got "
                         f"{type(scores).__name__} with columns {sorted(map(str, have))}.")
    columns = [c for c in SCORE_NAMES if c in have]
    if not columns:
        raise ValueError(f"scores has none of the score columns {list(SCORE_NAMES)}; pass "
                         "tl_geometry.head_scores(model).")
    for name in ("layer", "head"):
        column = scores[name]
        if isinstance(column, pd.DataFrame):  # two columns of that name
            raise ValueError(f"scores has {column.shape[1]} columns named {name!r}; keep one, as "
                             "tl_geometry.head_scores(model) gives.")
        if not pd.api.types.is_integer_dtype(column) or pd.api.types.is_bool_dtype(column):
            example = next(iter(column.tolist()), None)
            raise ValueError(f"scores' {name} column holds {column.dtype} values (e.g. {example!r}), "
                             f"not {name} indices (ints): compute head_scores on the same model "
                             f"(tl_geometry.head_scores(model)), or convert the column, e.g. "
                             f"scores.astype({{{name!r}: int}}).")
    return columns


def _heads_text(heads: list[tuple[int, int]]) -> str:
    shown = ", ".join(f"(layer {layer}, head {head})" for layer, head in heads[:_SHOWN_HEADS])
    return shown + (f" and {len(heads) - _SHOWN_HEADS} more" if len(heads) > _SHOWN_HEADS else "")


def check_score_heads(scores: Any, heads: Any) -> None:
    """Refuse (``ValueError`` naming the first heads and the fix) a head-score table that lists a
    head twice or lacks one of ``heads`` (``(layer, head)`` pairs), which a merge would hide."""
    seen: set[tuple[int, int]] = set()
    repeated: dict[tuple[int, int], None] = {}  # in the table's order
    for pair in zip(scores["layer"].tolist(), scores["head"].tolist()):
        if pair in seen:
            repeated[pair] = None
        seen.add(pair)
    if repeated:
        raise ValueError(f"scores lists {len(repeated)} head{'s' if len(repeated) > 1 else ''} more "
                         f"than once: {_heads_text(list(repeated))}. A head-score table has one row per "
                         "(layer, head): compute head_scores on the same model "
                         "(tl_geometry.head_scores(model)), or drop the repeats "
                         "(scores.drop_duplicates(['layer', 'head'])).")
    wanted = [(int(layer), int(head)) for layer, head in heads]
    missing = [pair for pair in wanted if pair not in seen]
    if missing:
        raise ValueError(f"scores lacks {len(missing)} of the {len(wanted)} analysed heads: "
                         f"{_heads_text(missing)}; it is not a head-score table of this model. "
                         "Compute head_scores on the same model that was analysed "
                         "(tl_geometry.head_scores(model)).")


def export_labels(result: AnalysisLike, path: str | Path, scores: Any = None) -> Path:
    """Write :func:`labels_frame` to ``path``, atomically: ``.csv`` (empty cell for NaN or no
    label) or ``.json`` (``{"format", "model", "sink_epsilon", "columns", "heads": [...]}``, NaN
    → ``null``). Raises ``ValueError`` for another suffix, a ``path`` that is a folder or lies
    under a file, and a ``scores`` table refused by :func:`check_score_heads`."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".json"):
        raise ValueError(f"export_labels: {path} must end in .csv or .json (the suffix picks the format).")
    try:
        writable_path(path, f"labels{suffix}")
    except ValueError as exc:
        raise ValueError(f"export_labels: {exc}") from None
    frame = labels_frame(result, scores)
    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if suffix == ".csv":
            frame.to_csv(tmp, index=False, na_rep="")
        else:
            rows = [{k: _plain(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]
            payload = {
                "format": LABELS_FORMAT,
                "model": result.metadata.get("model"),
                "n_resamples": N_RESAMPLES,
                "unstable_below": UNSTABLE_BELOW,
                "sink_epsilon": _plain(getattr(scores, "attrs", {}).get("sink_epsilon")),
                "columns": list(frame.columns),
                "heads": rows,
            }
            tmp.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave the hidden temporary file behind
        raise
    return path


def _plain(value: Any) -> Any:
    """JSON-ready scalar: NaN → None, NumPy numbers → Python numbers."""
    if value is None or isinstance(value, str):
        return value
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def label_agreement(result: AnalysisLike, scores: Any):
    """Do the labels agree with other detectors? (SPEC §9) Three DataFrames: ``"mean"`` (class ×
    score: the mean score of each class's heads), ``"share_high"`` (per score, the share of each
    class among the ``heads`` with score > 0.3) and ``"spearman"`` (vote fraction × score:
    Spearman's ρ over the labelled heads).

    ``scores`` must cover every analysed head once, else ``ValueError`` (:func:`check_score_heads`).

    >>> agreement = label_agreement(result, tl_geometry.head_scores(model))  # doctest: +SKIP
    >>> agreement["share_high"].loc["induction"]                              # doctest: +SKIP
    """
    import pandas as pd

    columns = check_scores(scores)
    frame = labels_frame(result, scores)
    labelled = frame[frame["label"].notna()]
    mean = labelled.groupby("label")[columns].mean().reindex(list(CLASSES))
    share = {}
    for name in columns:
        high = labelled[labelled[name] > HIGH_SCORE]
        counts = high["label"].value_counts().reindex(list(CLASSES), fill_value=0)
        row = (counts / len(high)) if len(high) else counts * math.nan
        share[name] = {**row.to_dict(), "heads": len(high)}
    rho = {f"vote_{v}": {name: spearman(torch.tensor(labelled[f"vote_{v}"].to_numpy()),
                                         torch.tensor(labelled[name].to_numpy()))
                         for name in columns} for v in VOTES}
    return {
        "mean": mean,
        "share_high": pd.DataFrame.from_dict(share, orient="index"),
        "spearman": pd.DataFrame.from_dict(rho, orient="index"),
    }
