"""Tables of a :class:`~tl_geometry.result.HeadAnalysis` (``pandas`` is imported on use)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..functional.local_sink import LOCAL_SINK_FIELDS
from ..functional.taxonomy import CLASSES, labels_from_votes
from .headline import geometry_reading, headline_n, is_dense, layer_windows, shuffle_kind
from .labels import head_frame, merge_scores
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


def best_n(result: AnalysisLike):
    """Per head, the measured and (with bounds) predicted best N over the headline range
    (SPEC §6d), as a ``DataFrame``; NaN where undefined."""
    columns = {"measured_best_n": argmax_n(result, result.f_score, bound=False)}
    if result.bounds is not None:
        for kind, name in BEST_N_KINDS.items():
            columns[name] = argmax_n(result, result.bound(kind, "f_score"), bound=True)
    return head_frame(result, columns).drop(columns="label")


def measured_and_predicted_best_n(result: AnalysisLike, kind: str) -> tuple[Tensor, Tensor]:
    """Per head, the measured best N and the one bound ``kind`` predicts (:func:`argmax_n`)."""
    check_name("bound kind", kind, tuple(BEST_N_KINDS))
    return (argmax_n(result, result.f_score, bound=False),
            argmax_n(result, result.bound(kind, "f_score"), bound=True))


def heads_table(result: AnalysisLike, scores: Any = None):
    """:meth:`HeadAnalysis.heads_table <tl_geometry.result.HeadAnalysis.heads_table>`."""
    per_head = {k: v for k, (v, has_n) in result.quantities().items()
                if not has_n and not k.startswith("regime_")}
    votes = [k for k in per_head if k.startswith("vote_")]  # votes first, as before
    frame = head_frame(result, {k: per_head[k] for k in votes + [k for k in per_head if k not in votes]})
    frame.insert(frame.columns.get_loc("label_stability") + 1, "unstable", result.unstable.flatten().numpy())
    return frame if scores is None else merge_scores(frame, scores)


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


def local_sinks(result: Any, tokenizer: Any):
    """:meth:`HeadAnalysis.local_sinks <tl_geometry.result.HeadAnalysis.local_sinks>`."""
    import numpy as np
    import pandas as pd

    columns = ["layer", "head", "window", "sequences", "position", "position_share", "token", "token_share",
               "mass", "coverage", "kappa"]
    rows: list[list[Any]] = []
    if result.local_sink is not None:
        figures = result.local_sink.double().numpy()  # [sequence, field, layer, head]
        field_of = {name: i for i, name in enumerate(LOCAL_SINK_FIELDS)}
        for li, (layer, window) in enumerate(zip(result.layers, result.windows)):
            if window is None:
                continue
            for h in range(result.n_heads):
                per = figures[:, :, li, h]
                defined = per[np.isfinite(per[:, field_of["mass"]])]
                position, position_share = mode(defined[:, field_of["position"]])
                token_id, token_share = mode(defined[:, field_of["token"]])
                token: Any = None
                if np.isfinite(token_id):
                    token = tokenizer.decode([int(token_id)]) if tokenizer is not None else int(token_id)
                medians = [float(np.median(defined[:, field_of[f]])) if len(defined) else float("nan")
                           for f in ("mass", "coverage", "kappa")]
                rows.append([layer, h, window, len(defined), position, position_share, token, token_share, *medians])
    return pd.DataFrame(rows, columns=columns)


def to_pandas(result: AnalysisLike):
    """Long-form ``DataFrame``: one row per (layer, head, N, group) with the metrics, the
    number of instances behind the mean (``count``), and the head's label, votes and sink
    figures; rows ``group="random_se_monte_carlo"`` and ``"random_se_sequences"`` hold the
    random baseline's standard errors of every metric (SPEC §3); with bounds, rows
    ``group="bound_<kind>"`` hold the lower bounds on P, R, F and the ``separated`` fraction."""
    import pandas as pd

    li, h, ni = (x.flatten() for x in torch.meshgrid(
        torch.arange(result.n_layers), torch.arange(result.n_heads), torch.arange(len(result.n_values)),
        indexing="ij"))
    coords = {"layer": torch.tensor(result.layers)[li].numpy(), "head": h.numpy(),
              "n": result.n_values[ni].numpy()}

    def rows(group: str, values: dict[str, Tensor], **extra: Any):
        return pd.DataFrame({**coords, "group": group, **{m: v.flatten().numpy() for m, v in values.items()},
                             **extra})

    metrics = names()["metric"]
    frames = [rows(g, {m: result.metric(m, g) for m in metrics}, count=result.count(g).flatten().numpy())
              for g in names()["group"]]
    if getattr(result, "baseline_se", None) is not None:  # SPEC §3: the random baseline's standard errors
        frames += [rows(f"random_se_{k}", {m: result.baseline_error(m, k) for m in metrics})
                   for k in names()["se_kind"]]
    if result.bounds is not None:
        frames += [rows(f"bound_{k}", {m: result.bound(k, m) for m in names()["bound_metric"]})
                   for k in names()["bound_kind"]]
    frame = pd.concat(frames, ignore_index=True)
    return frame.merge(result.heads_table(), on=["layer", "head"], how="left")


def paired_sink_summary(result: AnalysisLike):
    """Per analysed N (``dense`` flagged), the three sink comparisons of SPEC §3, as a ``DataFrame``:
    ``pooled_f_sink_in`` / ``_out`` (1: mean F_N of the top-N instances with / without the sink
    in S_N, pooled over every instance of every head; ``instances_in`` / ``_out``),
    ``f_sink_removed`` (2: mean over heads of F_N re-selected without the sink), and
    ``paired_median_ratio`` / ``_halved`` (3, ours: the median over the ``paired_heads`` heads
    with such instances of each head's median F_N(with) / F_N(removed) and fraction ≤ 1/2;
    ``paired_instances`` in all; NaN where no head has one)."""
    import numpy as np
    import pandas as pd

    def pooled(group: str) -> tuple[Tensor, Tensor]:
        f, count = result.metric("f_score", group), result.count(group)
        weight = torch.where(f.isnan(), 0.0, count.double())
        total = weight.sum(dim=(0, 1))
        return (torch.nan_to_num(f) * weight).sum(dim=(0, 1)) / total, total

    f_in, n_in = pooled("sink_in")
    f_out, n_out = pooled("sink_out")
    ratio, halved, count = (result.paired_sink(f).numpy() for f in ("ratio", "halved", "count"))
    rows = []
    for i, n in enumerate(result.n_values.tolist()):
        has = np.nan_to_num(count[..., i]) > 0
        with np.errstate(all="ignore"):  # no head with a paired instance: NaN, not a warning
            med_ratio = float(np.median(ratio[..., i][has])) if has.any() else float("nan")
            med_halved = float(np.median(halved[..., i][has])) if has.any() else float("nan")
        removed = result.sink_removed_f_score[..., i]
        rows.append({
            "n": n, "dense": is_dense(result, n),
            "pooled_f_sink_in": float(f_in[i]), "instances_in": int(n_in[i]),
            "pooled_f_sink_out": float(f_out[i]), "instances_out": int(n_out[i]),
            "f_sink_removed": finite_mean(removed),
            "paired_median_ratio": med_ratio, "paired_median_halved": med_halved,
            "paired_heads": int(has.sum()), "paired_instances": int(np.nan_to_num(count[..., i]).sum()),
        })
    return pd.DataFrame(rows)


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
