"""Text forms of a :class:`~tl_geometry.result.HeadAnalysis`: ``summary()`` and ``repr()``."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .functional.taxonomy import CLASSES

if TYPE_CHECKING:
    from .result import HeadAnalysis

LEGEND = (
    "Legend: cur/sink/oth = fractions of source-winner votes (the current token / the sink / "
    "another key wins; SPEC §5); α_sink = mean attention on the sink; κ = ‖v_sink‖ / mean "
    "‖v_j‖ over the other keys; cos = mean signed cos(v_sink, v_j); FN top/rnd = F_N of the "
    "top-N keys / of random N-subsets (1 = the selection is geometrically separated from the "
    "rest). How to read these: docs/reading.md."
)


def _model(meta: dict) -> str:
    name, klass = meta.get("model_name"), meta.get("model_class")
    if name:
        return f"model {name}"
    if klass:
        return f"a {klass} with no model_name"
    return "model unknown (pass model= to analyze_heads to record it)"


def _layers(layers: tuple[int, ...]) -> str:
    if len(layers) > 4 and list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}..{layers[-1]}"
    return ", ".join(map(str, layers))


def _nanmean(x: Tensor) -> float:
    return float(x.nanmean()) if torch.isfinite(x).any() else float("nan")


def _shown(result: HeadAnalysis, wanted: Sequence[int]) -> list[int]:
    analysed = result.n_values.tolist()
    shown = [n for n in wanted if n in analysed]
    return shown or [n for n in analysed if n >= 2][:3] or analysed[:3]


def summary(result: HeadAnalysis, n_values: Sequence[int], top: int | None) -> str:
    """See :meth:`HeadAnalysis.summary`."""
    meta = result.metadata
    shown = _shown(result, n_values)
    parts = [f"{meta['n_sequences']} sequences × {meta['n_positions']} positions"] \
        if "n_sequences" in meta and "n_positions" in meta else []
    parts += [f"{k}={meta[k]}" for k in ("queries", "distance", "space") if meta.get(k) is not None]
    lines = [
        f"tl_geometry head analysis — {_model(meta)}",
        f"layers {_layers(result.layers)} × {result.n_heads} heads "
        f"({result.n_layers * result.n_heads} heads); " + (", ".join(parts) or "run settings not recorded"),
    ]
    if meta.get("distance", "euclidean") == "euclidean":
        lines.append("N=1 is trivial for the Euclidean distance (F_1 = 1); the headline is N ≥ 2.")
    total = result.class_counts().sum()
    n_all = max(int(total.sum()), 1)
    lines += ["", "Classes: " + ", ".join(
        f"{c} {int(total[c])} ({100 * total[c] / n_all:.1f}%)" for c in CLASSES)]
    for n in shown:
        i = result._n_index(n)
        lines.append(
            f"  mean F_{n}: top-N {_nanmean(result.f_score[..., i]):.3f}  "
            f"random {_nanmean(result.random_f_score[..., i]):.3f}  "
            f"sink removed {_nanmean(result.sink_removed_f_score[..., i]):.3f}"
        )
    if result.bounds is not None:
        frac = result.certified_fraction
        lines.append("  heads certified (P̲ = R̲ = 1): " + ", ".join(
            f"N={n}: {100 * float(frac[result._n_index(n)]):.1f}%" for n in shown))
        lines.append("  shell certificate (SPEC §6d), mean F̲_N / mean F_N, K=0 | K=N: " + ", ".join(
            f"N={n}: {_ratio(result.shell_f_score, result.f_score, result._n_index(n))}"
            f" | {_ratio(result.shell_n_f_score, result.f_score, result._n_index(n))}" for n in shown))
        best = result.best_n()
        both = best.measured_best_n.notna() & best.shell_n_best_n.notna()
        lines.append(f"  best N over the headline range {list(result.headline_n)}: the shell (K=N) "
                     f"predicts the measured one for {_percent(result.best_n_agreement('shell_n'))} "
                     f"of the {int(both.sum())} heads where both are defined")

    n_heads = result.n_layers * result.n_heads
    rank_n = next((n for n in shown if n >= 2), shown[0])
    if top is None or top >= n_heads:
        order = list(range(n_heads))
        title = f"All {n_heads} heads, in layer order:"
    else:
        gain = result.f_gain[..., result._n_index(rank_n)].flatten()
        order = torch.nan_to_num(gain, nan=-torch.inf).argsort(descending=True, stable=True)[:top].tolist()
        title = (f"Top {len(order)} of {n_heads} heads by F_{rank_n} gain (top-N minus random); "
                 "summary(top=None) lists every head:")
    lines += ["", title, _header(shown)]
    f = {n: result.f_score[..., result._n_index(n)] for n in shown}
    r = {n: result.random_f_score[..., result._n_index(n)] for n in shown}
    fractions, labels = result.vote_fractions, result.labels
    for flat in order:
        li, h = divmod(flat, result.n_heads)
        votes = "/".join(f"{float(x):.2f}" for x in fractions[li, h])
        row = (f"{result.layers[li]:>5} {h:>4} {labels[li][h]:<9} {votes:>14} "
               f"{float(result.sink_mass[li, h]):>6.3f} {float(result.sink_norm_ratio[li, h]):>6.3f} "
               f"{float(result.sink_cosine[li, h]):>6.3f}")
        row += "".join(f" {float(f[n][li, h]):>6.3f}/{float(r[n][li, h]):<6.3f}" for n in shown)
        lines.append(row.rstrip())
    lines += ["", *textwrap.wrap(LEGEND, 100)]
    return "\n".join(lines)


def _ratio(bound: Tensor, measured: Tensor, i: int) -> str:
    b, m = _nanmean(bound[..., i]), _nanmean(measured[..., i])
    return f"{b / m:.2f}" if m > 0 else "n/a"


def _percent(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def _header(shown: list[int]) -> str:
    head = f"{'layer':>5} {'head':>4} {'class':<9} {'cur/sink/oth':>14} {'α_sink':>6} {'κ':>6} {'cos':>6}"
    return head + "".join(f" {'F' + str(n) + ' top/rnd':>13}" for n in shown)


def short_repr(result: HeadAnalysis) -> str:
    """``HeadAnalysis(model=..., layers=30 (0..29), heads=9, n_values=[...], classes, bounds)``."""
    total = result.class_counts().sum()
    classes = ", ".join(f"{c}={int(total[c])}" for c in CLASSES)
    name = result.metadata.get("model_name")
    model = f"model={name!r}, " if name else ""
    return (f"HeadAnalysis({model}layers={result.n_layers} ({_layers(result.layers)}), "
            f"heads={result.n_heads}, n_values={result.n_values.tolist()}, {classes}, "
            f"bounds={result.bounds is not None})")
