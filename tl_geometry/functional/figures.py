"""Every per-head figure, defined once: its name, its axis, its SPEC section and its doc line.

:data:`FIGURES` is the table the rest of the package reads. The result's axis labels, the
shape checks and file format, the shortcuts' docstrings, the plots' [0, 1] axes and the kernels'
result slots (a figure's index on its axis) all derive from it; docs/where_things_go.md lists
the files that adding a figure touches.

>>> labels("sink_field")
('mass', 'norm_ratio', 'cosine', 'mean_cosine', 'share')
>>> slot("metric", "f_score"), figure("metric", "f_score").spec
(2, '§3')
"""

from __future__ import annotations

from typing import NamedTuple


class Figure(NamedTuple):
    """One figure: its label on ``axis`` (the result's axis name), where SPEC defines it, one doc
    line, the :class:`~tl_geometry.result.HeadAnalysis` shortcut that reads it (``None``: its
    accessor only), whether it lies in [0, 1] (``unit``), and ``since``: the result file format
    from which every file holds it (an earlier file is read with it NaN, without a warning)."""

    name: str
    axis: str
    spec: str
    doc: str
    shortcut: str | None = None
    unit: bool = False
    since: int = 1


#: The table, in storage order within each axis. Files are read by label, so an axis's order
#: is only the kernels' slots; SPEC §10's metrics stay last on theirs (the truncation figures
#: are read as one slice of it).
FIGURES: tuple[Figure, ...] = (
    # Separability of a key selection (SPEC §3), then its truncation (SPEC §10, ours).
    Figure("precision", "metric", "§3", "Top-N geometric precision P_N", "precision", unit=True),
    Figure("recall", "metric", "§3", "Top-N geometric recall R_N", "recall", unit=True),
    Figure("f_score", "metric", "§3", "Top-N F_N, the harmonic mean of P_N and R_N", "f_score", unit=True),
    Figure("margin", "metric", "§3", "Top-N margin γ_N = ρ_min − ρ_max", "margin"),
    Figure("inversions", "metric", "§3", "Top-N inversion count GInv_N", "inversions"),
    Figure("precision_cc", "metric", "§3",
           "Chance-corrected precision P*_N = (P_N − N/(t+1)) / (1 − N/(t+1)), ours", "precision_cc",
           unit=True),
    Figure("f_score_cc", "metric", "§3", "Chance-corrected F*_N: harmonic mean of P*_N and R_N, ours",
           "f_score_cc", unit=True),
    Figure("tail_mass", "metric", "§10", "Top-N tail mass τ_N = Σ_{j∉S_N} α_j, mean over instances",
           "tail_mass", unit=True, since=5),
    Figure("truncation_error", "metric", "§10",
           "Top-N relative output error ‖o − o_N‖/‖o‖ of the renormalised top-N, mean", "truncation_error",
           since=5),
    # The sink (SPEC §4).
    Figure("mass", "sink_field", "§4", "Mean attention on the sink", "sink_mass"),
    Figure("norm_ratio", "sink_field", "§4", "κ = ‖v_sink‖ / mean_{j≠sink} ‖v_j‖", "sink_norm_ratio"),
    Figure("cosine", "sink_field", "§4", "Mean signed cos(v_sink, v_j) over the other keys", "sink_cosine"),
    Figure("mean_cosine", "sink_field", "§4", "Signed cos(v_sink, mean_{j≠sink} v_j)", "sink_mean_cosine"),
    Figure("share", "sink_field", "§4", "The sink's share of Σ_j α_j‖v_j‖", "sink_share"),
    # The paired sink effect (SPEC §3, comparison 3; ours).
    Figure("ratio", "paired_field", "§3",
           "Per head, median F_N(with sink) / F_N(sink removed) over instances holding the sink",
           "paired_sink_ratio"),
    Figure("halved", "paired_field", "§3",
           "Per head, fraction of those instances where the sink halves F_N (ratio ≤ 1/2)",
           "paired_sink_halved"),
    Figure("count", "paired_field", "§3", "Per head, how many instances hold the sink in their top-N set"),
    # The means of a lower bound's figures (SPEC §6).
    Figure("precision", "bound_metric", "§6", "Mean lower bound on P_N"),
    Figure("recall", "bound_metric", "§6", "Mean lower bound on R_N"),
    Figure("f_score", "bound_metric", "§6", "Mean lower bound on F_N"),
    Figure("separated", "bound_metric", "§6",
           "Fraction of instances the bound certifies P_N = R_N = 1 (γ_N > 0; ours)"),
    # How well a head's values fit the sink-aware regime (SPEC §6c).
    Figure("norm_cv", "regime_field", "§6c", "Coefficient of variation of the non-sink value norms"),
    Figure("kappa", "regime_field", "§6c", "‖v_sink‖ / mean non-sink norm"),
    Figure("a", "regime_field", "§6c", "a of the fit cos(v_i, v_j) ≈ a·exp(−λ|i−j|) + b"),
    Figure("decay", "regime_field", "§6c", "λ of that fit over non-sink pairs"),
    Figure("b", "regime_field", "§6c", "b of that fit"),
    Figure("fit_mae", "regime_field", "§6c", "Mean absolute error of that fit over the pairs"),
    # The local sink of a sliding-window layer (SPEC §1's spirit; ours).
    Figure("position", "local_field", "§1", "The local sink's position"),
    Figure("mass", "local_field", "§1", "Its mean attention over the queries beyond the window"),
    Figure("coverage", "local_field", "§1", "The share of those queries that see it"),
    Figure("kappa", "local_field", "§1", "Its value norm over the mean norm of the other keys"),
    Figure("token", "local_field", "§1", "Its token id"),
)


def labels(axis: str) -> tuple[str, ...]:
    """The labels of ``axis`` in storage order, e.g. ``labels("metric")``."""
    found = tuple(f.name for f in FIGURES if f.axis == axis)
    if not found:
        raise KeyError(f"no figure has axis {axis!r}; axes: {', '.join(dict.fromkeys(f.axis for f in FIGURES))}.")
    return found


def figure(axis: str, name: str) -> Figure:
    """The row of ``name`` on ``axis``."""
    for f in FIGURES:
        if f.axis == axis and f.name == name:
            return f
    raise KeyError(f"no figure {name!r} on axis {axis!r}; valid: {', '.join(labels(axis))}.")


def added_since() -> dict[str, dict[str, int]]:
    """Per axis, the figures a result file format added after the first (``{axis: {name: since}}``)."""
    added: dict[str, dict[str, int]] = {}
    for f in FIGURES:
        if f.since > 1:
            added.setdefault(f.axis, {})[f.name] = f.since
    return added


def slot(axis: str, name: str) -> int:
    """Where ``name`` sits on ``axis`` (its index), e.g. the compiled kernels' result slot."""
    return labels(axis).index(figure(axis, name).name)
