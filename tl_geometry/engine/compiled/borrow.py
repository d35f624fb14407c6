"""Borrowed array views for the compiled kernels: no reference counting inside the hot loops.

Every numba array carries a reference to the memory that owns it, and numba updates that count
(an atomic add, through a call) each time a function receives the array, an inlined helper
binds it or a view of it is made. In the scoring kernel that came to hundreds of updates per
selection order, about a quarter of its time (SmolLM2, measured with perf). :func:`borrow`
returns the same array without the owner reference, so the updates along every call below it
become a null check.

A borrowed view must not outlive the array it borrows from, and the caller must keep that
array alive (referenced) while the view is used: borrow at the call, ``f(borrow(scratch))``,
never into a variable that outlives ``scratch``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from numba.core import cgutils, types
from numba.extending import intrinsic


# An intrinsic has no disk cache of its own (no ``cache=True``): numba inlines its code into each
# kernel that calls it, and that kernel's cache (all of them are ``cache=True``) keeps it. The view
# holds no pointer to a Python object, so the cached machine code stays valid in a new process.
@intrinsic
def _borrow(typingctx, array):  # pragma: no cover - compiled
    """``array`` itself (same data, shape and strides), without its owner reference."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, signature, args):
        source = context.make_array(array)(context, builder, value=args[0])
        view = context.make_array(array)(context, builder)
        view.meminfo = cgutils.get_null_value(view.meminfo.type)
        view.parent = cgutils.get_null_value(view.parent.type)
        view.nitems = source.nitems
        view.itemsize = source.itemsize
        view.data = source.data
        view.shape = source.shape
        view.strides = source.strides
        return view._getvalue()

    return array(array), codegen


#: ``borrow(array)`` inside a compiled function: ``array`` without its owner reference.
borrow = cast(Callable[[Any], Any], _borrow)
