"""The ``window=`` option of both front doors: the sliding window of each analysed layer.

An explicit value is checked by :func:`tl_geometry.engine.options.layer_windows`; ``"auto"``
reads the model's config (:func:`tl_geometry.inputs.capture.model_windows`). Query ``t`` of a
layer with window ``w`` sees keys ``t − w < i ≤ t`` (SPEC §1, ours).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ..engine.options import check_window, layer_windows
from ..inputs.capture import text_config
from ..inputs.facts import model_facts
from ..warn import warn_caller

#: What ``window=`` accepts (``"auto"``: the model's config).
Window = int | Sequence[int | None] | Mapping[int, int | None] | Literal["auto"] | None
AUTO = "auto"


def check(window: object) -> None:
    """Validate ``window=`` before any tensor is read (its layers are checked by :func:`resolve`)."""
    if not (isinstance(window, str) and window == AUTO):
        if isinstance(window, str):
            raise ValueError(f"window must be 'auto' (the model's config), None, a positive int, a "
                             f"sequence per model layer or a dict {{layer: window}}, got {window!r}.")
        check_window(window)


def resolve(window: object, model: Any, layers: Sequence[int], *, need_model: bool = True) -> tuple[int | None, ...]:
    """The window of each of ``layers`` (``None``: global). ``"auto"`` reads ``model``'s config;
    without a model it is an error, or, with ``need_model=False`` (a cache from anywhere), every
    layer is global. A config that names sliding layers but gives no window warns."""
    check(window)
    if window == AUTO:
        if model is None:
            if not need_model:
                return layer_windows(None, layers)
            raise ValueError("window='auto' reads the sliding windows from the model's config: pass "
                             "model=..., or give the windows (an int, a list per layer or a dict "
                             "{layer: window}; None for global layers).")
        window = model_facts(model).windows
        if window is None and _names_sliding_layers(model):
            warn_caller("the model's config names sliding-window layers (layer_types) but gives no "
                          "sliding_window: every layer is read as global. Pass window= (an int, or "
                          "{layer: window}) if its local layers see fewer keys.")
    return layer_windows(window, layers)


def _names_sliding_layers(model: Any) -> bool:
    """Whether a Hugging Face config behind ``model`` lists a ``"sliding_attention"`` layer."""
    for holder in (getattr(model, "original_model", None), model):
        kinds = getattr(text_config(holder), "layer_types", None)
        if isinstance(kinds, (list, tuple)):
            return "sliding_attention" in kinds
    return False
