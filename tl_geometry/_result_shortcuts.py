"""The attribute shortcuts of :class:`~tl_geometry.result.HeadAnalysis`, one per named slice.

``result.random_f_score`` is ``result.metric("f_score", "random")``, ``result.sink_mass`` is
``result.sink_diagnostic("mass")``, ``result.shell_n_f_score`` is ``result.bound("shell_n",
"f_score")``: explicit attributes (not ``__getattr__``) so that editors, ``dir()`` and type
checkers see them. Each is a ``[layer, head(, n)]`` tensor.
"""

from __future__ import annotations

from typing import Any, overload

from torch import Tensor


class _Slice:
    """An attribute that reads one named slice through an accessor, e.g. ``sink_removed_f_score
    = _Slice("metric", "f_score", "sink_removed")`` is ``result.metric("f_score", "sink_removed")``."""

    def __init__(self, accessor: str, *key: str) -> None:
        self.accessor, self.key = accessor, key

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Slice: ...
    @overload
    def __get__(self, obj: Any, owner: type | None = None) -> Tensor: ...
    def __get__(self, obj: Any | None, owner: type | None = None) -> Tensor | _Slice:
        return self if obj is None else getattr(obj, self.accessor)(*self.key)


class Shortcuts:
    """Read-only attribute for every (group, metric), sink field, bound and regime field."""

    precision = _Slice("metric", "precision")
    """Top-N geometric precision P_N, ``[layer, head, n]``."""
    recall = _Slice("metric", "recall")
    f_score = _Slice("metric", "f_score")
    """Top-N F_N, ``[layer, head, n]`` (``f_score[li, h, i]``: layer ``layers[li]``, N ``n_values[i]``)."""
    margin = _Slice("metric", "margin")
    inversions = _Slice("metric", "inversions")
    precision_cc = _Slice("metric", "precision_cc")
    """Chance-corrected precision P*_N = (P_N − N/(t+1)) / (1 − N/(t+1)) (SPEC §3, ours)."""
    f_score_cc = _Slice("metric", "f_score_cc")
    """Chance-corrected F*_N: harmonic mean of P*_N and R_N (SPEC §3, ours)."""
    random_precision = _Slice("metric", "precision", "random")
    random_recall = _Slice("metric", "recall", "random")
    random_f_score = _Slice("metric", "f_score", "random")
    """Random N-subset baseline of F_N, ``[layer, head, n]``."""
    random_margin = _Slice("metric", "margin", "random")
    random_inversions = _Slice("metric", "inversions", "random")
    random_precision_cc = _Slice("metric", "precision_cc", "random")
    random_f_score_cc = _Slice("metric", "f_score_cc", "random")
    shuffled_precision = _Slice("metric", "precision", "shuffled")
    shuffled_recall = _Slice("metric", "recall", "shuffled")
    shuffled_f_score = _Slice("metric", "f_score", "shuffled")
    """F_N of the top-N set with the non-sink values shuffled (value-shuffle null, SPEC §3)."""
    shuffled_margin = _Slice("metric", "margin", "shuffled")
    shuffled_inversions = _Slice("metric", "inversions", "shuffled")
    shuffled_precision_cc = _Slice("metric", "precision_cc", "shuffled")
    shuffled_f_score_cc = _Slice("metric", "f_score_cc", "shuffled")
    sink_removed_precision = _Slice("metric", "precision", "sink_removed")
    sink_removed_recall = _Slice("metric", "recall", "sink_removed")
    sink_removed_f_score = _Slice("metric", "f_score", "sink_removed")
    """F_N of the top-N set re-selected without the sink."""
    sink_removed_margin = _Slice("metric", "margin", "sink_removed")
    sink_removed_inversions = _Slice("metric", "inversions", "sink_removed")
    sink_removed_precision_cc = _Slice("metric", "precision_cc", "sink_removed")
    sink_removed_f_score_cc = _Slice("metric", "f_score_cc", "sink_removed")
    sink_in_precision = _Slice("metric", "precision", "sink_in")
    sink_in_recall = _Slice("metric", "recall", "sink_in")
    sink_in_f_score = _Slice("metric", "f_score", "sink_in")
    sink_in_margin = _Slice("metric", "margin", "sink_in")
    sink_in_inversions = _Slice("metric", "inversions", "sink_in")
    sink_in_precision_cc = _Slice("metric", "precision_cc", "sink_in")
    sink_in_f_score_cc = _Slice("metric", "f_score_cc", "sink_in")
    sink_out_precision = _Slice("metric", "precision", "sink_out")
    sink_out_recall = _Slice("metric", "recall", "sink_out")
    sink_out_f_score = _Slice("metric", "f_score", "sink_out")
    sink_out_margin = _Slice("metric", "margin", "sink_out")
    sink_out_inversions = _Slice("metric", "inversions", "sink_out")
    sink_out_precision_cc = _Slice("metric", "precision_cc", "sink_out")
    sink_out_f_score_cc = _Slice("metric", "f_score_cc", "sink_out")
    paired_sink_ratio = _Slice("paired_sink", "ratio")
    """Per head, median F_N(with sink) / F_N(sink removed) over instances holding the sink."""
    paired_sink_halved = _Slice("paired_sink", "halved")
    """Per head, fraction of those instances where the sink halves F_N (ratio ≤ 1/2)."""
    paired_sink_count = _Slice("paired_sink", "count")
    sink_mass = _Slice("sink_diagnostic", "mass")
    """Mean attention on the sink, ``[layer, head]``."""
    sink_norm_ratio = _Slice("sink_diagnostic", "norm_ratio")
    """κ = ‖v_sink‖ / mean_{j≠sink} ‖v_j‖ (SPEC §4), ``[layer, head]``."""
    sink_cosine = _Slice("sink_diagnostic", "cosine")
    """Mean signed cos(v_sink, v_j) over the other keys, ``[layer, head]``."""
    sink_mean_cosine = _Slice("sink_diagnostic", "mean_cosine")
    sink_share = _Slice("sink_diagnostic", "share")
    inversion_precision = _Slice("bound", "inversion", "precision")
    inversion_recall = _Slice("bound", "inversion", "recall")
    inversion_f_score = _Slice("bound", "inversion", "f_score")
    certified_precision = _Slice("bound", "certified", "precision")
    certified_recall = _Slice("bound", "certified", "recall")
    certified_f_score = _Slice("bound", "certified", "f_score")
    """Certified lower bound on F_N (``bounds=True``), ``[layer, head, n]``."""
    predicted_precision = _Slice("bound", "predicted", "precision")
    predicted_recall = _Slice("bound", "predicted", "recall")
    predicted_f_score = _Slice("bound", "predicted", "f_score")
    """Predicted envelope of F_N (``bounds=True``), ``[layer, head, n]``."""
    shell_precision = _Slice("bound", "shell", "precision")
    shell_recall = _Slice("bound", "shell", "recall")
    shell_f_score = _Slice("bound", "shell", "f_score")
    """Shell certificate of F_N with K = 0, norm-only (SPEC §6d; ``bounds=True``), ``[layer, head, n]``."""
    shell_n_precision = _Slice("bound", "shell_n", "precision")
    shell_n_recall = _Slice("bound", "shell_n", "recall")
    shell_n_f_score = _Slice("bound", "shell_n", "f_score")
    """Shell certificate of F_N with K = N exact unselected distances (SPEC §6d), ``[layer, head, n]``."""
    inversion_separated = _Slice("bound", "inversion", "separated")
    """Fraction of instances with P_N = R_N = 1 (GInv = 0: measured, exact), ``[layer, head, n]``."""
    certified_separated = _Slice("bound", "certified", "separated")
    predicted_separated = _Slice("bound", "predicted", "separated")
    shell_separated = _Slice("bound", "shell", "separated")
    """Fraction of instances the K = 0 shell certificate proves separated (P̲ = R̲ = 1, ours)."""
    shell_n_separated = _Slice("bound", "shell_n", "separated")
    """Fraction of instances the K = N shell certificate proves separated (P̲ = R̲ = 1, ours)."""
    regime_norm_cv = _Slice("regime_diagnostic", "norm_cv")
    regime_kappa = _Slice("regime_diagnostic", "kappa")
    regime_a = _Slice("regime_diagnostic", "a")
    regime_decay = _Slice("regime_diagnostic", "decay")
    regime_b = _Slice("regime_diagnostic", "b")
    regime_fit_mae = _Slice("regime_diagnostic", "fit_mae")
