"""The ``sink=`` option of the front doors: which key of each window is the sink (SPEC §1).

* an int ``p`` (every window) or one int per window: the window's ``p``-th real token;
* ``"auto"``: per window, the most attended of its first 32 real tokens
  (:func:`tl_geometry.engine.sink_choice.choose_sink`) over every layer of the model, whatever
  ``layers=`` analyses (:func:`choice_layers`);
* ``None`` (default): ``0`` where the window starts with BOS, ``"auto"`` where the model is
  known to have been trained without (Qwen2/2.5), else ``0``.

Every front door checks ``sink=`` and its positions here before its first forward; the rule,
the positions, the layers read and the sink check are recorded in ``metadata["sink"]``.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from ..engine.block import AttentionRows
from ..engine.sink_choice import CANDIDATES, CHECK_QUERIES, choose_sink, first_keys_mass, sink_check
from ..functional.heads import last_positions, sink_positions
from ..inputs.cache import first_few
from ..inputs.facts import model_facts
from ..warn import warn_caller
from . import windows as _windows

#: What ``sink=`` accepts.
Sink = int | Sequence[int] | Tensor | Literal["auto"] | None
AUTO = "auto"
_HOW = ("sink must be None (the default rule), 'auto' (the most attended of the first 32 tokens), "
        "a position ≥ 0 counted from the window's first real token, or one such position per window")
#: The largest position ``sink=`` may name before the windows are known: far past any context.
MAX_POSITION = 2**62


def check(sink: object) -> str | list[int] | None:
    """``sink=`` as ``None``, ``"auto"`` or its positions, its type, sign and size checked before
    any tensor is read (the positions against the windows: :func:`positions`); ``ValueError``
    naming the problem and the fix."""
    if sink is None:
        return None
    if isinstance(sink, str) and sink == AUTO:
        return AUTO
    if isinstance(sink, (str, bool, np.bool_)):
        raise ValueError(f"{_HOW}; got {sink!r}.")
    if isinstance(sink, numbers.Integral):
        values = [int(sink)]
    elif isinstance(sink, (Tensor, np.ndarray)):
        kind = "tensor" if isinstance(sink, Tensor) else "array"
        if isinstance(sink, Tensor) and sink.is_meta:
            raise ValueError(f"sink is a meta tensor (shape {list(sink.shape)}, no values): {_HOW}, "
                             "e.g. sink=0 or sink='auto'.")
        integer = (not sink.is_floating_point() and not sink.is_complex() and sink.dtype != torch.bool
                   if isinstance(sink, Tensor) else bool(np.issubdtype(sink.dtype, np.integer)))
        if not integer or sink.ndim > 1:
            raise ValueError(f"{_HOW}; got a {sink.dtype} {kind} of shape {list(sink.shape)}.")
        values = [int(x) for x in sink.reshape(-1).tolist()]
    elif isinstance(sink, Sequence) and not isinstance(sink, (bytes, bytearray)):
        if any(isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral) for x in sink):
            raise ValueError(f"{_HOW}; got {list(sink)[:8]!r}.")
        values = [int(x) for x in sink]
    else:
        raise ValueError(f"{_HOW}; got a {type(sink).__name__}.")
    if not values:
        raise ValueError(f"{_HOW}; got no position.")
    if any(x < 0 for x in values):
        raise ValueError(f"{_HOW}; got negative positions {[x for x in values if x < 0][:8]}.")
    # No window reaches such a position; refused here, where it would otherwise overflow the
    # int64 positions (a raw RuntimeError) before the windows are read.
    huge = [x for x in values if x > MAX_POSITION]
    if huge:
        raise ValueError(f"sink position {huge[0]} is past the end of any window (positions count from "
                         "the window's first real token); pass a position below the windows' length, "
                         "or sink='auto'.")
    return values


def rule(sink: Sink, model: Any, *, bos_prepended: bool | None = None) -> str | list[int]:
    """``"auto"``, or the positions given (one int for every window, or one per window), with
    ``None`` resolved as the module docstring says. ``bos_prepended``: whether the front door put
    BOS first itself (texts), else ``None`` (the caller's tokens)."""
    given = check(sink)
    if given is None:
        trained = bos_prepended if bos_prepended is not None else model_facts(model).bos
        return AUTO if trained is False else [0]
    return given


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


def choice_layers(window: object, model: Any, analysed: Sequence[int], available: Sequence[int], *,
                  need_model: bool = True) -> dict[int, int | None]:
    """The layers that ``sink="auto"`` reads besides the ``analysed`` ones, each with its sliding
    window: every layer of ``available`` (the model's, or those a cache holds) that ``window=``
    covers, so that a subset analysis reports the sink of a full one (SPEC §1)."""
    seen = set(analysed)
    others = [layer for layer in available if layer not in seen]
    if isinstance(window, Sequence) and not isinstance(window, str):
        others = [layer for layer in others if layer < len(window)]  # per model layer: those it names
    if not others:
        return {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # resolving the analysed layers' windows warned already
            windows = _windows.resolve(window, model, others, need_model=need_model)
    except ValueError:  # window= cannot say these layers' windows: they stay out (recorded)
        return {}
    return dict(zip(others, windows))


class SinkRun:
    """The sink of one analysis, in the steps both front doors take (SPEC §1): :meth:`probe`
    each layer of each batch, :meth:`given` or :meth:`choose` its windows' sinks, :meth:`record`
    ``metadata["sink"]``. ``rule`` is :func:`rule`'s; ``n_analysed`` the analysed layers;
    ``n_windows`` the windows of the whole input (batches come in order)."""

    def __init__(self, rule: str | list[int], n_analysed: int, n_windows: int) -> None:
        self.rule, self.auto, self.n_windows = rule, rule == AUTO, n_windows
        self.masses: list[list[Tensor]] = [[] for _ in range(n_analysed)]  # per analysed layer, per batch
        self.relative: list[int] = []  # each window's sink, from its first real token
        self.chosen_from: set[int] = set()
        self._probed: dict[int, Tensor] = {}  # the batch's choice masses per layer ("auto")

    def probe(self, layer: int, row: int | None, source: AttentionRows, mask: Tensor, window: int | None,
              sinks: Tensor | None = None, read: Tensor | None = None) -> None:
        """Read ``layer`` of the batch (``row``: its index among the analysed layers, ``None`` for
        a layer read only to choose): with ``"auto"`` every query ``32 ≤ t < min(T, w)``, else
        the first :data:`CHECK_QUERIES` of them and the batch's ``sinks``, or their masses as the
        analysis ``read`` them already (:attr:`~tl_geometry.engine.layer.LayerStats.first_keys`)."""
        if self.auto:
            mass = self._probed[layer] = first_keys_mass(source, mask, window).cpu()
        else:
            mass = (read if read is not None else first_keys_mass(source, mask, window, CHECK_QUERIES, sinks)).cpu()
        if row is not None:
            self.masses[row].append(mass)

    def given(self, mask: Bool[Tensor, "batch pos"], offset: int = 0) -> Int[Tensor, " batch"]:
        """The given sinks of the batch's windows ``offset …`` (absolute positions)."""
        sinks = positions(self.rule, mask, offset, self.n_windows)
        self.relative += (sinks - sink_positions(mask)).tolist()
        return sinks

    def choose(self, mask: Bool[Tensor, "batch pos"]) -> Int[Tensor, " batch"]:
        """``"auto"``'s sinks of the batch (absolute positions), from the layers probed for it in
        layer order (:func:`~tl_geometry.engine.sink_choice.choose_sink`); each window's first
        token where none was."""
        layers = sorted(self._probed)
        chosen = (choose_sink([self._probed[layer] for layer in layers]) if layers
                  else torch.zeros(mask.shape[0], dtype=torch.long))
        self.chosen_from.update(layers)
        self._probed = {}
        self.relative += chosen.tolist()
        return sink_positions(mask) + chosen.to(mask.device)

    def check_masses(self) -> list[Tensor]:
        """Each analysed layer's masses over every window read (none unless every layer has some)."""
        return [torch.cat(m) for m in self.masses] if all(self.masses) else []

    def record(self, model: Any, n_layers: int | None, masses: Sequence[Tensor] | None = None,
               relative: Sequence[int] | None = None) -> dict[str, Any]:
        """``metadata["sink"]``: the rule, the positions (from each window's first real token),
        the layers ``"auto"`` chose them from, what the model's files say of BOS, and the sink
        check (:func:`~tl_geometry.engine.sink_choice.sink_check`) of ``masses`` and ``relative``
        (every rank's, where sharded; else the run's). Warns "weak sink" where the check finds
        one, and where ``"auto"`` read fewer than the model's ``n_layers`` layers."""
        relative = self.relative if relative is None else relative
        masses = self.check_masses() if masses is None else masses
        sinks = torch.as_tensor(list(relative), dtype=torch.long)
        check_result = sink_check(masses, sinks) if masses else {}
        read = sorted(int(x) for x in self.chosen_from) if self.auto else None
        entry = {"rule": AUTO if self.auto else "given", "positions": [int(x) for x in relative],
                 "chosen_from_layers": read,
                 "trained_with_bos": model_facts(model).bos,
                 "candidates": CANDIDATES,
                 "check_queries": ("32 ≤ t < min(T, w)" if self.auto
                                   else f"32 ≤ t < min(T, w, {32 + CHECK_QUERIES})"),
                 **check_result}
        if read is not None and n_layers is not None and len(read) < n_layers:
            warn_caller(f"sink='auto' chose each window's sink from layers {first_few(read)} "
                        f"only, {len(read)} of the model's {n_layers} (the others are not in the "
                        "cache): an analysis of a cache with every layer may choose another key. "
                        "metadata['sink']['chosen_from_layers'] records them; cache every layer's "
                        "hook_pattern, or pass the positions as sink=.")
        if check_result.get("weak"):
            fix = ("pass sink='auto' (the most attended of the first 32 tokens)" if not self.auto
                   else "the model may have no sink: read its sink figures with care")
            sink_mass, other_mass = (_fmt(check_result[k]) for k in ("sink_mass", "other_mass"))
            values = sorted({int(x) for x in relative})
            more = "…" if len(values) > 4 else ""
            where = str(values[0]) if len(values) == 1 else f"{values[:4]}{more}"
            warn_caller(f"weak sink: the sink (position {where}) is not the most "
                        f"attended of the first {CANDIDATES} tokens in most layers (mean mass per "
                        f"layer {sink_mass} against {other_mass} for the most attended other key); "
                        f"{fix}. metadata['sink'] holds the check.")
        return entry


def _fmt(values: Sequence[float | None]) -> str:
    shown = [f"{v:.2f}" if v is not None else "–" for v in values[:6]]
    return "[" + ", ".join(shown) + (", …]" if len(values) > 6 else "]")
