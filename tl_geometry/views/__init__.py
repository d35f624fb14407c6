"""Views of an analysis: offline HTML widgets (Jupyter and saved files) and matplotlib plots.

Token-level views read a cache (``hook_pattern`` and ``hook_v``; never modified)::

    from tl_geometry import views
    views.attention_view(cache, layer=5, heads=[0, 3], tokens=tokens, model=model, n=4)
    views.contribution_view(cache, 5, [0, 3], tokens=tokens, model=model)
    views.token_view(cache, 5, 3, tokens=tokens, model=model)

Head-level views read a :class:`~tl_geometry.HeadAnalysis`::

    views.taxonomy_view(result); views.sink_view(result)
    views.save_figure(views.f_curves_plot(result, by="class"), "f_by_class")   # PNG + SVG

Every view displays in a notebook and ``.save(path)`` writes a self-contained, offline page;
several views share one page with :func:`page_html`. Plots are :class:`PlotFigure` objects,
matplotlib figures that a notebook shows as images.
"""

from ._notebook import reset_notebook_bundle
from ._page import View, Widget, circuitsvis_bundle, page_html
from .attention import attention_view, contribution_view
from .plots import (
    PlotFigure,
    ablation_plot,
    class_counts_plot,
    f_curves_plot,
    save_figure,
    sink_plot,
)
from .sink import sink_view
from .taxonomy import CLASS_COLORS, class_color, taxonomy_view
from .tokens import token_view

__all__ = ["CLASS_COLORS", "PlotFigure", "View", "Widget", "ablation_plot", "attention_view",
           "circuitsvis_bundle", "class_color", "class_counts_plot", "contribution_view",
           "f_curves_plot", "page_html", "reset_notebook_bundle", "save_figure", "sink_plot",
           "sink_view", "taxonomy_view", "token_view"]
