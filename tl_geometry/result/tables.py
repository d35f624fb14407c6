"""Tables of a :class:`~tl_geometry.result.HeadAnalysis` (``pandas`` is imported on use)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..functional.taxonomy import CLASSES, labels_from_votes
from .headline import geometry_reading, headline_n, is_dense, layer_windows, shuffle_kind
from .protocol import AnalysisLike
from .schema import SHUFFLE_KINDS, check_name, names


def finite_mean(x: Tensor) -> float:
    """The mean of the finite entries of ``x``; NaN where none is finite."""
    return float(x.nanmean()) if bool(x.isfinite().any()) else float("nan")


#: Bound kinds whose F̲_N predicts a best N, and their ``best_n()`` columns.
BEST_N_KINDS = {"shell": "shell_best_n", "shell_n": "shell_n_best_n", "predicted": "predicted_best_n"}


def argmax_n(result: AnalysisLike, values: Tensor, *, bound: bool) -> Tensor:
    """Per head, the N of :func:`headline_n` with the largest ``values [layer, head, n]``
    (float64, ties → smaller N); NaN where every value there is NaN (or, for a ``bound``, ≤ 0)
    — SPEC §6d: undefined, never a default N."""
    ns = sorted(headline_n(result))
    index = torch.tensor([result.n_values.tolist().index(n) for n in ns], dtype=torch.long)
    x = values[..., index].double()
    defined = ~torch.isnan(x) & (x > 0 if bound else True)
    if not ns:
        return torch.full(values.shape[:-1], torch.nan, dtype=torch.float64)
    at = torch.where(defined, x, -torch.inf).argmax(-1)  # first maximum: the smaller N
    best = torch.tensor(ns, dtype=torch.float64)[at]
    return torch.where(defined.any(-1), best, torch.nan)


def measured_and_predicted_best_n(result: AnalysisLike, kind: str) -> tuple[Tensor, Tensor]:
    """Per head, the measured best N and the one bound ``kind`` predicts (:func:`argmax_n`)."""
    check_name("bound kind", kind, tuple(BEST_N_KINDS))
    return (argmax_n(result, result.f_score, bound=False),
            argmax_n(result, result.bound(kind, "f_score"), bound=True))


def beyond_table(result: AnalysisLike):
    """One row per head of a sliding-window (local) layer: its label and vote fractions from the
    queries that see the sink (SPEC §5), beside the votes of the queries whose window starts
    after the sink (``beyond_current``, ``beyond_other``: they cannot vote "sink"), their share
    of ``current`` and the label they alone would give (``beyond_label``, ties → Retriever;
    ``None`` without such votes). No rows without local layers or beyond votes."""
    import pandas as pd

    columns = ["layer", "head", "window", "label", "vote_current", "vote_sink", "vote_other",
               "beyond_current", "beyond_other", "beyond_current_share", "beyond_label"]
    beyond = getattr(result, "beyond_votes", None)
    windows = layer_windows(result)
    rows = []
    if beyond is not None:
        fractions = result.vote_fractions
        beyond_labels = labels_from_votes(beyond.double())
        for li, (layer, window) in enumerate(zip(result.layers, windows)):
            if window is None:
                continue
            for h in range(result.n_heads):
                current, other = float(beyond[li, h, 0]), float(beyond[li, h, 2])
                label = int(beyond_labels[li, h])
                rows.append([layer, h, window, result.labels[li][h], *fractions[li, h].tolist(), current, other,
                             current / (current + other) if current + other else float("nan"),
                             CLASSES[label] if label >= 0 else None])
    return pd.DataFrame(rows, columns=columns)


def mode(values: Any) -> tuple[float, float]:
    """The most frequent of the finite ``values`` (ties → the lower) and its share; NaN, NaN
    where none is finite."""
    import numpy as np

    finite = values[np.isfinite(values)]
    if not len(finite):
        return float("nan"), float("nan")
    kinds, counts = np.unique(finite, return_counts=True)  # sorted: argmax takes the lower
    best = int(np.argmax(counts))
    return float(kinds[best]), float(counts[best] / len(finite))


def null_decomposition(results: Mapping[str, AnalysisLike], metric: str = "f_score_cc"):
    """Per analysed N, the mean over heads of ``metric(top) − metric(null)`` for each null of
    SPEC §3, as a ``DataFrame``: the net effect of the value geometry and its parts.

    ``results`` maps a null (:data:`SHUFFLE_KINDS`) to the analysis made with it,
    ``analyze_heads(..., shuffle=kind)``, on the same inputs, options and seed. Columns: ``n``,
    ``dense``, ``top`` (mean ``metric`` of the top-N set), ``top − <kind>`` for each null given
    and, with the values null, ``reading`` (:func:`~.headline.geometry_reading`). How to read a
    gap: docs/math.md §3.

    Raises ``ValueError`` for an unknown null, a result made with another null than its key,
    or results that do not share the top-N scores (not the same inputs and options).
    """
    import pandas as pd

    if not isinstance(results, Mapping) or not results:
        raise ValueError("null_decomposition needs a mapping {kind: HeadAnalysis} with at least one "
                         f"of {list(SHUFFLE_KINDS)}, e.g. {{'values': r, 'norms': analyze_heads(..., "
                         "shuffle='norms')}}.")
    check_name("metric", metric, names()["metric"])
    for kind, result in results.items():
        check_name("null", kind, SHUFFLE_KINDS)
        if shuffle_kind(result) != kind:
            raise ValueError(f"results[{kind!r}] was made with shuffle={shuffle_kind(result)!r}; "
                             f"pass the analysis made with analyze_heads(..., shuffle={kind!r}).")
    kinds = [k for k in SHUFFLE_KINDS if k in results]
    first = results[kinds[0]]
    top = first.metric(metric, "top")
    for kind in kinds[1:]:
        other = results[kind]
        same = (other.layers == first.layers and torch.equal(other.n_values, first.n_values)
                and other.metric(metric, "top").shape == top.shape
                and all(other.metadata.get(k) == first.metadata.get(k) for k in ("seed", "shuffle_samples")))
        if not same or not torch.allclose(other.metric(metric, "top"), top, rtol=1e-9, atol=1e-12,
                                          equal_nan=True):
            raise ValueError(f"results[{kind!r}] and results[{kinds[0]!r}] do not share their top-N "
                             "scores, N, layers, seed or permutation count: analyse the same inputs "
                             "with the same options, changing only shuffle=.")

    rows = []
    for i, n in enumerate(first.n_values.tolist()):
        row: dict[str, Any] = {"n": n, "dense": is_dense(first, n), "top": finite_mean(top[..., i])}
        for kind in kinds:
            row[f"top − {kind}"] = finite_mean((top - results[kind].metric(metric, "shuffled"))[..., i])
        if "values" in results:
            row["reading"] = geometry_reading(row["top − values"])
        rows.append(row)
    return pd.DataFrame(rows)
