"""Attention patterns of chosen heads: the raw pattern with a query's top-N keys highlighted,
and the contribution-weighted pattern ``α_j‖v_j‖`` (normalised per query) beside it."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..functional.selection import top_n_ranks
from ._inputs import crop_note, heads_phrase, prepare
from ._page import View, Widget, color_mix, html_widget

__all__ = ["attention_view", "contribution_view"]

GAP = "⋯"


def _crop(mats: Float[Tensor, "m query key"], kept: list[int], cropped: int) -> Tensor:
    """``mats`` restricted to the kept positions; a zero row/column stands for the cropped gap."""
    index = torch.tensor(kept)
    out = mats[:, index][:, :, index]
    if cropped:
        out = torch.cat([out[:, :1], torch.zeros_like(out[:, :1]), out[:, 1:]], dim=1)
        out = torch.cat([out[:, :, :1], torch.zeros_like(out[:, :, :1]), out[:, :, 1:]], dim=2)
    return out


def _labels(labels: list[str], kept: list[int], cropped: int) -> list[str]:
    """Row and column labels of the pattern widget. circuitsvis writes each as "label (row)",
    whitespace removed: without a crop the row is the position; after one, each label starts
    with the position in the sequence, ``"120:token"``, and the gap row names the cropped span."""
    if not cropped:
        return [labels[i] for i in kept]
    shown = [f"{pos}:{labels[pos]}" for pos in kept]
    return [shown[0], f"{kept[0] + 1}–{kept[1] - 1}:cropped", *shown[1:]]


def _crop_note(cropped: int, kept: list[int], n_pos: int) -> list[str]:
    """The crop note of a view with a pattern widget: how its rows and columns are labelled."""
    return [note + " In the attention pattern, rows and columns are labelled position:token "
            "(the number in brackets counts the rows shown)." for note in crop_note(cropped, kept, n_pos)]


def _patterns_widget(mats: Tensor, names: list[str], labels: list[str], kept: list[int], cropped: int) -> Widget:
    return Widget("AttentionHeads", {
        "attention": _crop(mats, kept, cropped).round(decimals=5).tolist(),  # 5 digits: a smaller page
        "tokens": _labels(labels, kept, cropped),
        "attentionHeadNames": names,
        "maskUpperTri": True,
    })


def _token_strip(label: str, labels: list[str], weights: Tensor, ranks: Tensor, n: int,
                 kept: list[int], cropped: int, query: int) -> str:
    """One row of tokens shaded by ``weights`` (scaled to the row's max), top-N outlined."""
    top = float(weights.max()) or 1.0
    spans = []
    for pos in kept:
        classes = ["tlg-tok"]
        rank = int(ranks[pos])
        if rank < n:
            classes.append("top")
        if pos == query:
            classes.append("query")
        if pos == kept[0]:
            classes.append("sink")
        w = float(weights[pos])
        sup = f"<sup>{rank + 1}</sup>" if rank < n else ""
        spans.append(
            f'<span class="{" ".join(classes)}" style="background:{color_mix(w / top)}" '
            f'title="position {pos}, weight {w:.4f}, rank {rank + 1}">{html.escape(labels[pos])}{sup}</span>'
        )
        if cropped and pos == kept[0]:
            spans.append(f'<span class="tlg-tok gap" title="{cropped} positions cropped">'
                         f"{GAP} {cropped} cropped {GAP}</span>")
    return f'<div><span class="tlg-strip-label">{html.escape(label)}</span>{"".join(spans)}</div>'


def _outside(ranks: Tensor, n: int, kept: list[int], labels: list[str], weights: Tensor) -> str:
    shown = set(kept)
    missing = [p for p in (ranks < n).nonzero().flatten().tolist() if p not in shown]
    if not missing:
        return ""
    items = "; ".join(f"rank {int(ranks[p]) + 1}: position {p}, {labels[p]!r}, weight {float(weights[p]):.3f}"
                      for p in missing)
    return f'<div class="tlg-caption">Top keys outside the shown window: {html.escape(items)}</div>'


def attention_view(
    cache: Any,
    layer: int,
    heads: int | Sequence[int] | None = None,
    *,
    tokens: Any = None,
    model: Any = None,
    batch: int = 0,
    query: int = -1,
    n: int = 4,
    max_tokens: int = 64,
) -> View:
    """Attention patterns of ``heads`` of ``layer`` with the top-``n`` keys of ``query`` highlighted.

    circuitsvis's ``AttentionHeads`` widget of sequence ``batch`` and, per head, the tokens up to
    ``query`` shaded by ``α_j``, the top-N set ``S_N`` (SPEC §2) outlined and ranked. Longer than
    ``max_tokens``: the sink and the last positions, with a note. ``tokens``: str tokens or ids.

    >>> view = attention_view(cache, 5, [0, 3], tokens=tokens, model=model, n=4)  # doctest: +SKIP
    >>> view.save("l5.html")                                                      # doctest: +SKIP
    """
    rows, n_pos, q, kept, cropped, labels = prepare(cache, layer, heads, tokens, model, batch, query, max_tokens)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= q + 1:
        raise ValueError(f"n must be in 1..{q + 1} (the keys query {q} can attend to), got {n!r}.")
    alpha = rows.pattern[:, q, :]  # [head, key]; keys after q are exact zeros (causal)
    key_mask = torch.arange(n_pos) <= q
    ranks = top_n_ranks(alpha, key_mask)
    names = [f"head {h}" for h in rows.heads]
    strips = "".join(
        _token_strip(name, labels, alpha[i], ranks[i], n, kept, cropped, q)
        + _outside(ranks[i], n, kept, labels, alpha[i])
        for i, name in enumerate(names)
    )
    caption = (
        f'<div class="tlg-caption">Query position {q} ({html.escape(repr(labels[q]))}), sequence {batch}: '
        f"keys shaded by attention α, the {n} keys with the most attention outlined in red with "
        "their rank; the sink is underlined in purple, the query underlined.</div>"
    )
    return View(
        f"Attention of layer {layer}, {heads_phrase(rows.heads)}: the top {n} keys of query {q}",
        [_patterns_widget(rows.pattern, names, labels, kept, cropped), caption, html_widget("TopKeys", strips)],
        _crop_note(cropped, kept, n_pos),
    )


def contribution_view(
    cache: Any,
    layer: int,
    heads: int | Sequence[int] | None = None,
    *,
    tokens: Any = None,
    model: Any = None,
    batch: int = 0,
    query: int = -1,
    max_tokens: int = 64,
) -> View:
    """The contribution-weighted pattern beside the raw one, for each of ``heads``.

    For every query ``t`` and key ``j ≤ t``: ``c_tj = α_tj ‖v_j‖ / Σ_{k≤t} α_tk ‖v_k‖`` — the
    share of ``‖y_j‖ = α_j‖v_j‖`` (SPEC §1, ``v`` of the KV head the query head reads) in the
    query's total: a sink with a small value norm (κ < 1, SPEC §4) fades from the raw panel to
    the weighted one. Rows end at ``query``, cropped like :func:`attention_view`.

    >>> contribution_view(cache, 5, [0, 3], tokens=tokens, model=model)  # doctest: +SKIP
    """
    rows, n_pos, q, kept, cropped, labels = prepare(cache, layer, heads, tokens, model, batch, query, max_tokens)
    contrib = rows.pattern * rows.norms[:, None, :]
    contrib = contrib / contrib.sum(-1, keepdim=True).clamp_min(torch.finfo(contrib.dtype).tiny)
    mats = torch.stack([rows.pattern, contrib], dim=1).flatten(0, 1)  # raw, weighted, raw, ...
    names = [f"head {h} {kind}" for h in rows.heads for kind in ("attention α", "contribution α‖v‖")]
    sink = kept[0]
    shares = "; ".join(
        f"head {h}: α_sink {float(rows.pattern[i, q, sink]):.3f} → contribution share "
        f"{float(contrib[i, q, sink]):.3f}"
        for i, h in enumerate(rows.heads)
    )
    caption = (
        '<div class="tlg-caption">Raw attention α next to the contribution-weighted pattern '
        "α_j‖v_j‖ / Σ_k α_k‖v_k‖ (per query). At query "
        f"{q}: {html.escape(shares)}.</div>"
    )
    return View(
        f"Contribution-weighted attention of layer {layer}, {heads_phrase(rows.heads)}",
        [_patterns_widget(mats, names, labels, kept, cropped), caption],
        _crop_note(cropped, kept, n_pos),
    )
