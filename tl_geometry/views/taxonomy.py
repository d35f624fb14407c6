"""The head taxonomy as a layer × head grid coloured by class (SPEC §5), details on hover."""

from __future__ import annotations

import html
import math
from typing import Any

from ..functional.taxonomy import CLASSES, MIN_UNITS, TOO_FEW_UNITS, UNLABELLED_NAME, VOTES
from ..result import HeadAnalysis
from ..result.labels import check_scores, stability_note, stability_units
from ..result.text import CLASS_COLORS, CLASSES_TEXT, class_totals, label_text, unstable_counts
from ._page import View, html_widget

__all__ = ["CLASS_COLORS", "class_color", "taxonomy_view"]

_SHORT = {"Retriever": "Ret", "Mixer": "Mix", "Reset": "Rst", UNLABELLED_NAME: "—"}


def class_color(label: str | None) -> str:
    """Colour of a head's class; ``None`` (unlabelled) is grey."""
    return CLASS_COLORS[label_text(label)]


def _fmt(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.3f}"


def head_tooltip(result: HeadAnalysis, li: int, h: int, n: int | None, scores: Any = None) -> str:
    """Plain-text hover of one head: class, vote fractions, label margin and stability (SPEC §5),
    sink figures, F_N (and F*_N) of the top-N set against the value-shuffle null and the random
    baseline and, with ``scores`` (a :func:`tl_geometry.head_scores` table), the head scores."""
    fr = result.vote_fractions[li, h].tolist()
    unstable = " — UNSTABLE (< 0.8)" if bool(result.unstable[li, h]) else ""
    unit = stability_units(result)[li]  # SPEC §5: no stability from fewer than MIN_UNITS units
    stability = ("unknown" if unit is None else f"{TOO_FEW_UNITS} ({unit[1]} < {MIN_UNITS} {unit[0]}s)"
                 if unit[1] < MIN_UNITS else _fmt(float(result.label_stability[li, h]))
                 + ("" if unit[0] == "sequence" else f" (over {unit[1]} blocks of 128 queries)"))
    lines = [
        f"layer {result.layers[li]} head {h}: {label_text(result.labels[li][h])}",
        "votes " + " / ".join(f"{v} {_fmt(x)}" for v, x in zip(VOTES, fr)),
        f"label margin {_fmt(float(result.label_margin[li, h]))}, "
        f"stability {stability}{unstable}",
        f"sink: α {_fmt(float(result.sink_mass[li, h]))}, κ {_fmt(float(result.sink_norm_ratio[li, h]))}, "
        f"cos {_fmt(float(result.sink_cosine[li, h]))}, share {_fmt(float(result.sink_share[li, h]))}",
    ]
    if n is not None:
        i = result.n_values.tolist().index(n)
        lines.append(f"F score of {n} keys: top {_fmt(float(result.f_score[li, h, i]))} "
                     f"(F* {_fmt(float(result.f_score_cc[li, h, i]))}), "
                     f"shuffled {_fmt(float(result.shuffled_f_score[li, h, i]))}, "
                     f"random {_fmt(float(result.random_f_score[li, h, i]))}")
    if scores is not None:
        row = scores[(scores["layer"] == result.layers[li]) & (scores["head"] == h)]
        if len(row):
            lines.append("scores: " + ", ".join(f"{c} {_fmt(float(row[c].iloc[0]))}" for c in check_scores(scores)))
    return "\n".join(lines)


def taxonomy_view(result: HeadAnalysis, *, n: int = 2, scores: Any = None, classes_note: str | None = None) -> View:
    """Layer × head grid of Retriever / Mixer / Reset, with per-layer counts.

    Each cell is coloured by the head's class (SPEC §5), its opacity by the winning vote
    fraction; hovering shows :func:`head_tooltip` (``F_n`` where ``n`` was analysed; the head
    scores with ``scores``). An unstable head is marked "?" and outlined; an unlabelled one is
    grey ("—"), out of the shares. ``classes_note`` (HTML) replaces the caption's definitions
    of the classes, margin and stability.

    >>> view = taxonomy_view(result); view.save("taxonomy.html")  # doctest: +SKIP
    """
    if not isinstance(result, HeadAnalysis):
        raise TypeError(f"taxonomy_view needs a HeadAnalysis (from analyze_heads), got {type(result).__name__}.")
    shown_n = n if n in result.n_values.tolist() else None
    if scores is not None:
        check_scores(scores)
    unstable = result.unstable
    fractions = result.vote_fractions
    labels = result.labels
    unlabelled = result.n_unlabelled
    head_row = "".join(f"<th>{h}</th>" for h in range(result.n_heads))
    counted = " / ".join(CLASSES) + (f" / {UNLABELLED_NAME}" if unlabelled else "")
    rows = [f"<tr><th>layer</th>{head_row}<th>{counted}</th></tr>"]
    for li, layer in enumerate(result.layers):
        cells = []
        for h in range(result.n_heads):
            label = label_text(labels[li][h])
            strength = float(fractions[li, h].max())
            alpha = 0.35 + 0.65 * (strength if math.isfinite(strength) else 0.0)
            shaky = bool(unstable[li, h])
            outline = ";outline:2px dashed #222" if shaky else ""
            cells.append(
                f'<td><div style="background:{CLASS_COLORS[label]};opacity:{alpha:.2f}{outline}" '
                f'title="{html.escape(head_tooltip(result, li, h, shown_n, scores))}">'
                f'{_SHORT[label]}{"?" if shaky else ""}</div></td>'
            )
        counts = [labels[li].count(c) for c in CLASSES] + ([labels[li].count(None)] if unlabelled else [])
        rows.append(f"<tr><th>{layer}</th>{''.join(cells)}<th>{' / '.join(map(str, counts))}</th></tr>")
    # Shares are of the labelled heads only (SPEC §5); the unlabelled ones get a swatch and a count.
    total = class_totals(result)
    n_labelled = sum(total.values())
    legend = "".join(
        f'<span><i class="tlg-swatch" style="background:{CLASS_COLORS[c]}"></i>{c}: {total[c]}'
        + (f" ({100 * total[c] / n_labelled:.1f}%)" if n_labelled else "") + "</span>"
        for c in CLASSES
    )
    if unlabelled:
        legend += (f'<span><i class="tlg-swatch" style="background:{CLASS_COLORS[UNLABELLED_NAME]}"></i>'
                   f"{UNLABELLED_NAME}: {unlabelled} (no votes; not in the shares)</span>")
    per_class = unstable_counts(result)
    if sum(per_class.values()):
        legend += (f"<span>unstable (stability &lt; 0.8, marked ?): {sum(per_class.values())} — "
                   + ", ".join(f"{c} {k}" for c, k in per_class.items()) + "</span>")
    if (note := stability_note(result)) is not None:
        legend += f"<span>label stability {html.escape(note)}</span>"
    inner = f'<div class="tlg-legend">{legend}</div><table class="tlg-grid">{"".join(rows)}</table>'
    caption = (
        '<div class="tlg-caption">Source winner argmax α_j‖v_j‖ per query: Retriever = the current '
        "token wins most often, Mixer = the sink, Reset = other tokens (ties Retriever > Mixer > Reset). "
        "Opacity: the winning vote fraction. "
        + (html.escape(CLASSES_TEXT) if classes_note is None else classes_note) + " "
        + ("Grey (—): unlabelled, a head with no votes (no query after the sink), left out of the "
           "shares. " if unlabelled else "")
        + "Hover a cell for votes, margin, stability, sink figures, F_N"
        + (" and the head scores" if scores is not None else "") + ".</div>"
    )
    return View("Head taxonomy (layer × head)", [html_widget("TaxonomyGrid", inner), caption])
