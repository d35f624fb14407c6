"""Tokens coloured by their contribution ``α_j‖v_j‖`` to one head's output at one query."""

from __future__ import annotations

import html
from typing import Any

import torch

from ..functional.selection import top_n_ranks
from ._inputs import crop_note, prepare
from ._page import View, Widget

__all__ = ["token_view"]

SINK_MARK = "⟦sink⟧"


def token_view(
    cache: Any,
    layer: int,
    head: int,
    *,
    tokens: Any = None,
    model: Any = None,
    batch: int = 0,
    query: int = -1,
    n: int = 4,
    max_tokens: int = 128,
) -> View:
    """The keys of ``query`` coloured by ``‖y_j‖ = α_j‖v_j‖`` for one (layer, head), sink marked.

    circuitsvis's ``ColoredTokens``; the caption gives the source winner ``argmax_j α_j‖v_j‖``
    and its vote (SPEC §5), the sink's share of the total (SPEC §4) and the top-``n`` keys.
    Long rows keep the sink and the last ``max_tokens - 1`` positions, with a note.

    >>> token_view(cache, 5, 3, tokens=tokens, model=model, query=-1)  # doctest: +SKIP
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}.")
    rows, n_pos, q, kept, cropped, labels = prepare(cache, layer, head, tokens, model, batch, query, max_tokens)
    contrib = rows.contributions(q)[0]  # [key]; zero after q (causal)
    ranks = top_n_ranks(contrib, torch.arange(n_pos) <= q)  # ties → lower index, as the winner rule
    top_keys = ranks.argsort()[: min(n, q + 1)].tolist()  # ranks are a permutation: its inverse
    winner, sink = top_keys[0], kept[0]
    vote = "current" if winner == q else "sink" if winner == sink else "other"
    shown = [SINK_MARK + labels[sink]] + [labels[p] for p in kept[1:]]
    values = [float(contrib[p]) for p in kept]
    if cropped:
        shown.insert(1, f"⋯ {cropped} cropped ⋯")
        values.insert(1, 0.0)
    total = float(contrib.sum())
    listing = "; ".join(f"position {p}, {labels[p]!r}, {float(contrib[p]):.3f}" for p in top_keys)
    caption = (
        f'<div class="tlg-caption">Query position {q} ({html.escape(repr(labels[q]))}), sequence {batch}. '
        f"Source winner: position {winner} ({html.escape(repr(labels[winner]))}) — vote <b>{vote}</b>. "
        f"Sink: α {float(rows.pattern[0, q, sink]):.3f}, ‖v‖ {float(rows.norms[0, sink]):.3f} "
        f"(mean of the others {float(rows.norms[0, 1:q + 1].mean()) if q else float('nan'):.3f}), "
        f"share of Σα‖v‖ {float(contrib[sink]) / total if total else float('nan'):.3f}. "
        f"The {len(top_keys)} largest contributions: {html.escape(listing)}.</div>"
    )
    widget = Widget("ColoredTokens", {"tokens": shown, "values": values, "minValue": 0.0,
                                      "maxValue": max(values) or 1.0})
    return View(
        f"Contributions α‖v‖ to layer {layer}, head {head} at query {q}",
        [widget, caption],
        crop_note(cropped, kept, n_pos),
    )
