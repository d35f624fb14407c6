"""The ``sink=`` option of the front doors: which key of each window is the sink (SPEC §1).

* an int ``p`` (every window) or one int per window: the sink is the window's ``p``-th real
  token (counted from its first real token, so left padding does not move it); keys before it
  are ordinary keys;
* ``"auto"``: per window, the most attended of its first 32 real tokens
  (:func:`tl_geometry.engine.sink_choice.choose_sink`), read in a first pass;
* ``None`` (default): ``0`` where the window starts with BOS, which the front doors prepend only
  where the model was trained with one, and ``"auto"`` where the model is known to have been
  trained without (Qwen2/2.5). Without a model, or where nothing says how it was trained, ``0``
  (ours: the first position, the sink of every model trained with BOS); the sink check then
  warns where another key takes more attention.

The chosen positions, the rule and the sink check are recorded in ``metadata["sink"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from ..engine.sink_choice import CANDIDATES, CHECK_QUERIES, sink_check
from ..functional.heads import last_positions, sink_positions
from ..inputs.models import stated_bos
from ..warn import warn_caller

#: What ``sink=`` accepts.
Sink = int | Sequence[int] | Tensor | Literal["auto"] | None
AUTO = "auto"
_HOW = ("sink must be None (the default rule), 'auto' (the most attended of the first 32 tokens), "
        "a position ≥ 0 counted from the window's first real token, or one such position per window")


def check(sink: object) -> None:
    """Validate ``sink=`` before any tensor is read (the positions against the windows: :func:`positions`)."""
    if sink is None or (isinstance(sink, str) and sink == AUTO):
        return
    if isinstance(sink, (str, bool)):
        raise ValueError(f"{_HOW}; got {sink!r}.")
    if isinstance(sink, int):
        values = [sink]
    elif isinstance(sink, Tensor):
        if sink.is_floating_point() or sink.dtype == torch.bool or sink.ndim > 1:
            raise ValueError(f"{_HOW}; got a {sink.dtype} tensor of shape {list(sink.shape)}.")
        values = sink.reshape(-1).tolist()
    elif isinstance(sink, Sequence) and not isinstance(sink, (bytes, bytearray)):
        if any(isinstance(x, bool) or not isinstance(x, int) for x in sink):
            raise ValueError(f"{_HOW}; got {list(sink)!r}.")
        values = list(sink)
    else:
        raise ValueError(f"{_HOW}; got a {type(sink).__name__}.")
    if any(x < 0 for x in values):
        raise ValueError(f"{_HOW}; got negative positions {[x for x in values if x < 0][:8]}.")


def rule(sink: Sink, model: Any, *, bos_prepended: bool | None = None) -> str | list[int]:
    """``"auto"``, or the positions given (one int for every window, or one per window), with
    ``None`` resolved as the module docstring says. ``bos_prepended``: whether the front door put
    BOS first itself (texts), else ``None`` (the caller's tokens)."""
    check(sink)
    if sink is None:
        trained = bos_prepended if bos_prepended is not None else (
            None if model is None else stated_bos(model))
        return AUTO if trained is False else [0]
    if isinstance(sink, str):
        return AUTO
    if isinstance(sink, int):
        return [sink]
    return [int(x) for x in (sink.reshape(-1).tolist() if isinstance(sink, Tensor) else sink)]


def positions(given: str | list[int], is_token: Bool[Tensor, "batch pos"], offset: int = 0,
              n_windows: int | None = None) -> Int[Tensor, " batch"]:
    """Absolute sink positions of the windows ``offset …`` of a batch from the positions
    ``given`` (one for all, or one per window of the whole input: ``n_windows``)."""
    batch = is_token.shape[0]
    if isinstance(given, str):
        raise ValueError("sink='auto' is chosen from the attention, not given: read it with choose_sink.")
    if len(given) == 1:
        chosen = torch.full((batch,), given[0], dtype=torch.long)
    else:
        if n_windows is not None and len(given) != n_windows:
            raise ValueError(f"sink gives {len(given)} positions for {n_windows} windows: give one "
                             "position per window, or one int for all.")
        chosen = torch.tensor(given[offset:offset + batch], dtype=torch.long)
    chosen = chosen.to(is_token.device)
    start, last = sink_positions(is_token), last_positions(is_token)
    beyond = chosen > last - start
    if bool(beyond.any()):
        b = int(beyond.nonzero()[0])
        raise ValueError(f"sink position {int(chosen[b])} is past the end of window {offset + b} "
                         f"({int(last[b] - start[b]) + 1} real tokens): positions count from the "
                         "window's first real token; pass a smaller one or sink='auto'.")
    return start + chosen


def record(chosen: str | list[int], relative: Sequence[int], masses: Sequence[Tensor],
           model: Any) -> dict[str, Any]:
    """``metadata["sink"]``: the rule, the positions (from each window's first real token), what
    the model's files say of BOS, and the sink check (:func:`~tl_geometry.engine.sink_choice.sink_check`),
    with a "weak sink" warning where the check finds one."""
    check_result = sink_check(masses, torch.as_tensor(list(relative), dtype=torch.long)) if masses else {}
    entry = {"rule": AUTO if chosen == AUTO else "given", "positions": [int(x) for x in relative],
             "trained_with_bos": None if model is None else stated_bos(model),
             "candidates": CANDIDATES,
             "check_queries": "32 ≤ t < min(T, w)" if chosen == AUTO else f"32 ≤ t < min(T, w, {32 + CHECK_QUERIES})",
             **check_result}
    if check_result.get("weak"):
        fix = ("pass sink='auto' (the most attended of the first 32 tokens)" if chosen != AUTO
               else "the model may have no sink: read its sink figures with care")
        warn_caller(f"weak sink: the sink (position {_describe(relative)}) is not the most attended of the "
                    f"first {CANDIDATES} tokens in most layers (mean mass per layer "
                    f"{_fmt(check_result['sink_mass'])} against {_fmt(check_result['other_mass'])} for the "
                    f"most attended other key); {fix}. metadata['sink'] holds the check.")
    return entry


def _describe(relative: Sequence[int]) -> str:
    values = sorted({int(x) for x in relative})
    return str(values[0]) if len(values) == 1 else f"{values[:4]}{'…' if len(values) > 4 else ''}"


def _fmt(values: Sequence[float | None]) -> str:
    shown = [f"{v:.2f}" if v is not None else "–" for v in values[:6]]
    return "[" + ", ".join(shown) + (", …]" if len(values) > 6 else "]")
