"""Static plots: F_N against N, sink figures and class counts per layer, the ablation curves and
the sensitivity heatmap; :func:`save_figure` writes PNG and SVG.

Figures are built without pyplot (no global state, no display): each is a :class:`PlotFigure`,
which Jupyter shows once as a PNG image. A plot drawn into the caller's ``ax`` returns that
``ax``, as matplotlib's own functions do (returning its figure would show it twice in a notebook).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, overload

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..functional.figures import FIGURES
from ..functional.taxonomy import CLASSES, UNLABELLED_NAME
from ..result import BOUND_KINDS, BOUND_METRICS, GROUPS, METRIC_NAMES, HeadAnalysis
from ..result.headline import dense_from
from .taxonomy import CLASS_COLORS

__all__ = ["PlotFigure", "ablation_plot", "class_counts_plot", "f_curves_plot", "save_figure", "sensitivity_plot",
           "sink_plot", "sparsification_plot"]


class PlotFigure(Figure):
    """A matplotlib ``Figure`` that displays itself in Jupyter as a PNG image (``_repr_png_``,
    which a plain ``Figure`` only gets from pyplot's inline backend); the rest is ``Figure``'s.

    >>> fig = PlotFigure(figsize=(2, 1)); fig.subplots().plot([0, 1])  # doctest: +ELLIPSIS
    [<matplotlib.lines.Line2D object at ...>]
    >>> fig._repr_png_()[:4]
    b'\\x89PNG'
    """

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", bbox_inches="tight")  # as the inline backend draws
        return buffer.getvalue()


_GROUP_STYLE = {
    "top": dict(color="#1d2330", lw=2.2, label="top N keys"),
    "random": dict(color="#888888", lw=1.6, ls="--", label="N random keys"),
    "shuffled": dict(color="#b5651d", lw=1.6, ls="-.", label="top N, values shuffled"),
    "sink_removed": dict(color="#2a9d8f", lw=1.6, label="top N, sink removed"),
    "sink_in": dict(color="#7b4fa3", lw=1.3, ls=":", label="top N with the sink"),
    "sink_out": dict(color="#e07a1f", lw=1.3, ls=":", label="top N without the sink"),
}
_BOUND_STYLE = {
    "inversion": dict(color="#1d2330", lw=1.0, ls="-.", label="inversion certificate"),
    "certified": dict(color="#c0392b", lw=1.0, ls="-.", label="certified bound"),
    "predicted": dict(color="#c0392b", lw=1.4, ls=(0, (1, 1)), label="predicted envelope"),
    "shell": dict(color="#1f6f8b", lw=1.2, ls="--", label="shell certificate, K = 0"),
    "shell_n": dict(color="#1f6f8b", lw=1.4, ls="-", label="shell certificate, K = N"),
}


def _curves(result: HeadAnalysis, mask: np.ndarray, metric: str) -> dict[str, np.ndarray]:
    """Mean over the heads in ``mask`` [layer, head] of every group's (and bound's) ``metric``."""
    out = {}
    with _quiet():
        for g in GROUPS:
            out[g] = np.nanmean(result.metric(metric, g).numpy()[mask], axis=0)
        if result.bounds is not None and metric in BOUND_METRICS:
            for k in BOUND_KINDS:
                out["bound_" + k] = np.nanmean(result.bound(k, metric).numpy()[mask], axis=0)
    return out


@contextmanager
def _quiet():
    """Means of all-NaN slices (a class with no heads, an N no query can hold) are NaN: fine."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _draw(ax: Any, ns: np.ndarray, curves: dict[str, np.ndarray], title: str, dense_n: float,
          unit_range: bool) -> None:
    for g in GROUPS:
        ax.plot(ns, curves[g], marker="o", ms=3, **_GROUP_STYLE[g])
    for k in BOUND_KINDS:
        if "bound_" + k in curves:
            ax.plot(ns, curves["bound_" + k], **_BOUND_STYLE[k])
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    if unit_range:
        ax.set_ylim(-0.02, 1.02)
    if ns[0] == 1:  # Euclidean F_1 = 1 for any selection: shade the trivial N
        ax.axvspan(1 / 1.3, 1.4, color="#eee", zorder=0)
    if ns[-1] > dense_n:  # dense N > (t+1)/4: the precision floor N/(t+1) lifts F (SPEC §3)
        ax.axvspan(max(dense_n, ns[0] / 1.3), ns[-1] * 1.3, color="#e3e9f1", zorder=0,
                   label="dense N > (t+1)/4 (not headlined)")
    ax.set_xlim(ns[0] / 1.3, ns[-1] * 1.3)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)


def _heads(count: int) -> str:
    return f"{count} head" + ("" if count == 1 else "s")


#: How a metric is named on the plots (title, y axis); metrics in [0, 1] share the y range.
_METRIC_TITLES = {"precision": ("Precision", "precision"), "recall": ("Recall", "recall"),
                  "f_score": ("F score", "F score"), "margin": ("Margin γ", "margin γ"),
                  "inversions": ("Inversions", "inversions"),
                  "precision_cc": ("Chance-corrected precision P*", "P*"),
                  "f_score_cc": ("Chance-corrected F score F*", "F*"),
                  "tail_mass": ("Tail mass τ", "τ"),
                  "truncation_error": ("Relative truncation error ‖o − o_N‖/‖o‖", "relative error")}
_UNIT_RANGE = tuple(f.name for f in FIGURES if f.axis == "metric" and f.unit)


def f_curves_plot(result: HeadAnalysis, *, by: str = "class", metric: str = "f_score") -> PlotFigure:
    """F_N against N for every selection group (SPEC §3) and, with ``bounds=True``, the bounds
    (SPEC §6), averaged over the heads of each class (``by="class"``; unlabelled heads only in
    "all") or of each layer (``by="layer"``); ``metric`` plots another metric the same way.
    N = 1 (trivial) and the dense N > (t+1)/4 (not headlined) are shaded.

    >>> fig = f_curves_plot(result, by="class"); save_figure(fig, "f_by_class")  # doctest: +SKIP
    """
    if by not in ("class", "layer"):
        raise ValueError(f'by must be "class" or "layer", got {by!r}.')
    if metric not in METRIC_NAMES:
        raise ValueError(f"metric must be one of {', '.join(METRIC_NAMES)}; got {metric!r}.")
    ns = result.n_values.numpy()
    dense_n = dense_from(result)
    labels = np.array(result.labels, dtype=object)
    if by == "class":
        panels = [(f"{c}: {_heads(int((labels == c).sum()))}", labels == c) for c in CLASSES]
        panels.append((f"all {_heads(labels.size)}", np.ones(labels.shape, dtype=bool)))
        cols, size = 4, (15.0, 3.8)
    else:
        rows_of = np.arange(labels.shape[0])[:, None].repeat(labels.shape[1], axis=1)
        panels = [(f"layer {layer}", rows_of == li) for li, layer in enumerate(result.layers)]
        cols = min(6, len(panels))
        size = (2.3 * cols, 1.9 * -(-len(panels) // cols) + 0.8)
    rows = -(-len(panels) // cols)
    fig = PlotFigure(figsize=size, layout="constrained")
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False).flatten()
    for ax, (title, mask) in zip(axes, panels):
        if mask.any():
            _draw(ax, ns, _curves(result, mask, metric), title, dense_n, metric in _UNIT_RANGE)
        else:
            ax.set_title(title, fontsize=10)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    title, short = _METRIC_TITLES.get(metric, (metric, metric))
    for ax in axes[::cols]:
        ax.set_ylabel(f"{short} of N keys")
    for ax in axes[-cols:]:
        ax.set_xlabel("N (keys selected)")
    drawn = max(axes, key=lambda ax: len(ax.get_lines()))  # a class may have no heads
    handles, names = drawn.get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=max(1, min(len(names), 8)), fontsize=8.5)
    model = result.metadata.get("model_name")
    fig.suptitle(f"{title} against N, mean over the heads of each {by}"
                 + (f" ({model})" if model else ""))
    return fig


def sink_plot(result: HeadAnalysis) -> PlotFigure:
    """Sink value-norm ratio κ and signed cosine c_sink per layer (SPEC §4): every head as a
    dot, the layer mean as a line; κ on a log scale with κ = 1 marked, cosine with 0 marked."""
    layers = np.array(result.layers)
    fig = PlotFigure(figsize=(12, 3.6), layout="constrained")
    axes = fig.subplots(1, 3)
    series = [
        (result.sink_norm_ratio.numpy(), "sink value norm ÷ mean value norm (κ)", 1.0, True),
        (result.sink_cosine.numpy(), "cosine of the sink value with the others", 0.0, False),
        (result.sink_mass.numpy(), "attention on the sink (α_sink)", None, False),
    ]
    labels = np.array([[UNLABELLED_NAME if x is None else x for x in row] for row in result.labels], dtype=object)
    shown = [*CLASSES, UNLABELLED_NAME] if result.n_unlabelled else list(CLASSES)
    for ax, (values, title, ref, log) in zip(axes, series):
        for c in shown:
            li, h = np.nonzero(labels == c)
            ax.scatter(layers[li], values[li, h], s=9, alpha=0.6, color=CLASS_COLORS[c], label=c)
        with _quiet():
            ax.plot(layers, np.nanmean(values, axis=1), color="#1d2330", lw=1.8, label="layer mean")
        if ref is not None:
            ax.axhline(ref, color="#999", lw=0.8, ls="--")
        if log:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return fig


def class_counts_plot(result: HeadAnalysis) -> PlotFigure:
    """Stacked bars: number of Retriever / Mixer / Reset heads in each layer (SPEC §5);
    unlabelled heads (no votes) are in no bar."""
    counts = result.class_counts()
    fig = PlotFigure(figsize=(max(6.0, 0.28 * len(counts) + 2), 3.4), layout="constrained")
    ax = fig.subplots()
    bottom = np.zeros(len(counts))
    for c in CLASSES:
        ax.bar(counts.index, counts[c], bottom=bottom, color=CLASS_COLORS[c], label=c, width=0.8)
        bottom += counts[c].to_numpy()
    ax.set(xlabel="layer", ylabel="number of heads", title="Head classes per layer")
    ax.legend(fontsize=8, ncol=3)
    return fig


def ablation_plot(sparsification: Any) -> PlotFigure:
    """Next-token loss against head retention, one line per ordering (several seeds: the mean with
    a min–max band), from ``sparsification.csv`` (columns ordering, seed, retention, loss)."""
    need = {"ordering", "retention", "loss"}
    if missing := need - set(sparsification.columns):
        raise ValueError(f"sparsification table lacks columns {sorted(missing)}; expected {sorted(need)}.")
    fig = PlotFigure(figsize=(7, 4.2), layout="constrained")
    ax = fig.subplots()
    for ordering, part in sparsification.groupby("ordering", sort=True):
        stats = part.groupby("retention")["loss"].agg(["mean", "min", "max", "count"]).sort_index()
        x = stats.index.to_numpy()
        line = ax.plot(x, stats["mean"], marker="o", ms=3.5, label=str(ordering))[0]
        if (stats["count"] > 1).any():
            ax.fill_between(x, stats["min"], stats["max"], color=line.get_color(), alpha=0.2)
    ax.invert_xaxis()
    ax.set(xlabel="fraction of heads kept", ylabel="next-token loss", title="Structured sparsification")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def figure_and_axes(ax: Any, figsize: tuple[float, float]) -> tuple[Figure, Any]:
    """``ax``'s figure and ``ax``, or a new :class:`PlotFigure` with one axes."""
    if ax is not None:
        return ax.figure, ax
    fig = PlotFigure(figsize=figsize, layout="constrained")
    return fig, fig.subplots()


@overload
def sensitivity_plot(sensitivity: Any, ax: None = None) -> Figure: ...
@overload
def sensitivity_plot(sensitivity: Any, ax: Axes) -> Axes: ...
def sensitivity_plot(sensitivity: Any, ax: Any = None) -> Figure | Axes:
    """Heatmap of a :class:`~tl_geometry.ablation.HeadSensitivity`'s loss increase, layer ×
    head, its critical heads (SPEC §7) outlined: drawn into ``ax`` (returned), or a new
    :class:`PlotFigure`."""
    from matplotlib.patches import Rectangle

    given = ax
    fig, ax = figure_and_axes(ax, (6, 7))
    increase = sensitivity.loss_increase
    bound = float(abs(increase).nan_to_num().max()) or 1.0  # white = no effect
    image = ax.imshow(increase.numpy(), aspect="auto", cmap="RdBu_r", vmin=-bound, vmax=bound)
    for layer, head in sensitivity.critical():
        ax.add_patch(Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, ec="cyan", lw=1.5))
    ax.set(xlabel="head", ylabel="layer",
           title=f"Δ loss, one head {sensitivity.mode}-ablated (outlined: critical)")
    fig.colorbar(image, ax=ax, label="Δ loss (nats)")
    return fig if given is None else ax


@overload
def sparsification_plot(curve: Any, ax: None = None) -> Figure: ...
@overload
def sparsification_plot(curve: Any, ax: Axes) -> Axes: ...
def sparsification_plot(curve: Any, ax: Any = None) -> Figure | Axes:
    """Loss against retention of a :class:`~tl_geometry.ablation.SparsificationCurve`, one line
    per ordering (seeded ones: the mean with a ±std band), the unablated loss dotted: drawn
    into ``ax`` (returned), or a new :class:`PlotFigure`."""
    given = ax
    fig, ax = figure_and_axes(ax, (6.5, 4.5))
    table = curve.to_pandas()
    for name, group in table.groupby("ordering", sort=False):
        stats = group.groupby("retention")["loss"].agg(["mean", "std"]).sort_index()
        seeded = not group["seed"].isna().all()
        label = f"{name} (mean ± std, {group['seed'].nunique()} seeds)" if seeded else name
        line, = ax.plot(stats.index, stats["mean"], marker="o", label=label)
        if seeded:
            std = stats["std"].fillna(0.0)
            ax.fill_between(stats.index, stats["mean"] - std, stats["mean"] + std,
                            color=line.get_color(), alpha=0.2)
    ax.axhline(curve.base_loss, color="gray", ls=":", label="unablated")
    ax.set(xlabel="retention (fraction of heads kept)", ylabel="next-token loss (nats)",
           title=f"structured sparsification ({curve.mode} ablation)")
    ax.invert_xaxis()
    ax.legend(fontsize=8)
    return fig if given is None else ax

#: The resolution :func:`save_figure` writes PNGs at.
SAVE_DPI = 110


def save_figure(
    fig: Figure, stem: str | Path, formats: Sequence[str] = ("png", "svg"), *, dpi: int = SAVE_DPI
) -> list[Path]:
    """Write ``fig`` as ``stem.png`` and ``stem.svg`` (or ``formats``); return the paths."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = stem.with_name(f"{stem.name}.{fmt}")  # not with_suffix: "l5.h3" keeps its ".h3"
        fig.savefig(path, format=fmt, dpi=dpi)
        paths.append(path)
    return paths
