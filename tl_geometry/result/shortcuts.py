"""The attribute shortcuts of :class:`~tl_geometry.result.HeadAnalysis`, one per documented slice.

``result.random_f_score`` is ``result.metric("f_score", "random")``: declared one by one, so
``dir()``, editors, ``help()`` and type checkers see them.
"""

from __future__ import annotations

from typing import Any, overload

from torch import Tensor

from ..functional.figures import figure

#: The axis of :data:`~tl_geometry.functional.figures.FIGURES` that an accessor's one name reads,
#: where the shortcut's docstring is that figure's doc line.
_AXIS = {"metric": "metric", "sink_diagnostic": "sink_field", "paired_sink": "paired_field"}


class _Slice:
    """An attribute that reads one named slice through an accessor (whose errors reach the caller
    unchanged): ``_Slice("metric", "f_score", "random")`` is ``metric("f_score", "random")``."""

    def __init__(self, accessor: str, *key: str, doc: str | None = None) -> None:
        self.accessor, self.key = accessor, key
        if doc is None and accessor in _AXIS and len(key) == 1:
            row = figure(_AXIS[accessor], key[0])
            doc = f"{row.doc}; SPEC {row.spec}"
        call = f"``result.{accessor}({', '.join(map(repr, key))})``"
        per_head = accessor in ("sink_diagnostic", "regime_diagnostic")  # no N axis
        shape = "[layer, head]" if per_head else "[layer, head, n]"
        self.__doc__ = f"{doc + ': ' if doc else ''}{call}, ``{shape}``."

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Slice: ...
    @overload
    def __get__(self, obj: Any, owner: type | None = None) -> Tensor: ...
    def __get__(self, obj: Any | None, owner: type | None = None) -> Tensor | _Slice:
        return self if obj is None else getattr(obj, self.accessor)(*self.key)


class Shortcuts:
    """Read-only ``[layer, head(, n)]`` tensor attributes, each one accessor call (:data:`DOCUMENTED`)."""

    # --- metric(name): the top-N group; sink_diagnostic(field) (docs: functional.figures) ----------
    precision = _Slice("metric", "precision")
    recall = _Slice("metric", "recall")
    f_score = _Slice("metric", "f_score", doc="Top-N F_N, the harmonic mean of P_N and R_N; SPEC §3 "
                     "(``f_score[li, h, i]``: layer ``layers[li]``, N ``n_values[i]``)")
    margin = _Slice("metric", "margin")
    inversions = _Slice("metric", "inversions")
    precision_cc = _Slice("metric", "precision_cc")
    f_score_cc = _Slice("metric", "f_score_cc")
    tail_mass = _Slice("metric", "tail_mass")
    truncation_error = _Slice("metric", "truncation_error")
    sink_mass = _Slice("sink_diagnostic", "mass")
    sink_norm_ratio = _Slice("sink_diagnostic", "norm_ratio")
    sink_cosine = _Slice("sink_diagnostic", "cosine")
    sink_mean_cosine = _Slice("sink_diagnostic", "mean_cosine")
    sink_share = _Slice("sink_diagnostic", "share")

    # --- metric("f_score", group): the other groups ----------------------------------------------
    random_f_score = _Slice("metric", "f_score", "random", doc="Random N-subset baseline of F_N")
    shuffled_f_score = _Slice("metric", "f_score", "shuffled", doc="F_N of the top-N set under the null of "
                              "``shuffle`` (default: the non-sink values shuffled; SPEC §3)")
    sink_removed_f_score = _Slice("metric", "f_score", "sink_removed",
                                  doc="F_N of the top-N set re-selected without the sink")
    sink_in_f_score = _Slice("metric", "f_score", "sink_in")
    sink_out_f_score = _Slice("metric", "f_score", "sink_out")

    # --- paired_sink, truncation_percentile --------------------------------------------------------
    paired_sink_ratio = _Slice("paired_sink", "ratio")
    paired_sink_halved = _Slice("paired_sink", "halved")
    p90_tail_mass = _Slice("truncation_percentile", "tail_mass",
                           doc="90th percentile over instances of the top-N tail mass τ_N (SPEC §10)")
    p90_truncation_error = _Slice("truncation_percentile", "truncation_error", doc="90th percentile over "
                                  "instances of the top-N relative output error (SPEC §10)")

    # --- bound(kind, metric): need bounds=True, else NoBoundsError ---------------------------------
    inversion_separated = _Slice("bound", "inversion", "separated",
                                 doc="Fraction of instances with P_N = R_N = 1 (GInv = 0: measured, exact)")
    certified_f_score = _Slice("bound", "certified", "f_score",
                               doc="Certified lower bound on F_N (``bounds=True``)")
    predicted_f_score = _Slice("bound", "predicted", "f_score",
                               doc="Predicted envelope of F_N (``bounds=True``)")
    shell_f_score = _Slice("bound", "shell", "f_score",
                           doc="Shell certificate of F_N with K = 0, norm-only (SPEC §6d; ``bounds=True``)")
    shell_separated = _Slice("bound", "shell", "separated", doc="Fraction of instances the K = 0 shell "
                             "certificate proves separated (P̲ = R̲ = 1, ours)")
    shell_n_f_score = _Slice("bound", "shell_n", "f_score",
                             doc="Shell certificate of F_N with K = N exact unselected distances (SPEC §6d)")
    shell_n_separated = _Slice("bound", "shell_n", "separated", doc="Fraction of instances the K = N shell "
                               "certificate proves separated (P̲ = R̲ = 1, ours)")


#: The shortcut attributes of :class:`~tl_geometry.result.HeadAnalysis`, in declaration order.
DOCUMENTED: tuple[str, ...] = tuple(name for name, value in vars(Shortcuts).items() if isinstance(value, _Slice))
