"""Offline HTML: views made of blocks, pages that load circuitsvis's JavaScript once.

A page inlines the installed circuitsvis bundle (``circuitsvis/dist/cdn/iife.js``) exactly once,
rather than per widget or from a CDN, and every widget gets a unique, properly closed
``<div class="tlg-widget" id=...></div>`` (the class the browser test counts) and a one-line
script calling ``CircuitsVis.render``. Nothing refers to a network address. In a notebook only
the first widget output carries the script (:mod:`._notebook`).
"""

from __future__ import annotations

import html
import json
import math
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Any

from . import _notebook

__all__ = ["View", "Widget", "circuitsvis_bundle", "html_widget", "page_html"]

WIDGET_CLASS = "tlg-widget"

_CSS = """
.tlg-page { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2330;
  max-width: 1300px; margin: 0 auto; padding: 8px 20px 40px; }
.tlg-view { margin: 18px 0 26px; }
.tlg-view > h3 { margin: 0 0 4px; font-size: 16px; }
.tlg-note { color: #6a5d00; background: #fff8d6; border-left: 3px solid #e0c200; padding: 3px 8px;
  margin: 4px 0 8px; font-size: 12.5px; }
.tlg-caption { color: #4a5263; font-size: 12.5px; margin: 2px 0 6px; }
.tlg-widget { margin: 6px 0 10px; }
.tlg-tok { display: inline-block; padding: 1px 3px; margin: 1px 1px; border-radius: 3px;
  border: 1px solid transparent; font-family: ui-monospace, Menlo, Consolas, monospace;
  font-size: 12px; white-space: pre; }
.tlg-tok.top { border: 2px solid #d62728; }
.tlg-tok.query { text-decoration: underline 2px; font-weight: 600; }
.tlg-tok.sink { box-shadow: inset 0 -3px 0 #6b3fa0; }
.tlg-tok.gap { color: #888; background: #eee; }
.tlg-tok sup { color: #d62728; font-size: 9px; margin-left: 1px; }
.tlg-strip-label { display: inline-block; min-width: 70px; font-weight: 600; font-size: 12px; }
.tlg-legend span { display: inline-block; margin-right: 14px; font-size: 12.5px; }
.tlg-swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px;
  vertical-align: -1px; margin-right: 4px; }
.tlg-grid { border-collapse: collapse; font-size: 11px; }
.tlg-grid td, .tlg-grid th { padding: 0; text-align: center; }
.tlg-grid th { font-weight: 500; color: #4a5263; padding: 0 4px; }
.tlg-grid td div { width: 30px; height: 18px; line-height: 18px; margin: 1px; border-radius: 2px;
  color: #fff; cursor: default; }
.tlg-table { border-collapse: collapse; font-size: 12.5px; margin: 6px 0; }
.tlg-table td, .tlg-table th { border-bottom: 1px solid #e3e6ec; padding: 3px 9px; text-align: right; }
.tlg-table th { background: #f3f5f9; }
.tlg-figure img { max-width: 100%; border: 1px solid #e3e6ec; }
"""


@lru_cache(maxsize=1)
def circuitsvis_bundle() -> str:
    """The JavaScript of the installed circuitsvis package, safe to inline in a ``<script>``:
    without its source-map comment (a network fetch), ``</script`` written ``<\\/script``.

    >>> "CircuitsVis" in circuitsvis_bundle()
    True
    """
    path = files("circuitsvis").joinpath("dist/cdn/iife.js")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as err:  # pragma: no cover - a broken circuitsvis install
        raise RuntimeError(
            f"circuitsvis's JavaScript bundle {path} is missing; reinstall circuitsvis "
            "(pip install --force-reinstall circuitsvis)."
        ) from err
    lines = [ln for ln in text.splitlines() if not ln.startswith("//# sourceMappingURL=")]
    return "\n".join(lines).replace("</script", "<\\/script")


def _json(value: Any) -> str:
    """JSON for a ``<script>``: NaN/inf become null, and every ``<`` is written ``\\u003c`` (not
    only ``</``: ``<!--<script>`` would put the HTML parser in the "double-escaped" state)."""
    return json.dumps(_finite(value), ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


@dataclass(frozen=True)
class Widget:
    """A circuitsvis React component (``"AttentionHeads"``, ``"ColoredTokens"``, ...) and its
    props (JSON-able: lists, numbers, strings), rendered into its own ``tlg-widget`` div."""

    component: str
    props: dict[str, Any]

    def render(self, *, deferred: bool = False) -> str:
        """The widget's root and its script; ``deferred`` (notebooks): the call waits for the
        bundle, and the root holds a plain-text note until circuitsvis draws it."""
        wid = "tlg-" + uuid.uuid4().hex[:12]  # a valid CSS id: circuitsvis looks it up by #id
        call = f'CircuitsVis.render("{wid}", CircuitsVis.{self.component}, {_json(self.props)});'
        waiting = html.escape(_notebook.WAITING) if deferred else ""
        script = _notebook.deferred_call(call) if deferred else call
        return (
            f'<div class="{WIDGET_CLASS} tlg-cv" id="{wid}" data-component="{self.component}">'
            f"{waiting}</div><script>{script}</script>"
        )


def html_widget(kind: str, inner: str) -> str:
    """Our own (bundle-free) widget: ``inner`` HTML inside a ``tlg-widget`` root."""
    return f'<div class="{WIDGET_CLASS}" data-component="{html.escape(kind)}">{inner}</div>'


@dataclass
class View:
    """One visualisation: a title, optional notes (cropping etc.) and HTML / widget blocks.
    Displays in Jupyter, offline, and saves as a self-contained HTML file::

        view = tl_geometry.views.taxonomy_view(result)
        view                      # in a notebook
        view.save("taxonomy.html")
    """

    title: str
    blocks: list[str | Widget] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def needs_bundle(self) -> bool:
        return any(isinstance(b, Widget) for b in self.blocks)

    @property
    def n_widgets(self) -> int:
        """Widget roots this view renders (circuitsvis and ours)."""
        return sum(isinstance(b, Widget) or WIDGET_CLASS in b for b in self.blocks)

    def fragment(self, *, deferred: bool = False) -> str:
        """This view's HTML without the bundle; ``deferred``: see :meth:`Widget.render`."""
        notes = "".join(f'<div class="tlg-note">{html.escape(n)}</div>' for n in self.notes)
        body = "".join(b.render(deferred=deferred) if isinstance(b, Widget) else b for b in self.blocks)
        return f'<section class="tlg-view"><h3>{html.escape(self.title)}</h3>{notes}{body}</section>'

    def __repr__(self) -> str:
        # Short: Jupyter stores text/plain beside the HTML, and the default dataclass repr
        # would copy every widget's data into the notebook a second time.
        kinds = [b.component if isinstance(b, Widget) else "html" for b in self.blocks]
        return f"View({self.title!r}, blocks={kinds})"

    def _repr_html_(self) -> str:
        deferred = self.needs_bundle and _notebook.in_notebook()
        bundle = ""
        if self.needs_bundle and _notebook.bundle_in_this_output():
            script = circuitsvis_bundle()
            bundle = f"<script>{_notebook.bundle_loader(script) if deferred else script}</script>"
        body = self.fragment(deferred=deferred)
        return f'<div class="tlg-page"><style>{_CSS}</style>{bundle}{body}</div>'

    def to_html(self) -> str:
        """A complete, self-contained HTML document of this view."""
        return page_html([self], title=self.title)

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_html` to ``path`` and return it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_html(), encoding="utf-8")
        return path


def page_html(parts: Iterable[View | str], *, title: str = "tl_geometry", header: str = "") -> str:
    """A self-contained HTML document of views and raw HTML parts; the bundle goes into
    ``<head>``, once, when some view has a circuitsvis widget."""
    parts = list(parts)
    needs = any(isinstance(p, View) and p.needs_bundle for p in parts)
    bundle = f"<script>{circuitsvis_bundle()}</script>" if needs else ""
    body = "".join(p.fragment() if isinstance(p, View) else p for p in parts)
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style>{bundle}</head>"
        f'<body><main class="tlg-page">{header}{body}</main></body></html>'
    )


def color_mix(weight: float, rgb: Sequence[int] = (31, 119, 180)) -> str:
    """CSS colour between white (0) and ``rgb`` (1), for α / contribution shading."""
    w = 0.0 if not math.isfinite(weight) else min(max(weight, 0.0), 1.0)
    r, g, b = (round(255 + (c - 255) * w) for c in rgb)
    return f"rgb({r},{g},{b})"
