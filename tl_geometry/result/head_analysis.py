"""``HeadAnalysis``: the per-(layer, head, N) result of :func:`tl_geometry.analyze_heads`.

Read it by name, not by position: ``result.sel(layer=5, head=3, n=2)`` (model layer index, head,
N value), ``result.label(5, 3)``, ``result.metric("f_score", group="random")``; every name lives
in :mod:`tl_geometry.result.schema`.
"""

from __future__ import annotations

import html
import math
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, SupportsIndex

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..functional.local_sink import LOCAL_SINK_FIELDS
from ..functional.regime import REGIME_FIELDS
from ..functional.separability import METRIC_NAMES, TRUNCATION_NAMES
from ..functional.sink import SINK_FIELDS
from ..functional.taxonomy import (
    CLASSES,
    UNLABELLED,
    UNLABELLED_NAME,
    UNSTABLE_BELOW,
    VOTES,
    labels_from_votes,
    vote_fractions,
    vote_margin,
)
from . import headline, io, layer_kinds, select, tables, text, tracking, units
from . import labels as confidence
from .schema import (
    BOUND_KINDS,
    BOUND_METRICS,
    GROUPS,
    NO_BOUNDS,
    PAIRED_FIELDS,
    SE_KINDS,
    NoBoundsError,
    UnknownNameError,
    check_fields,
    check_name,
)
from .select import HeadSelection
from .shortcuts import Shortcuts

#: A coordinate selection: one value (its axis is dropped), a sequence (kept) or None (all).
Coord = SupportsIndex | Sequence[SupportsIndex] | None


def _per_layer(saved: Any, n_layers: int) -> Tensor:
    """A per-layer count list of the metadata as a float tensor; NaN where it is missing."""
    if not isinstance(saved, (list, tuple)) or len(saved) != n_layers:
        return torch.full((n_layers,), torch.nan, dtype=torch.float64)
    return torch.tensor([float(x) for x in saved], dtype=torch.float64)


def _name(prefix: str, name: str) -> str:
    """Attribute / column name of a slice: ``f_score``, ``random_f_score``, ``sink_mass``, ..."""
    return name if prefix == "top" else f"{prefix}_{name}"


@dataclass
class HeadAnalysis(Shortcuts):
    """Geometric separability, sink diagnostics and taxonomy of every analysed head.

    ``scores[g, m, l, h, i]`` is the mean of metric ``METRIC_NAMES[m]`` for group ``GROUPS[g]``
    at layer ``layers[l]``, head ``h``, ``N = n_values[i]`` (axes: :data:`~.schema.AXES`; the
    constructor raises ``ValueError`` on a shape mismatch). The attribute shortcuts (``f_score``,
    ``random_f_score``, ``sink_mass``, ...) are each one accessor call (:mod:`.shortcuts`).
    """

    layers: tuple[int, ...]
    n_values: Int[Tensor, " n"]
    scores: Float[Tensor, "group metric layer head n"]
    group_counts: Float[Tensor, "group layer head n"]
    """Number of instances behind each mean of ``scores``."""
    sink: Float[Tensor, "field layer head"]
    vote_counts: Float[Tensor, "layer head 3"]
    metadata: dict[str, Any] = field(default_factory=dict)
    bounds: Float[Tensor, "kind bmetric layer head n"] | None = None
    """With ``analyze_heads(bounds=True)``: mean lower bounds ``[BOUND_KINDS, (P, R, F), ...]``."""
    regime: Float[Tensor, "rfield layer head"] | None = None
    """With ``bounds=True``: regime diagnostics ``[REGIME_FIELDS, layer, head]`` (SPEC §6c)."""
    paired: Float[Tensor, "pfield layer head n"] | None = None
    """Paired sink effect ``[PAIRED_FIELDS, layer, head, n]`` (SPEC §3; :meth:`paired_sink`)."""
    sequence_votes: Int[Tensor, "sequence layer head 3"] | None = None
    """Vote counts of each sequence (summing to ``vote_counts``), behind :attr:`label_stability`
    (SPEC §5); ``None`` in files of format ≤ 3."""
    truncation_p90: Float[Tensor, "tmetric layer head n"] | None = None
    """:meth:`truncation_percentile` (SPEC §10); ``None`` in files of format ≤ 4."""
    beyond_votes: Int[Tensor, "layer head 3"] | None = None
    """Votes of the sliding-window queries that cannot see the sink (SPEC §5), apart from
    ``vote_counts`` (zero on a global layer); ``None`` in files of format ≤ 5."""
    block_votes: Int[Tensor, "sequence block layer head 3"] | None = None
    """Votes per block of 128 consecutive queries of each sequence (zero for a partial block): the
    block bootstrap's units below 8 sequences (SPEC §5); ``None`` in files of format ≤ 5."""
    window_scores: Float[Tensor, "sequence wgroup metric layer head n"] | None = None
    """With ``per_window=True``: each sequence's own means, groups ``WINDOW_GROUPS``, NaN where
    undefined (SPEC §8); files of format ≤ 8 load with the sink-in / sink-out groups NaN."""
    window_sink: Float[Tensor, "sequence field layer head"] | None = None
    """With ``per_window=True``: each sequence's sink diagnostics (SPEC §4); ``None`` otherwise."""
    window_bounds: Float[Tensor, "sequence kind bmetric layer head n"] | None = None
    """With ``per_window=True`` and ``bounds=True``: each sequence's mean lower bounds (SPEC §8);
    ``None`` otherwise and in files of format ≤ 6."""
    baseline_se: Float[Tensor, "se_kind metric layer head n"] | None = None
    """:meth:`baseline_error` (SPEC §3); ``None`` in files of format ≤ 7."""
    local_sink: Float[Tensor, "sequence local_field layer head"] | None = None
    """Per sequence, fields ``LOCAL_SINK_FIELDS`` of the key that the queries beyond the sink's
    window attend most (ours; :meth:`local_sinks`); NaN on global layers. ``None`` when no
    analysed layer has a window, and in files of format ≤ 8."""

    def __post_init__(self) -> None:
        self.layers, self.n_values = check_fields(vars(self))
        recorded = self.metadata.get("window")
        if self.local_sink is not None and isinstance(recorded, list) and all(w is None for w in recorded):
            # Global layers only (e.g. a layer_subset): no local sink, as an analysis of them alone.
            self.local_sink = None

    def metric(self, name: str, group: str = "top") -> Float[Tensor, "layer head n"]:
        """Mean of metric ``name`` (:data:`METRIC_NAMES`; SPEC §3, §10) over the instances of
        ``group`` (:data:`GROUPS`), ``[layer, head, n]``; NaN where none was defined."""
        return self.scores[check_name("group", group, GROUPS), check_name("metric", name, METRIC_NAMES)]

    def count(self, group: str = "top") -> Float[Tensor, "layer head n"]:
        """Number of (sequence or instance) values behind ``metric(·, group)``, ``[layer, head, n]``."""
        return self.group_counts[check_name("group", group, GROUPS)]

    def sink_diagnostic(self, name: str) -> Float[Tensor, "layer head"]:
        """Sink figure ``name`` (``mass``, ``norm_ratio``, ``cosine``, ``mean_cosine``, ``share``;
        SPEC §4) per head, ``[layer, head]``."""
        return self.sink[check_name("sink field", name, SINK_FIELDS)]

    def paired_sink(self, name: str = "ratio") -> Float[Tensor, "layer head n"]:
        """Paired sink effect (SPEC §3, comparison 3; ours), ``[layer, head, n]``: over the
        instances whose top-N set holds the sink, ``"ratio"`` — the (lower) median of F_N(with
        sink) / F_N(sink removed), ``"halved"`` — the fraction with ratio ≤ 1/2, ``"count"`` —
        their number. NaN where no instance holds the sink."""
        return self._or_nan(self.paired, check_name("paired field", name, PAIRED_FIELDS))

    def truncation_percentile(self, name: str = "tail_mass") -> Float[Tensor, "layer head n"]:
        """90th percentile (nearest rank) over the instances where ``N`` is defined of the top-N
        set's ``"tail_mass"`` (``τ_N``) or ``"truncation_error"`` (``‖o − o_N‖/‖o‖``), SPEC §10,
        ``[layer, head, n]``; NaN where none is defined."""
        return self._or_nan(self.truncation_p90, check_name("truncation metric", name, TRUNCATION_NAMES))

    def baseline_error(self, metric: str = "f_score", kind: str = "monte_carlo") -> Float[Tensor, "layer head n"]:
        """Standard error of the random baseline's mean ``metric(metric, "random")`` (SPEC §3),
        ``[layer, head, n]``: ``"monte_carlo"`` — ``√(Σ_s Var_s)/S`` over the draws of its ``R``
        subsets per query (NaN where ``R < 2``); ``"sequences"`` — the sample standard deviation
        of the per-sequence means over ``√S`` (NaN below 2 sequences).

        >>> r.baseline_error("f_score")[:, :, 1]           # doctest: +SKIP
        """
        m, k = check_name("metric", metric, METRIC_NAMES), check_name("standard error kind", kind, SE_KINDS)
        return self._or_nan(self.baseline_se, k, m)

    def _or_nan(self, values: Tensor | None, *index: int) -> Tensor:
        """``values[index]``, or NaN ``[layer, head, n]`` for a file of a format without them."""
        return torch.full_like(self.scores[0, 0], torch.nan) if values is None else values[index]

    def bound(self, kind: str, metric: str = "f_score") -> Float[Tensor, "layer head n"]:
        """Mean lower bound ``[layer, head, n]`` of ``kind`` (:data:`BOUND_KINDS`; SPEC §6) on
        ``metric`` (``precision``, ``recall``, ``f_score``), or with ``metric="separated"`` (ours)
        the fraction of instances where the bound certifies ``P_N = R_N = 1``."""
        k, m = check_name("bound kind", kind, BOUND_KINDS), check_name("bound metric", metric, BOUND_METRICS)
        if self.bounds is None:
            raise NoBoundsError(NO_BOUNDS)
        return self.bounds[k, m]

    def regime_diagnostic(self, name: str) -> Float[Tensor, "layer head"]:
        """Regime diagnostic ``name`` (:data:`REGIME_FIELDS`, SPEC §6c) per head, ``[layer, head]``;
        needs ``bounds=True``."""
        i = check_name("regime field", name, REGIME_FIELDS)
        if self.regime is None:
            raise NoBoundsError(NO_BOUNDS)
        return self.regime[i]

    @property
    def f_gain(self) -> Float[Tensor, "layer head n"]:
        """Top-N minus random F_N (SPEC §3), ``[layer, head, n]``."""
        return self.f_score - self.random_f_score

    @property
    def vote_fractions(self) -> Float[Tensor, "layer head 3"]:
        """Fractions of source-winner votes (current, sink, other); NaN for a head with none."""
        return vote_fractions(self.vote_counts)

    @property
    def label_margin(self) -> Float[Tensor, "layer head"]:
        """Vote margin per head (SPEC §5): largest vote fraction minus the second; NaN for a
        head with no votes. Near 0, two classes nearly tie."""
        return vote_margin(self.vote_counts)

    @property
    def label_stability(self) -> Float[Tensor, "layer head"]:
        """Label stability per head (SPEC §5): the share of 200 bootstrap resamples (seed 0) whose
        plurality label is the head's (:func:`~tl_geometry.result.labels.label_stability`)."""
        return confidence.label_stability(self)

    @property
    def unstable(self) -> torch.Tensor:
        """``[layer, head]`` bool: heads whose label stability is below 0.8 (SPEC §5); False
        where the stability is NaN (too few units, unknown, unlabelled)."""
        return self.label_stability < UNSTABLE_BELOW

    @property
    def labels(self) -> list[list[str | None]]:
        """Class of every head by plurality vote: ``labels[li][h]`` for layer ``layers[li]``
        (SPEC §5); ``None`` for a head with no votes (shown "unlabelled"; left out of class
        counts and shares). By model layer index: :meth:`label`."""
        index = labels_from_votes(self.vote_counts).tolist()
        return [[None if i == UNLABELLED else CLASSES[i] for i in row] for row in index]

    def label(self, layer: int, head: int) -> str | None:
        """Class of head ``head`` of model layer ``layer``: ``"Retriever" | "Mixer" | "Reset"``,
        or ``None`` if the head has no votes (no query ``t ≥ 1`` evaluated; SPEC §5)."""
        li = select.positions("layer", layer, list(self.layers))
        h = select.positions("head", head, list(range(self.n_heads)))
        if not (isinstance(li, int) and isinstance(h, int)):
            raise UnknownNameError(f"label({layer!r}, {head!r}): give one layer and one head; "
                                   "for several use sel(layer=..., head=...)['label'].")
        return self.labels[li][h]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_heads(self) -> int:
        return self.scores.shape[3]

    @property
    def kv_group_size(self) -> int:
        """:func:`~tl_geometry.result.units.kv_group_size` (SPEC §4)."""
        return units.kv_group_size(self)

    @property
    def n_kv_heads(self) -> int:
        """Value groups per layer (KV heads in value space, query heads in output space): the
        unit of the value-only figures (SPEC §4)."""
        return self.n_heads // self.kv_group_size

    def kv_heads(self, values: str | Tensor) -> Tensor:
        """:func:`~tl_geometry.result.units.kv_reduce` of ``values``, a tensor or a key of
        :meth:`quantities` (``"sink_norm_ratio"``, ...), by this result's group size (SPEC §4).

        >>> kappa = result.kv_heads("sink_norm_ratio")       # [layer, kv]   # doctest: +SKIP
        """
        name = "values"
        if isinstance(values, str):
            quantities = self.quantities()
            if values not in quantities:
                raise UnknownNameError(f"kv_heads({values!r}): unknown key; value-only keys: "
                                       f"{', '.join(k for k in units.value_only_names() if k in quantities)}.")
            name, values = values, quantities[values][0]
        return units.kv_reduce(values, self.kv_group_size, name)

    def kv_heads_table(self):
        """:func:`~tl_geometry.result.units.kv_heads_table`."""
        return units.kv_heads_table(self)

    def quantities(self) -> dict[str, tuple[Tensor, bool]]:
        """Every per-head quantity by name, as ``(values, has_n_axis)``: metrics of every group,
        ``f_gain``, the baseline's standard errors (``random_f_score_se_mc``, ...), instance counts,
        sink figures, vote fractions and, with bounds, the bounds and regime diagnostics."""
        out: dict[str, tuple[Tensor, bool]] = {}
        for g in GROUPS:
            out.update({_name(g, m): (self.metric(m, g), True) for m in METRIC_NAMES})
        out["f_gain"] = (self.f_gain, True)
        if self.baseline_se is not None:  # the random baseline's standard errors (SPEC §3)
            out.update({f"{_name('random', m)}_se_{k}": (self.baseline_error(m, kind), True)
                        for m in METRIC_NAMES for kind, k in zip(SE_KINDS, ("sequences", "mc"))})
        out.update({f"paired_sink_{f}": (self.paired_sink(f), True) for f in PAIRED_FIELDS})
        out.update({f"p90_{m}": (self.truncation_percentile(m), True) for m in TRUNCATION_NAMES})
        out.update({_name(g, "count"): (self.count(g), True) for g in GROUPS})
        out.update({f"sink_{f}": (self.sink_diagnostic(f), False) for f in SINK_FIELDS})
        fractions = self.vote_fractions
        out.update({f"vote_{v}": (fractions[..., i], False) for i, v in enumerate(VOTES)})
        out["label_margin"] = (self.label_margin, False)
        out["label_stability"] = (self.label_stability, False)
        if self.bounds is not None:
            out.update({f"{k}_{m}": (self.bound(k, m), True) for k in BOUND_KINDS for m in BOUND_METRICS})
            out.update({f"regime_{f}": (self.regime_diagnostic(f), False) for f in REGIME_FIELDS})
        return out

    def layer_subset(self, layers: Sequence[int]) -> HeadAnalysis:
        """:func:`~tl_geometry.result.layer_kinds.layer_subset`."""
        return layer_kinds.layer_subset(self, layers)

    def by_layer_kind(self) -> dict[str, HeadAnalysis]:
        """:func:`~tl_geometry.result.layer_kinds.by_layer_kind` (SPEC §8 (i))."""
        return layer_kinds.by_layer_kind(self)

    def sel(self, layer: Coord = None, head: Coord = None, n: Coord = None) -> HeadSelection:
        """Select by **model layer index**, head and **N value** (not by position), like xarray.

        A scalar drops its axis, a list keeps it (in the order given), ``None`` keeps every value.
        Unknown values raise a ``ValueError`` (also a ``KeyError``) listing the valid ones.

        >>> s = result.sel(layer=5, head=3, n=2)          # doctest: +SKIP
        >>> float(s["f_score"]), s["label"]                # doctest: +SKIP
        >>> result.sel(n=2)["f_score"]                     # [layer, head] F_2   # doctest: +SKIP
        """
        every = {"layer": list(self.layers), "head": list(range(self.n_heads)), "n": self.n_values.tolist()}
        asked = {"layer": layer, "head": head, "n": n}
        index = tuple(select.positions(a, asked[a], every[a]) for a in select.COORDS)
        data: dict[str, Any] = {
            key: select.take(values, index if has_n else index[:2])
            for key, (values, has_n) in self.quantities().items()
        }

        def pick(row: list[Any], i: select.Index) -> Any:  # the same selection on nested lists
            return row if i is None else row[i] if isinstance(i, int) else [row[j] for j in i]

        rows = pick(self.labels, index[0])
        data["label"] = (pick(rows, index[1]) if isinstance(index[0], int)
                         else [pick(r, index[1]) for r in rows])
        dims = tuple(a for a, i in zip(select.COORDS, index) if not isinstance(i, int))
        coords = {a: every[a] if v is None else v for a, v in asked.items()}
        return HeadSelection(data, coords, dims)

    def _n_index(self, n: int) -> int:
        """Position of the N value ``n`` in ``n_values`` (an error lists the analysed ones)."""
        return select.positions("n", n, self.n_values.tolist())  # type: ignore[return-value]

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The sliding window of each analysed layer (SPEC §1, ours; query ``t`` saw keys
        ``t − w < i ≤ t``), ``None`` for a global layer (:func:`~.headline.layer_windows`)."""
        return headline.layer_windows(self)

    @property
    def sink_visible(self) -> Float[Tensor, " layer"]:
        """Per layer, the chosen (sequence, query) instances whose window held the sink (SPEC §1);
        NaN where not recorded."""
        return _per_layer(self.metadata.get("sink_visible"), self.n_layers)

    @property
    def n_instances(self) -> Float[Tensor, " layer"]:
        """Per layer, the chosen (sequence, query) instances analysed (NaN where not recorded)."""
        return _per_layer(self.metadata.get("instances"), self.n_layers)

    @property
    def certified_fraction(self) -> Float[Tensor, " n"]:
        """Fraction of heads whose every analysed query is certified (P̲ = R̲ = 1) at each N."""
        certified = (self.bound("certified", "precision") == 1) & (self.bound("certified", "recall") == 1)
        return certified.double().mean(dim=(0, 1))

    @property
    def shuffle(self) -> str:
        """Which null the ``shuffled`` group is (:func:`~.headline.shuffle_kind`, SPEC §3)."""
        return headline.shuffle_kind(self)

    @property
    def headline_n(self) -> tuple[int, ...]:
        """The analysed N in the headline range ``2 ≤ N ≤ (t+1)/4`` (SPEC §3); larger N are
        "dense" (computed, never headlined)."""
        return headline.headline_n(self)

    def best_n(self):
        """Per head, the argmax of F_N over :attr:`headline_n` (SPEC §6d), as a ``DataFrame``:
        ``layer, head, measured_best_n`` and, with bounds, ``shell_best_n``, ``shell_n_best_n``
        and ``predicted_best_n`` (the argmax of each bound's F̲_N); NaN where undefined, ties →
        the smaller N."""
        columns = {"measured_best_n": tables.argmax_n(self, self.f_score, bound=False)}
        if self.bounds is not None:
            for kind, name in tables.BEST_N_KINDS.items():
                columns[name] = tables.argmax_n(self, self.bound(kind, "f_score"), bound=True)
        return confidence.head_frame(self, columns).drop(columns="label")

    def best_n_agreement(self, kind: str = "shell_n") -> float:
        """Fraction of heads whose bound-predicted best N (``kind``: ``shell``, ``shell_n``,
        ``predicted``) equals the measured one, where both are defined (NaN if none); its
        chance level: :meth:`best_n_vs_chance`."""
        measured, predicted = tables.measured_and_predicted_best_n(self, kind)
        both = ~torch.isnan(measured) & ~torch.isnan(predicted)
        if not both.any():
            return float("nan")
        return float((measured[both] == predicted[both]).double().mean())

    def best_n_vs_chance(self, kind: str = "shell_n", *, n_shuffles: int = tracking.N_SHUFFLES,
                         seed: int = 0) -> tracking.BestNAgreement:
        """The best-N agreement of bound ``kind`` next to its chance rate ``Σ_n p_measured(n)
        p_bound(n)`` (SPEC §6d, ours), with the excess and a p-value over ``n_shuffles`` seeded
        shuffles (:class:`~tl_geometry.result.tracking.BestNAgreement`).

        >>> result.best_n_vs_chance("shell_n").text()    # doctest: +SKIP
        '64.8 % of 270 heads (chance 58.2 %, excess +6.6 points, shuffle p = 0.012)'
        """
        measured, predicted = tables.measured_and_predicted_best_n(self, kind)
        return tracking.agreement_vs_chance(measured, predicted, n_shuffles=n_shuffles, seed=seed)

    def rho_by_n(self, kind: str = "shell_n", metric: str = "f_score"):
        """Spearman's ρ across heads between bound ``kind`` and the measured ``metric`` within
        each headline N (SPEC §6d; never pooled over N), as a ``DataFrame`` ``n, rho, heads``."""
        return tracking.rho_by_n(self, kind, metric)

    def paired_sink_summary(self):
        """Per analysed N (``dense`` flagged), the three sink comparisons of SPEC §3, as a
        ``DataFrame``: ``pooled_f_sink_in`` / ``_out`` (1: mean F_N of the top-N instances with /
        without the sink in S_N, pooled over every instance of every head; ``instances_in`` /
        ``_out``),
        ``f_sink_removed`` (2: mean over heads of F_N re-selected without the sink), and
        ``paired_median_ratio`` / ``_halved`` (3, ours: the median over the ``paired_heads`` heads
        with such instances of each head's median F_N(with) / F_N(removed) and fraction ≤ 1/2;
        ``paired_instances`` in all; NaN where no head has one)."""
        import numpy as np
        import pandas as pd

        def pooled(group: str) -> tuple[Tensor, Tensor]:
            f, count = self.metric("f_score", group), self.count(group)
            weight = torch.where(f.isnan(), 0.0, count.double())
            total = weight.sum(dim=(0, 1))
            return (torch.nan_to_num(f) * weight).sum(dim=(0, 1)) / total, total

        f_in, n_in = pooled("sink_in")
        f_out, n_out = pooled("sink_out")
        ratio, halved, count = (self.paired_sink(f).numpy() for f in ("ratio", "halved", "count"))
        rows = []
        for i, n in enumerate(self.n_values.tolist()):
            has = np.nan_to_num(count[..., i]) > 0
            with np.errstate(all="ignore"):  # no head with a paired instance: NaN, not a warning
                med_ratio = float(np.median(ratio[..., i][has])) if has.any() else float("nan")
                med_halved = float(np.median(halved[..., i][has])) if has.any() else float("nan")
            rows.append({
                "n": n, "dense": headline.is_dense(self, n),
                "pooled_f_sink_in": float(f_in[i]), "instances_in": int(n_in[i]),
                "pooled_f_sink_out": float(f_out[i]), "instances_out": int(n_out[i]),
                "f_sink_removed": tables.finite_mean(self.sink_removed_f_score[..., i]),
                "paired_median_ratio": med_ratio, "paired_median_halved": med_halved,
                "paired_heads": int(has.sum()), "paired_instances": int(np.nan_to_num(count[..., i]).sum()),
            })
        return pd.DataFrame(rows)

    def class_counts(self):
        """``pandas.DataFrame`` of the number of heads of each class per layer (columns
        :data:`CLASSES`); unlabelled heads are in none (SPEC §5; :attr:`n_unlabelled`)."""
        import pandas as pd

        rows = [{c: row.count(c) for c in CLASSES} for row in self.labels]
        return pd.DataFrame(rows, index=pd.Index(self.layers, name="layer"), columns=list(CLASSES))

    @property
    def n_unlabelled(self) -> int:
        """Number of heads with no votes, hence no class (SPEC §5)."""
        return sum(row.count(None) for row in self.labels)

    def heads_table(self, scores=None):
        """One row per (layer, head): label, vote fractions (``vote_current``, ...), label
        confidence (``label_margin``, ``label_stability``, ``unstable``; SPEC §5) and sink
        diagnostics (``sink_mass``, ...); with ``scores`` (a :func:`tl_geometry.head_scores`
        table) its score columns too (``previous_token``, ``induction``, ...).

        >>> result.heads_table(scores=tl_geometry.head_scores(model))   # doctest: +SKIP
        """
        per_head = {k: v for k, (v, has_n) in self.quantities().items()
                    if not has_n and not k.startswith("regime_")}
        votes = [k for k in per_head if k.startswith("vote_")]  # votes first, as before
        frame = confidence.head_frame(self, {k: per_head[k] for k in votes + [k for k in per_head if k not in votes]})
        frame.insert(frame.columns.get_loc("label_stability") + 1, "unstable", self.unstable.flatten().numpy())
        return frame if scores is None else confidence.merge_scores(frame, scores)

    def export_labels(self, path: str | Path, *, scores=None) -> Path:
        """Write one row per head — ``layer, head, label, vote_current, vote_sink, vote_other,
        margin, stability`` and, with ``scores`` (a :func:`tl_geometry.head_scores` table), its
        score columns — as CSV or JSON by the suffix of ``path`` (docs/labels.md); returns the
        path. A ``scores`` table that lacks an analysed head or lists one twice, and a ``path``
        that is a folder, raise ``ValueError``.

        >>> result.export_labels("labels.csv")    # doctest: +SKIP
        """
        return confidence.export_labels(self, path, scores)

    def beyond_table(self):
        """:func:`~tl_geometry.result.tables.beyond_table` (SPEC §1, §5).

        >>> result.beyond_table().query("beyond_label != label")   # doctest: +SKIP
        """
        return tables.beyond_table(self)

    def local_sinks(self, tokenizer: Any = None):
        """``pandas.DataFrame``, one row per sliding-window head: where the queries that cannot
        see the sink put their mass instead (ours; :attr:`local_sink`). Columns ``layer, head,
        window, sequences``, the most frequent ``position`` and ``token`` (decoded with
        ``tokenizer`` when given; ties → the lower) with their ``*_share``, and the medians over
        sequences of ``mass``, ``coverage`` and ``kappa``.

        >>> result.local_sinks(model.tokenizer).sort_values("mass", ascending=False)  # doctest: +SKIP
        """
        import numpy as np
        import pandas as pd

        columns = ["layer", "head", "window", "sequences", "position", "position_share", "token", "token_share",
                   "mass", "coverage", "kappa"]
        rows: list[list[Any]] = []
        if self.local_sink is not None:
            figures = self.local_sink.double().numpy()  # [sequence, field, layer, head]
            field_of = {name: i for i, name in enumerate(LOCAL_SINK_FIELDS)}
            for li, (layer, window) in enumerate(zip(self.layers, self.windows)):
                if window is None:
                    continue
                for h in range(self.n_heads):
                    per = figures[:, :, li, h]
                    defined = per[np.isfinite(per[:, field_of["mass"]])]
                    position, position_share = tables.mode(defined[:, field_of["position"]])
                    token_id, token_share = tables.mode(defined[:, field_of["token"]])
                    token: Any = None
                    if np.isfinite(token_id):
                        token = tokenizer.decode([int(token_id)]) if tokenizer is not None else int(token_id)
                    medians = [float(np.median(defined[:, field_of[f]])) if len(defined) else float("nan")
                               for f in ("mass", "coverage", "kappa")]
                    rows.append([layer, h, window, len(defined), position, position_share, token, token_share,
                                 *medians])
        return pd.DataFrame(rows, columns=columns)

    def to_pandas(self):
        """Long-form ``DataFrame``: one row per (layer, head, N, group) with the metrics, the
        number of instances behind the mean (``count``), and the head's label, votes and sink
        figures; rows ``group="random_se_monte_carlo"`` and ``"random_se_sequences"`` hold the
        random baseline's standard errors of every metric (SPEC §3); with bounds, rows
        ``group="bound_<kind>"`` hold the lower bounds on P, R, F and the ``separated`` fraction."""
        import pandas as pd

        li, h, ni = (x.flatten() for x in torch.meshgrid(
            torch.arange(self.n_layers), torch.arange(self.n_heads), torch.arange(len(self.n_values)),
            indexing="ij"))
        coords = {"layer": torch.tensor(self.layers)[li].numpy(), "head": h.numpy(),
                  "n": self.n_values[ni].numpy()}

        def rows(group: str, values: dict[str, Tensor], **extra: Any):
            return pd.DataFrame({**coords, "group": group, **{m: v.flatten().numpy() for m, v in values.items()},
                                 **extra})

        frames = [rows(g, {m: self.metric(m, g) for m in METRIC_NAMES}, count=self.count(g).flatten().numpy())
                  for g in GROUPS]
        if self.baseline_se is not None:  # SPEC §3: the random baseline's standard errors
            frames += [rows(f"random_se_{k}", {m: self.baseline_error(m, k) for m in METRIC_NAMES})
                       for k in SE_KINDS]
        if self.bounds is not None:
            frames += [rows(f"bound_{k}", {m: self.bound(k, m) for m in BOUND_METRICS})
                       for k in BOUND_KINDS]
        frame = pd.concat(frames, ignore_index=True)
        return frame.merge(self.heads_table(), on=["layer", "head"], how="left")

    def top(self, k: SupportsIndex = 10, *, by: str = "f_gain", n: int = 2, largest: bool = True,
            label: str | None = None):
        """The ``k`` heads with the largest (or smallest) ``by`` at ``N = n``, as a ``DataFrame``
        (the :meth:`heads_table` columns plus ``by``); with ``label`` (``"Retriever"``,
        ``"Mixer"``, ``"Reset"``) only the heads of that class.

        ``by`` is a key of :meth:`quantities` (a wrong one raises an error listing them); ``k`` a
        positive int, else ``ValueError``. NaN comes last; ties keep layer, head order, with a
        ``UserWarning`` when one straddles the ``k``-th place.

        >>> result.top(3, by="vote_current", label="Retriever")   # doctest: +SKIP
        """
        if isinstance(k, bool) or type(k).__name__ in ("bool", "bool_") or (
                isinstance(k, torch.Tensor) and k.dtype == torch.bool):
            raise ValueError(f"top(k=...): {k!r} is a bool; give the number of heads to return "
                             "as an int ≥ 1, e.g. 10.")
        try:
            k = operator.index(k)
        except TypeError:
            raise ValueError(f"top(k=...): {k!r} ({type(k).__name__}) is not an int; give the "
                             "number of heads to return as an int ≥ 1, e.g. 10.") from None
        if k < 1:
            raise ValueError(f"top(k=...): {k} is below 1; give the number of heads to return as "
                             "an int ≥ 1, e.g. 10 (every head: the number of heads, or "
                             "heads_table()).")
        if not isinstance(largest, bool) and type(largest).__name__ not in ("bool", "bool_"):
            raise ValueError(f"top(largest={largest!r}): give True (the largest first) or False "
                             "(the smallest first).")
        largest = bool(largest)
        if label is not None:
            check_name("label", label, CLASSES)
        quantities = self.quantities()
        if by not in quantities:
            if self.bounds is None and by.split("_")[0] in (*BOUND_KINDS, "regime"):
                raise NoBoundsError(f"top(by={by!r}): {NO_BOUNDS}")
            raise UnknownNameError(f"top(by={by!r}): unknown key; valid: {', '.join(quantities)}.")
        values, has_n = quantities[by]
        if has_n:
            values = values[..., self._n_index(n)]
        flat = torch.nan_to_num(values.flatten(), nan=-torch.inf if largest else torch.inf)
        order = flat.argsort(descending=largest, stable=True)
        if label is not None:  # filter before taking k, so that k heads of the class come back
            of_class = torch.tensor([x == label for row in self.labels for x in row], dtype=torch.bool)
            order = order[of_class[order]]
        if len(order) > k and flat[order[k - 1]] == flat[order[k]] and flat[order[k]].isfinite():
            tied = int((flat[order] == flat[order[k - 1]]).sum())
            warnings.warn(f"top({k}, by={by!r}): {tied} heads share the value {float(flat[order[k]]):.6g} "
                          f"at place {k}; layer, head order decides which of them are listed.",
                          UserWarning, stacklevel=2)
        order = order[:k]
        chosen = self.heads_table().iloc[order.tolist()].copy()
        if by not in chosen.columns:
            chosen.insert(3, by, values.flatten()[order].numpy())
        return chosen.reset_index(drop=True)

    def summary(self, n_values: Sequence[int] = (2, 4, 8), *, top: int | None = 20) -> str:
        """Readable summary: run, classes, mean F_N against random, then the ``top`` heads by
        F-gain at the first shown N (``top=None``: every head, in layer order), with a legend;
        with sliding-window layers, one line on their local sinks (:meth:`local_sinks`). See
        docs/reading.md for how to read it."""
        return text.summary(self, n_values, top)

    def _repr_html_(self) -> str:
        """Notebooks: the :func:`repr`, the class counts and the 10 heads of largest F-gain at the
        first analysed N ≥ 2, labels in their class colour."""
        if "scores" not in vars(self):  # a constructor that failed: nothing to describe
            return f"<code>&lt;{type(self).__name__} (not constructed)&gt;</code>"
        sizes = self.n_values.tolist()
        n = next((x for x in sizes if x >= 2), sizes[0])
        with warnings.catch_warnings():  # a display, not a ranking the user asked for: no tie notes
            warnings.simplefilter("ignore", UserWarning)
            table = self.top(min(10, self.n_layers * self.n_heads), by="f_gain", n=n)
        columns = [c for c in ("layer", "head", "label", "f_gain", "vote_current", "vote_sink", "vote_other",
                               "label_margin", "label_stability") if c in table.columns]

        def cell(column: str, value: object) -> str:
            if column == "label":
                name = text.label_text(value if isinstance(value, str) else None)
                return (f'<td style="background:{text.CLASS_COLORS[name]};color:white;font-weight:600">'
                        f"{html.escape(name)}</td>")
            if isinstance(value, float):
                return f"<td>{'' if math.isnan(value) else f'{value:.3f}'}</td>"
            return f"<td>{html.escape(str(value))}</td>"

        counts = " · ".join(f'<span style="color:{text.CLASS_COLORS[c]};font-weight:600">{c}</span> {k}'
                            for c, k in text.class_totals(self).items())
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        rows = "".join("<tr>" + "".join(cell(c, row[c]) for c in columns) + "</tr>" for _, row in table.iterrows())
        return (f"<div><p><code>{html.escape(repr(self))}</code></p><p>{counts}</p>"
                f"<p>Top {len(table)} heads by F-gain (F_N − random F_N) at N = {n}:</p>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
                "<p><code>result.summary()</code> for the whole text summary.</p></div>")

    def __repr__(self) -> str:
        """``HeadAnalysis(model=..., layers=30 (0..29), heads=9, n_values=[...], ...)``."""
        if "scores" not in vars(self):  # a constructor that failed: nothing to describe
            return f"<{type(self).__name__} (not constructed)>"
        classes = ", ".join(f"{c}={k}" for c, k in text.class_totals(self).items())
        if unlabelled := self.n_unlabelled:
            classes += f", {UNLABELLED_NAME}={unlabelled}"
        name = self.metadata.get("model_name")
        model = f"model={name!r}, " if name else ""
        return (f"HeadAnalysis({model}layers={self.n_layers} ({text.layers_text(self.layers)}), "
                f"heads={self.n_heads}, n_values={self.n_values.tolist()}, {classes}, "
                f"bounds={self.bounds is not None})")

    def save(self, path: str | Path) -> Path:
        """Write the analysis to ``path``, atomically, as a versioned, checksummed file of named
        tensors and JSON metadata (:mod:`tl_geometry.result.io`)."""
        return io.save(vars(self), path)

    @classmethod
    def load(cls, path: str | Path) -> HeadAnalysis:
        """Read an analysis written by :meth:`save` (bit-exact round trip, by name).

        Raises :class:`~tl_geometry.result.io.ResultFileError` naming the file and the problem
        for an unreadable, foreign, inconsistent or altered file or a folder;
        ``FileNotFoundError`` if there is none. Files of format 1 load with a ``UserWarning``.
        """
        return cls(**io.load(path))
