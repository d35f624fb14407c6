"""What the table, text and headline helpers read of a result.

The helpers of :mod:`tl_geometry.result` (``tables``, ``text``, ``headline``) take any object
with this shape, so that :class:`~tl_geometry.result.head_analysis.HeadAnalysis` can import them
and none of them imports it back (no import cycle, type-only ones included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class AnalysisLike(Protocol):
    """A :class:`~tl_geometry.result.head_analysis.HeadAnalysis`, as its helpers see it: its
    fields, its accessors and (through ``__getattr__``) its attribute shortcuts."""

    layers: tuple[int, ...]
    n_values: Tensor
    metadata: dict[str, Any]
    bounds: Tensor | None

    def metric(self, name: str, group: str = "top") -> Tensor: ...
    def bound(self, kind: str, metric: str = "f_score") -> Tensor: ...
    def count(self, group: str = "top") -> Tensor: ...
    def baseline_error(self, metric: str = "f_score", kind: str = "monte_carlo") -> Tensor: ...

    # Properties stay out of the runtime check: ``isinstance`` would evaluate each of them (and
    # ``headline_n`` calls a helper typed with this protocol again).
    if TYPE_CHECKING:
        @property
        def n_layers(self) -> int: ...
        @property
        def n_heads(self) -> int: ...
        @property
        def labels(self) -> list[list[str | None]]: ...
        @property
        def headline_n(self) -> tuple[int, ...]: ...

        def __getattr__(self, name: str) -> Any: ...  # the attribute shortcuts (``f_score``, ...)
