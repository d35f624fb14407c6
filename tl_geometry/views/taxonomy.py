"""The head taxonomy as a layer × head grid coloured by class (SPEC §5), details on hover."""

from __future__ import annotations

import html
import math

from ..functional.taxonomy import CLASSES, VOTES
from ..result import HeadAnalysis
from ._page import View, html_widget

__all__ = ["CLASS_COLORS", "taxonomy_view"]

#: One colour per class, shared by the HTML views and the matplotlib plots.
CLASS_COLORS = {"Retriever": "#d1495b", "Mixer": "#3b6ea8", "Reset": "#e59f3a"}
_SHORT = {"Retriever": "Ret", "Mixer": "Mix", "Reset": "Rst"}


def _fmt(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.3f}"


def head_tooltip(result: HeadAnalysis, li: int, h: int, n: int | None) -> str:
    """Plain-text hover of one head: class, vote fractions, sink figures, F_N top vs random."""
    fr = result.vote_fractions[li, h].tolist()
    lines = [
        f"layer {result.layers[li]} head {h}: {result.labels[li][h]}",
        "votes " + " / ".join(f"{v} {_fmt(x)}" for v, x in zip(VOTES, fr)),
        f"sink: α {_fmt(float(result.sink_mass[li, h]))}, κ {_fmt(float(result.sink_norm_ratio[li, h]))}, "
        f"cos {_fmt(float(result.sink_cosine[li, h]))}, share {_fmt(float(result.sink_share[li, h]))}",
    ]
    if n is not None:
        i = result.n_values.tolist().index(n)
        lines.append(f"F score of {n} keys: top {_fmt(float(result.f_score[li, h, i]))}, "
                     f"random {_fmt(float(result.random_f_score[li, h, i]))}")
    return "\n".join(lines)


def taxonomy_view(result: HeadAnalysis, *, n: int = 2) -> View:
    """Layer × head grid of Retriever / Mixer / Reset, with per-layer counts.

    Each cell is coloured by the head's class (plurality of source-winner votes, SPEC §5), its
    opacity by the winning vote fraction; hovering shows the vote fractions (current / sink /
    other), the sink figures (α_sink, κ, signed cosine, share, SPEC §4) and ``F_n`` of the top-N
    set against the random baseline (``n`` defaults to 2, the first non-trivial N; skipped if
    ``n`` was not analysed).

    >>> view = taxonomy_view(result); view.save("taxonomy.html")  # doctest: +SKIP
    """
    if not isinstance(result, HeadAnalysis):
        raise TypeError(f"taxonomy_view needs a HeadAnalysis (from analyze_heads), got {type(result).__name__}.")
    shown_n = n if n in result.n_values.tolist() else None
    fractions = result.vote_fractions
    labels = result.labels
    head_row = "".join(f"<th>{h}</th>" for h in range(result.n_heads))
    rows = [f"<tr><th>layer</th>{head_row}<th>" + " / ".join(CLASSES) + "</th></tr>"]
    for li, layer in enumerate(result.layers):
        cells = []
        for h in range(result.n_heads):
            label = labels[li][h]
            strength = float(fractions[li, h].max())
            alpha = 0.35 + 0.65 * (strength if math.isfinite(strength) else 0.0)
            cells.append(
                f'<td><div style="background:{CLASS_COLORS[label]};opacity:{alpha:.2f}" '
                f'title="{html.escape(head_tooltip(result, li, h, shown_n))}">{_SHORT[label]}</div></td>'
            )
        counts = " / ".join(str(labels[li].count(c)) for c in CLASSES)
        rows.append(f"<tr><th>{layer}</th>{''.join(cells)}<th>{counts}</th></tr>")
    total = {c: sum(row.count(c) for row in labels) for c in CLASSES}
    n_all = sum(total.values())
    legend = "".join(
        f'<span><i class="tlg-swatch" style="background:{CLASS_COLORS[c]}"></i>{c}: {total[c]} '
        f"({100 * total[c] / n_all:.1f}%)</span>"
        for c in CLASSES
    )
    inner = f'<div class="tlg-legend">{legend}</div><table class="tlg-grid">{"".join(rows)}</table>'
    caption = (
        '<div class="tlg-caption">Source winner argmax α_j‖v_j‖ per query: Retriever = the current '
        "token wins most often, Mixer = the sink, Reset = other tokens (ties Retriever > Mixer > Reset). "
        "Opacity: the winning vote fraction. Hover a cell for votes, sink figures and F_N.</div>"
    )
    return View("Head taxonomy (layer × head)", [html_widget("TaxonomyGrid", inner), caption])
