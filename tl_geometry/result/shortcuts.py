"""The attribute shortcuts of :class:`~tl_geometry.result.HeadAnalysis`, generated from the schema.

``result.random_f_score`` is ``result.metric("f_score", "random")``, ``result.sink_mass`` is
``result.sink_diagnostic("mass")``, ``result.shell_n_f_score`` is ``result.bound("shell_n",
"f_score")``: one attribute per documented slice, made from the names in :mod:`.schema`. They are
real class attributes, so ``dir()``, editors and ``help()`` list them; each is a
``[layer, head(, n)]`` tensor.

Documented (:data:`DOCUMENTED`): every metric of the top-N group (``f_score``, ``margin``, ...),
the F-score of every other group (``random_f_score``, ``sink_removed_f_score``, ...), the sink
diagnostics (``sink_mass``, ...) and the bound, paired and percentile figures that
:data:`_DOCS` describes. Every other generated name (``sink_in_margin``, ``regime_kappa``, ...)
still resolves, with a ``DeprecationWarning`` that names its accessor call: the accessors
(:meth:`~tl_geometry.result.HeadAnalysis.metric`, ``sel()``, ...) read every slice.
"""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any, overload

from torch import Tensor

from ..functional.regime import REGIME_FIELDS
from ..functional.separability import METRIC_NAMES, TRUNCATION_NAMES
from ..functional.sink import SINK_FIELDS
from .schema import BOUND_KINDS, BOUND_METRICS, GROUPS, PAIRED_FIELDS

#: Accessors whose slices have no N axis.
_PER_HEAD = ("sink_diagnostic", "regime_diagnostic")


class _Slice:
    """An attribute that reads one named slice through an accessor, e.g. ``sink_removed_f_score``
    is ``_Slice("metric", "f_score", "sink_removed")``: ``result.metric("f_score", "sink_removed")``."""

    def __init__(self, accessor: str, *key: str, doc: str | None = None) -> None:
        self.accessor, self.key = accessor, key
        call = f"``result.{accessor}({', '.join(map(repr, key))})``"
        shape = "[layer, head]" if accessor in _PER_HEAD else "[layer, head, n]"
        self.__doc__ = f"{doc + ': ' if doc else ''}{call}, ``{shape}``."

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Slice: ...
    @overload
    def __get__(self, obj: Any, owner: type | None = None) -> Tensor: ...
    def __get__(self, obj: Any | None, owner: type | None = None) -> Tensor | _Slice:
        return self if obj is None else getattr(obj, self.accessor)(*self.key)


#: What a shortcut means, where more than its accessor call is worth saying.
_DOCS: dict[str, str] = {
    "precision": "Top-N geometric precision P_N",
    "f_score": "Top-N F_N (``f_score[li, h, i]``: layer ``layers[li]``, N ``n_values[i]``)",
    "precision_cc": "Chance-corrected precision P*_N = (P_N − N/(t+1)) / (1 − N/(t+1)) (SPEC §3, ours)",
    "f_score_cc": "Chance-corrected F*_N: harmonic mean of P*_N and R_N (SPEC §3, ours)",
    "random_f_score": "Random N-subset baseline of F_N",
    "shuffled_f_score": "F_N of the top-N set under the null of ``shuffle`` (default: the non-sink values "
                        "shuffled; SPEC §3)",
    "sink_removed_f_score": "F_N of the top-N set re-selected without the sink",
    "paired_sink_ratio": "Per head, median F_N(with sink) / F_N(sink removed) over instances holding the sink",
    "tail_mass": "Top-N tail mass τ_N = Σ_{j∉S_N} α_j, mean over instances (SPEC §10)",
    "truncation_error": "Top-N relative output error ‖o − o_N‖/‖o‖ of the renormalised top-N, mean (SPEC §10)",
    "p90_tail_mass": "90th percentile over instances of the top-N tail mass τ_N (SPEC §10)",
    "p90_truncation_error": "90th percentile over instances of the top-N relative output error (SPEC §10)",
    "paired_sink_halved": "Per head, fraction of those instances where the sink halves F_N (ratio ≤ 1/2)",
    "sink_mass": "Mean attention on the sink",
    "sink_norm_ratio": "κ = ‖v_sink‖ / mean_{j≠sink} ‖v_j‖ (SPEC §4)",
    "sink_cosine": "Mean signed cos(v_sink, v_j) over the other keys",
    "certified_f_score": "Certified lower bound on F_N (``bounds=True``)",
    "predicted_f_score": "Predicted envelope of F_N (``bounds=True``)",
    "shell_f_score": "Shell certificate of F_N with K = 0, norm-only (SPEC §6d; ``bounds=True``)",
    "shell_n_f_score": "Shell certificate of F_N with K = N exact unselected distances (SPEC §6d)",
    "inversion_separated": "Fraction of instances with P_N = R_N = 1 (GInv = 0: measured, exact)",
    "shell_separated": "Fraction of instances the K = 0 shell certificate proves separated (P̲ = R̲ = 1, ours)",
    "shell_n_separated": "Fraction of instances the K = N shell certificate proves separated (P̲ = R̲ = 1, ours)",
}


def shortcut_slices() -> dict[str, tuple[str, ...]]:
    """Every shortcut name → its accessor and key, in schema order: ``<metric>`` (top-N group),
    ``<group>_<metric>``, ``paired_sink_<field>``, ``p90_<truncation metric>``, ``sink_<field>``,
    ``<kind>_<metric>`` and ``regime_<field>``."""
    out: dict[str, tuple[str, ...]] = {}
    for group in GROUPS:
        for metric in METRIC_NAMES:
            out[metric if group == "top" else f"{group}_{metric}"] = (
                ("metric", metric) if group == "top" else ("metric", metric, group))
    out.update({f"paired_sink_{f}": ("paired_sink", f) for f in PAIRED_FIELDS})
    out.update({f"p90_{m}": ("truncation_percentile", m) for m in TRUNCATION_NAMES})
    out.update({f"sink_{f}": ("sink_diagnostic", f) for f in SINK_FIELDS})
    out.update({f"{k}_{m}": ("bound", k, m) for k in BOUND_KINDS for m in BOUND_METRICS})
    out.update({f"regime_{f}": ("regime_diagnostic", f) for f in REGIME_FIELDS})
    return out


def _documented(slices: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The shortcuts kept as attributes: the top-N group's metrics, every group's F-score, the
    sink diagnostics and what :data:`_DOCS` describes."""
    keep = set(METRIC_NAMES) | {f"{g}_f_score" for g in GROUPS if g != "top"}
    keep |= {f"sink_{f}" for f in SINK_FIELDS} | set(_DOCS)
    return tuple(name for name in slices if name in keep)


_SLICES = shortcut_slices()
#: The shortcut attributes of :class:`~tl_geometry.result.HeadAnalysis`, in schema order.
DOCUMENTED: tuple[str, ...] = _documented(_SLICES)
#: Older generated names, each resolved through its accessor with a ``DeprecationWarning``.
DEPRECATED: dict[str, _Slice] = {name: _Slice(accessor, *key) for name, (accessor, *key) in _SLICES.items()
                                 if name not in DOCUMENTED}


class Shortcuts:
    """Read-only attribute for every documented slice (:data:`DOCUMENTED`); the other
    generated names (:data:`DEPRECATED`) resolve with a ``DeprecationWarning``."""

    if TYPE_CHECKING:  # the attributes are made below; type checkers see them as tensors
        def __getattr__(self, name: str) -> Tensor: ...
    else:
        def __getattr__(self, name: str) -> Tensor:
            # Called when the normal lookup fails, also when a class attribute (a shortcut or a
            # property) raised an AttributeError such as NoBoundsError: read it again so that
            # its own error surfaces, not "no attribute".
            declared = inspect.getattr_static(type(self), name, None)
            if hasattr(declared, "__get__"):
                return declared.__get__(self, type(self))
            old = DEPRECATED.get(name)
            if old is None:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            call = f"result.{old.accessor}({', '.join(map(repr, old.key))})"
            warnings.warn(f"result.{name} is deprecated and will be removed; use {call}.",
                          DeprecationWarning, stacklevel=2)
            return old.__get__(self)


for _name in DOCUMENTED:
    _accessor, *_key = _SLICES[_name]
    setattr(Shortcuts, _name, _Slice(_accessor, *_key, doc=_DOCS.get(_name)))
del _name, _accessor, _key
