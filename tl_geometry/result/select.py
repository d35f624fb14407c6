"""``HeadAnalysis.sel``: pick heads by model layer index, head and N value, like xarray's ``.sel``."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from .schema import UnknownNameError

#: What one axis of a selection asks for: everything (None), one value (the axis is dropped)
#: or a list of values (the axis is kept, in the order given).
Index = int | list[int] | None
COORDS = ("layer", "head", "n")


def positions(axis: str, wanted: Any, coords: list[int]) -> Index:
    """Positions of ``wanted`` (a value or a sequence of values) among ``coords``.

    >>> positions("layer", 5, [3, 5]), positions("layer", [5, 3], [3, 5])
    (1, [1, 0])
    """
    if wanted is None:
        return None
    many = wanted.ndim > 0 if isinstance(wanted, Tensor) else hasattr(wanted, "__len__")
    values = list(wanted) if many else [wanted]
    out = []
    for value in values:
        try:
            value = operator.index(value)
        except TypeError:
            raise UnknownNameError(f"{axis}={value!r}: give an int or a list of ints.") from None
        if isinstance(value, bool) or value not in coords:
            label = {"n": "N"}.get(axis, axis)
            raise UnknownNameError(f"{label}={value} was not analysed; valid {axis} values: {coords}.")
        out.append(coords.index(value))
    return out if many else out[0]


def take(values: Tensor, index: tuple[Index, ...]) -> Tensor:
    """``values[layer, head(, n), ...]`` selected axis by axis (an int drops the axis, a list keeps
    it); unlike ``values[[0, 1], [2, 3]]`` two lists select their product, not pairs."""
    for dim in reversed(range(len(index))):  # from the last axis, so earlier dims keep their number
        i = index[dim]
        if isinstance(i, int):
            values = values.select(dim, i)
        elif i is not None:
            values = values.index_select(dim, torch.tensor(i, dtype=torch.long, device=values.device))
    return values


class HeadSelection(Mapping[str, Any]):
    """What :meth:`HeadAnalysis.sel <tl_geometry.result.HeadAnalysis.sel>` returns: a read-only
    mapping from quantity names (``f_score``, ``sink_norm_ratio``, ``label``, ...) to the selected
    values, also read as attributes (``s.f_score``). ``coords`` holds what was selected on each
    axis (every analysed value where none was asked), ``dims`` the axes kept, in order.

    >>> s = result.sel(layer=5, head=3, n=2)     # doctest: +SKIP
    >>> float(s.f_score), s["label"]              # doctest: +SKIP
    (0.61, 'Mixer')
    """

    def __init__(self, data: dict[str, Any], coords: dict[str, Any], dims: tuple[str, ...]) -> None:
        self._data = data
        self.coords = coords
        self.dims = dims

    def __getitem__(self, key: str) -> Any:
        if key not in self._data:
            raise UnknownNameError(f"no quantity {key!r} in this selection; valid: {', '.join(self._data)}.")
        return self._data[key]

    def __getattr__(self, key: str) -> Any:
        """``s.f_score`` is ``s["f_score"]`` (xarray-style attribute access)."""
        if key.startswith("_"):  # private names (and copy/pickle probes) are never quantities
            raise AttributeError(key)
        try:
            return self._data[key]
        except KeyError:
            raise AttributeError(f"HeadSelection has no quantity {key!r}; valid: "
                                 f"{', '.join(self._data)}.") from None

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._data})

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values: numbers for scalars, nested lists otherwise."""
        return {k: v.tolist() if isinstance(v, Tensor) else v for k, v in self._data.items()}

    def __repr__(self) -> str:
        where = ", ".join(f"{k}={v}" for k, v in self.coords.items())
        if "layer" in self.dims or "head" in self.dims:
            return (f"HeadSelection({where}; dims={self.dims}; {len(self)} quantities: "
                    f"{', '.join(self._data)})")
        lines = [f"HeadSelection({where})"]
        lines += [f"  {key:<24} {_fmt(value)}" for key, value in self.to_dict().items()]
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return repr(value)
