"""Per-layer attention-sink diagnostics (SPEC §4) as heatmaps, layer × head, with layer means."""

from __future__ import annotations

import html
import math
from collections.abc import Callable

from jaxtyping import Float
from torch import Tensor

from ..result import HeadAnalysis
from ._page import View, color_mix, html_widget
from .taxonomy import head_tooltip

__all__ = ["sink_view"]

_BLUE, _ORANGE, _PURPLE = (49, 104, 168), (214, 120, 30), (120, 70, 160)


def _sequential(x: float, scale: float) -> str:
    return color_mix(x / scale, _BLUE)


def _diverging(x: float, scale: float, neg=_PURPLE, pos=_ORANGE) -> str:
    if not math.isfinite(x):
        return "#ddd"
    return color_mix(abs(x) / scale, neg if x < 0 else pos)


def _ink(background: str) -> str:
    """White text on dark cells, dark text elsewhere (perceived luminance of ``rgb(r,g,b)``)."""
    if not background.startswith("rgb("):
        return "#1d2330"
    r, g, b = (int(c) for c in background[4:-1].split(","))
    return "#fff" if 0.299 * r + 0.587 * g + 0.114 * b < 140 else "#1d2330"


def _log_ratio(x: float, _: float) -> str:
    # κ < 1 (a compressed sink, the paper's finding) purple, κ > 1 orange; saturates at 8× either way.
    # NaN κ (a head with no evaluable query) is grey, not "maximally compressed".
    if not math.isfinite(x):
        return "#ddd"
    return _diverging(math.log2(x) if x > 0 else -3.0, 3.0)


def _heatmap(result: HeadAnalysis, values: Float[Tensor, "layer head"], name: str,
             color: Callable[[float, float], str], scale: float) -> str:
    head_row = "".join(f"<th>{h}</th>" for h in range(result.n_heads))
    rows = [f"<tr><th>layer</th>{head_row}<th>mean</th></tr>"]
    for li, layer in enumerate(result.layers):
        cells = "".join(
            f'<td><div style="background:{(bg := color(float(v), scale))};color:{_ink(bg)}" '
            f'title="{html.escape(head_tooltip(result, li, h, None))}">{float(v):.2f}</div></td>'
            for h, v in enumerate(values[li].tolist())
        )
        mean = float(values[li].nanmean())
        rows.append(f"<tr><th>{layer}</th>{cells}<th>{mean:.3f}</th></tr>")
    return (f'<div style="display:inline-block;vertical-align:top;margin-right:22px">'
            f'<div class="tlg-caption"><b>{html.escape(name)}</b></div>'
            f'<table class="tlg-grid">{"".join(rows)}</table></div>')


def _scale(values: Tensor) -> float:
    finite = values[values.isfinite()]
    return float(finite.abs().max()) if finite.numel() and float(finite.abs().max()) > 0 else 1.0


def sink_view(result: HeadAnalysis) -> View:
    """Sink diagnostics of every head, one heatmap (layer × head, plus the layer mean) each:
    α_sink, κ = ‖v_sink‖ / mean_{j≠sink}‖v_j‖ (log colour scale around 1), the signed mean
    cosine c_sink and the sink's share of Σ α_j‖v_j‖ (SPEC §4); the caption's medians of κ and
    c_sink are over KV heads (their statistical unit).

    >>> sink_view(result).save("sink.html")  # doctest: +SKIP
    """
    if not isinstance(result, HeadAnalysis):
        raise TypeError(f"sink_view needs a HeadAnalysis (from analyze_heads), got {type(result).__name__}.")
    maps = [
        (result.sink_mass, "sink attention mass α_sink", _sequential, 1.0),
        (result.sink_norm_ratio, "norm ratio κ (purple < 1 < orange)", _log_ratio, 1.0),
        (result.sink_cosine, "signed cosine c_sink (purple < 0 < orange)", _diverging, _scale(result.sink_cosine)),
        (result.sink_share, "sink share of Σ α‖v‖", _sequential, 1.0),
    ]
    inner = "".join(_heatmap(result, v, name, color, scale) for v, name, color, scale in maps)
    # κ and c_sink read only the values: one measurement per KV head (SPEC §4, statistical unit),
    # however many query heads share it. Percentages are of the KV heads with a defined figure.
    kappa = result.kv_heads("sink_norm_ratio")
    cos = result.kv_heads("sink_cosine")
    kappa, cos = kappa[kappa.isfinite()], cos[cos.isfinite()]
    unit = "KV heads" if result.kv_group_size > 1 else "heads"
    kappa_text = (f"median κ {float(kappa.double().quantile(0.5)):.3f} "
                  f"({100 * float((kappa < 1).double().mean()):.0f}% of {unit} have a smaller sink "
                  "value norm)") if kappa.numel() else f"no {unit[:-1]} has a defined κ"
    cos_text = (f"median signed cosine {float(cos.double().quantile(0.5)):+.3f} "
                f"({100 * float((cos < 0).double().mean()):.0f}% negative)") if cos.numel() else (
                f"no {unit[:-1]} has a defined sink cosine")
    over = (f"the {result.n_layers * result.n_kv_heads} KV heads (κ and c_sink read only the values, "
            f"shared by {result.kv_group_size} query heads each)" if result.kv_group_size > 1
            else f"all {result.n_layers * result.n_heads} heads")
    summary = f'<div class="tlg-caption">Over {html.escape(over)}: {kappa_text}, {cos_text}.</div>'

    return View("Attention-sink diagnostics per layer", [summary, html_widget("SinkHeatmaps", inner)])
