"""Plots of retrieval capacity (top-N attention sparsification; docs/capacity.md).

Each takes the table that the result's ``to_pandas()`` gives (the CSV that ``tl-geometry
capacity`` writes), so the report can draw them again from the files alone.
"""

from __future__ import annotations

from typing import Any, overload

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from .plots import PlotFigure, figure_and_axes

SCORE_LABELS = {"f_score": "measured F_N", "shell_k0": "shell certificate, K = 0",
                "shell_kn": "shell certificate, K = N", "tail_mass": "tail mass τ_N",
                "truncation_error": "relative error ‖o − o_N‖/‖o‖"}


@overload
def capacity_plot(table: Any, ax: None = None) -> Figure: ...
@overload
def capacity_plot(table: Any, ax: Axes) -> Axes: ...
def capacity_plot(table: Any, ax: Any = None) -> Figure | Axes:
    """Loss against N (log axis), one line per mode, the dense loss, its tolerance band and each
    mode's N*: drawn into ``ax`` (returned), or a new :class:`~tl_geometry.views.PlotFigure`.
    ``table`` is ``RetrievalCapacity.to_pandas()`` (``capacity.csv``)."""
    need = {"n", "mode", "loss", "dense_loss", "within_tolerance"}
    if missing := need - set(table.columns):
        raise ValueError(f"capacity table lacks columns {sorted(missing)}; expected {sorted(need)}.")
    given = ax  # the caller's axes are returned, not their figure: see views.plots
    fig, ax = figure_and_axes(ax, (6.5, 4.0))
    dense = float(table["dense_loss"].iloc[0])
    for mode, part in table.groupby("mode", sort=True):
        part = part.sort_values("n")
        line = ax.plot(part["n"], part["loss"], marker="o", ms=4, label=str(mode))[0]
        ok = part[part["within_tolerance"].astype(bool)]
        if len(ok):
            star = ok.iloc[0]
            ax.plot([star["n"]], [star["loss"]], marker="*", ms=13, color=line.get_color(),
                    label=f"N* = {int(star['n'])} ({mode})")
    ax.axhline(dense, color="gray", ls=":", label="dense")
    if "tolerance" in table:
        tol = float(table["tolerance"].iloc[0])
        ax.axhspan(dense, dense * (1 + tol), color="gray", alpha=0.15, label=f"within {tol:.0%}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="N (keys kept per query)", ylabel="next-token loss",
           title="Retrieval capacity: top-N attention")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig if given is None else ax


def capacity_sweep_plot(sweep: Any, n: int | None = None) -> Figure:
    """Heatmap of a :class:`~tl_geometry.capacity.sweep.CapacitySweep`'s loss increase:
    layer × head at ``N = n`` (default the smallest N) for a head sweep, layer × N for a layer
    sweep."""
    fig, ax = figure_and_axes(None, (6, 6.5))
    if sweep.by == "head":
        n = sweep.n_values[0] if n is None else n
        if n not in sweep.n_values:
            raise ValueError(f"N={n} was not swept; the sweep has N in {sweep.n_values}.")
        values = sweep.loss_increase[sweep.n_values.index(n)].numpy()
        xlabel, title = "head", f"Δ loss, one head at top-{n} ({sweep.mode})"
    else:
        values = sweep.loss_increase.T.numpy()
        xlabel, title = "N", f"Δ loss, one layer at top-N ({sweep.mode})"
    bound = float(np.nan_to_num(np.abs(values)).max()) or 1.0
    image = ax.imshow(values, aspect="auto", cmap="RdBu_r", vmin=-bound, vmax=bound)
    if sweep.by == "layer":
        ax.set_xticks(range(len(sweep.n_values)), [str(x) for x in sweep.n_values])
    ax.set(xlabel=xlabel, ylabel="layer", title=title)
    fig.colorbar(image, ax=ax, label="Δ loss (nats)")
    return fig


def correlation_plot(table: Any) -> Figure:
    """Per head, each predictor (measured F_N, shell certificates, tail mass, relative truncation
    error) against the loss increase of sparsifying that head alone; Spearman ρ in each title
    (predictors the table lacks, e.g. an older CSV, are left out). ``table`` is
    ``CapacityCorrelation.to_pandas()`` (``capacity_heads.csv``)."""
    import torch

    from ..functional.stats import spearman

    names = [name for name in SCORE_LABELS if name in table]
    fig = PlotFigure(figsize=(4 * len(names), 3.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(names), sharey=True))
    y = table["loss_increase"].to_numpy(dtype=float)
    for ax, name in zip(axes, names):
        x = table[name].to_numpy(dtype=float)
        rho = spearman(torch.tensor(x), torch.tensor(y))  # copies: pandas may hand out read-only arrays
        ax.scatter(x, y, s=10, alpha=0.6)
        ax.set(xlabel=SCORE_LABELS[name], title=f"ρ = {rho:.3f}")
        ax.grid(alpha=0.3)
    n = int(table["n"].iloc[0]) if len(table) else "?"
    axes[0].set_ylabel(f"Δ loss, head alone at top-{n}")
    return fig
