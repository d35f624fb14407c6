"""Borrowed array views for the compiled kernels: no reference counting inside the hot loops.

numba updates an array's owner reference count (an atomic add, through a call) each time a
function receives it or a view of it is made: a quarter of the scoring kernel's time
(docs/scale.md). :func:`borrow` returns the same array without the owner reference, so those
updates become a null check. The caller must keep the borrowed-from array referenced while the
view is used: borrow at the call, ``f(borrow(scratch))``, never into a longer-lived variable.
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
