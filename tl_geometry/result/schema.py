"""The names and axes of :class:`~tl_geometry.result.HeadAnalysis`, in one place.

Every tensor field has named axes (:data:`AXES`); every named axis has its labels in one tuple
(:data:`names`): the accessors, ``sel``, ``to_pandas``, the files and the checks follow them.
"""

from __future__ import annotations

import operator
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from ..functional.figures import labels
from ..functional.local_sink import LOCAL_SINK_FIELDS
from ..functional.regime import REGIME_FIELDS
from ..functional.separability import METRIC_NAMES, TRUNCATION_NAMES
from ..functional.sink import SINK_FIELDS
from ..functional.taxonomy import CLASSES, VOTES

#: Paired sink effect per (layer, head, N) (SPEC §3, comparison 3; ours): the median of
#: F_N(with sink) / F_N(sink removed) over the instances whose top-N set holds the sink, the
#: fraction of them with ratio ≤ 1/2, and their number.
PAIRED_FIELDS: tuple[str, ...] = labels("paired_field")

#: Selection groups scored per (layer, head, N) (SPEC §3): the top-N set, the random baseline,
#: a null of :data:`SHUFFLE_KINDS`, the top-N re-selected with the sink removed, and the top-N
#: instances with the sink inside / outside the set.
GROUPS: tuple[str, ...] = ("top", "random", "shuffled", "sink_removed", "sink_in", "sink_out")
#: The nulls that the ``shuffled`` group can be (SPEC §3; ``analyze_heads(shuffle=...)``, saved as
#: ``metadata["shuffle"]``): the non-sink values permuted (``"values"``, the default), only their
#: norms or only their directions permuted, or only the values outside the top-N set.
ShuffleKind = Literal["values", "norms", "directions", "unselected"]
SHUFFLE_KINDS: tuple[str, ...] = get_args(ShuffleKind)
#: Kinds of lower bound on the top-N sets (SPEC §6): inversion certificates, certified regime
#: bounds (observed extremes), the predicted envelope (typical values) and the shell
#: certificate (§6d) with budget K = 0 (``shell``, norm-only) and K = N (``shell_n``).
BOUND_KINDS: tuple[str, ...] = ("inversion", "certified", "predicted", "shell", "shell_n")
#: Means of the lower bounds on P, R, F, and (ours) ``separated``: the fraction of instances
#: where the bound certifies P = R = 1 (γ_N > 0); for ``inversion`` that is the measured fraction.
BOUND_METRICS: tuple[str, ...] = labels("bound_metric")

#: The percentile of the truncation figures over instances (SPEC §10): ``truncation_p90`` holds
#: their nearest-rank 90th percentile (an observed value; ours).
PERCENTILE = 0.9

#: Axis labels of every tensor field, in storage order; ``layer``, ``head`` and ``n`` are
#: coordinates (model layer index, head index, N value), the others are named by :func:`names`.
AXES: dict[str, tuple[str, ...]] = {
    "n_values": ("n",),
    "scores": ("group", "metric", "layer", "head", "n"),
    "group_counts": ("group", "layer", "head", "n"),
    "sink": ("sink_field", "layer", "head"),
    "vote_counts": ("layer", "head", "vote"),
    "bounds": ("bound_kind", "bound_metric", "layer", "head", "n"),
    "regime": ("regime_field", "layer", "head"),
    "paired": ("paired_field", "layer", "head", "n"),
    "sequence_votes": ("sequence", "layer", "head", "vote"),
    "truncation_p90": ("truncation_metric", "layer", "head", "n"),
    "beyond_votes": ("layer", "head", "vote"),
    "block_votes": ("sequence", "block", "layer", "head", "vote"),
    "window_scores": ("sequence", "window_group", "metric", "layer", "head", "n"),
    "window_sink": ("sequence", "sink_field", "layer", "head"),
    "window_bounds": ("sequence", "bound_kind", "bound_metric", "layer", "head", "n"),
    "baseline_se": ("se_kind", "metric", "layer", "head", "n"),
    "local_sink": ("sequence", "local_field", "layer", "head"),
}
#: The random baseline's standard errors (SPEC §3): over sequences, and Monte Carlo (its ``R``
#: subsets per query).
SE_KINDS: tuple[str, ...] = ("sequences", "monte_carlo")
#: The groups of the per-window arrays (SPEC §8): those of :data:`GROUPS`, each window's own means
#: (the sink-in / sink-out ones NaN where it has none).
WINDOW_GROUPS: tuple[str, ...] = GROUPS
#: Fields that may be ``None``: optional outputs, or absent from files of earlier versions.
OPTIONAL = ("bounds", "regime", "paired", "sequence_votes", "truncation_p90", "beyond_votes", "block_votes",
            "window_scores", "window_sink", "window_bounds", "baseline_se", "local_sink")
#: Fields holding counts: filled with 0 (not NaN) where a saved file lacks a name.
COUNT_FIELDS = ("group_counts", "vote_counts", "sequence_votes", "beyond_votes", "block_votes")


def names() -> dict[str, tuple[str, ...]]:
    """Labels of every named (non-coordinate) axis, e.g. ``names()["metric"]``."""
    return {
        "group": GROUPS, "metric": tuple(METRIC_NAMES), "sink_field": tuple(SINK_FIELDS),
        "vote": tuple(VOTES), "bound_kind": BOUND_KINDS, "bound_metric": BOUND_METRICS,
        "regime_field": tuple(REGIME_FIELDS), "class": tuple(CLASSES), "paired_field": PAIRED_FIELDS,
        "truncation_metric": tuple(TRUNCATION_NAMES), "window_group": WINDOW_GROUPS,
        "se_kind": SE_KINDS, "local_field": LOCAL_SINK_FIELDS,
    }


class UnknownNameError(KeyError, ValueError):
    """An unknown name or coordinate (group, metric, layer, N, ...); the message lists the valid
    ones. A ``KeyError`` (as before) and a ``ValueError`` (the project's bad-input error)."""

    def __str__(self) -> str:  # KeyError would print the message quoted, like a dict key
        return str(self.args[0]) if self.args else ""


class NoBoundsError(AttributeError, ValueError):
    """A bound or regime figure was asked of a result computed without ``bounds=True``."""


NO_BOUNDS = "this analysis has no bounds: run analyze_heads(..., bounds=True)."


def check_name(kind: str, value: str, valid: tuple[str, ...]) -> int:
    """Index of ``value`` in ``valid``, or a :class:`UnknownNameError` listing the valid ones."""
    if value not in valid:
        raise UnknownNameError(f"unknown {kind} {value!r}; valid: {', '.join(map(repr, valid))}.")
    return valid.index(value)


def check_fields(fields: dict[str, Any]) -> tuple[tuple[int, ...], Tensor]:
    """Check and normalise the constructor's fields; returns ``(layers, n_values)``. Raises
    ``ValueError`` naming the field and the expected shape (``... expected [group=5, metric=5, ...]``)."""
    try:
        layers = tuple(operator.index(x) for x in fields["layers"])
    except TypeError:
        raise ValueError(f"layers must be model layer indices (ints), got {fields['layers']!r}.") from None
    if len(set(layers)) != len(layers) or any(x < 0 for x in layers):
        raise ValueError(f"layers must be distinct non-negative ints, got {list(layers)}.")
    n_values = fields["n_values"]
    if not isinstance(n_values, Tensor):
        n_values = torch.as_tensor(n_values)
    ns = n_values.tolist() if n_values.ndim == 1 else None
    if n_values.is_floating_point() or ns is None or len(set(ns)) != len(ns) or min(ns, default=1) < 1:
        raise ValueError(f"n_values must be a 1-D tensor of distinct ints ≥ 1, got {n_values!r}.")
    tensors = [k for k in AXES if k != "n_values" and k in fields]
    scores = fields.get("scores")
    if not isinstance(scores, Tensor) or scores.ndim != 5:
        raise ValueError(f"scores must be a [group, metric, layer, head, n] tensor, got {_describe(scores)}.")
    size = {"layer": len(layers), "head": scores.shape[3], "n": len(ns)}
    sequence_votes = fields.get("sequence_votes")
    size["sequence"] = sequence_votes.shape[0] if isinstance(sequence_votes, Tensor) and sequence_votes.ndim else 0
    block_votes = fields.get("block_votes")
    if isinstance(block_votes, Tensor) and block_votes.ndim == 5:
        size["block"] = block_votes.shape[1]
        if sequence_votes is None:
            size["sequence"] = block_votes.shape[0]
    window_scores = fields.get("window_scores")
    if sequence_votes is None and isinstance(window_scores, Tensor) and window_scores.ndim:
        size["sequence"] = window_scores.shape[0]
    local_sink = fields.get("local_sink")
    if sequence_votes is None and block_votes is None and window_scores is None and isinstance(local_sink, Tensor):
        size["sequence"] = local_sink.shape[0] if local_sink.ndim else 0
    size.update({axis: len(labels) for axis, labels in names().items()})
    for key in tensors:
        value = fields[key]
        if value is None and key in OPTIONAL:
            continue
        want = [size[a] for a in AXES[key]]
        if not isinstance(value, Tensor) or list(value.shape) != want:
            expected = ", ".join(f"{a}={n}" for a, n in zip(AXES[key], want))
            raise ValueError(f"{key} has shape {_describe(value)}; expected [{expected}].")
        if not (value.is_floating_point() or key in COUNT_FIELDS):
            raise ValueError(f"{key} must be a floating-point tensor, got {value.dtype}.")
    if isinstance(sequence_votes, Tensor):  # integer counts that add up to vote_counts (SPEC §5)
        if sequence_votes.is_floating_point() or sequence_votes.dtype == torch.bool:
            raise ValueError("sequence_votes must hold integer counts, got "
                             f"{sequence_votes.dtype}.")
        if sequence_votes.numel() and int(sequence_votes.min()) < 0:
            raise ValueError("sequence_votes must hold counts ≥ 0.")
        if not torch.equal(sequence_votes.sum(0).double(), fields["vote_counts"].double()):
            raise ValueError("sequence_votes do not add up to vote_counts over the sequences; pass "
                             "the per-sequence counts of the same run, or sequence_votes=None.")
    for key in ("beyond_votes", "block_votes"):
        value = fields.get(key)
        if isinstance(value, Tensor) and (value.is_floating_point() or value.dtype == torch.bool
                                          or (value.numel() and int(value.min()) < 0)):
            raise ValueError(f"{key} must hold integer counts ≥ 0, got {value.dtype}.")
    if not isinstance(fields.get("metadata", {}), dict):
        raise ValueError(f"metadata must be a dict, got a {type(fields['metadata']).__name__}.")
    if (fields["bounds"] is None) != (fields["regime"] is None):
        raise ValueError("bounds and regime come together (analyze_heads(bounds=True)): got only one.")
    return layers, n_values


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return str(list(value.shape))
    return f"a {type(value).__name__}"
