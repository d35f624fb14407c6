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

    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def labels(self) -> list[list[str | None]]: ...
    def metric(self, name: str, group: str = "top") -> Tensor: ...
    def bound(self, kind: str, metric: str = "f_score") -> Tensor: ...
    def count(self, group: str = "top") -> Tensor: ...

    # Not declared here, though the helpers read them: properties computed *by* helpers that take
    # an AnalysisLike (``headline_n``). Python 3.11's isinstance on a protocol evaluates every
    # declared property, so a runtime type check would call the property, whose helper checks
    # the argument again: an unbounded recursion. They are reached through ``__getattr__`` below.
    if TYPE_CHECKING:  # the attribute shortcuts (``f_score``, ``sink_mass``, ...)
        def __getattr__(self, name: str) -> Any: ...
