"""The one-time compilation of the kernels as the user sees it, and the errors that mean a kernel
cannot be compiled here.

numba keeps each specialisation's machine code in its disk cache: in ``NUMBA_CACHE_DIR`` when
set, else in ``compiled/__pycache__`` when writable, else in the user-wide cache
(``~/.cache/numba``), so an install in a read-only ``site-packages`` caches too. The first layer
of a process compiles every specialisation the engine calls (:mod:`.signatures`).

:func:`reporting` prints one line to standard error when a compilation of these kernels really
starts and one, with the seconds spent, when the work it wraps ends. numba broadcasts
``"numba:compile"`` on a cache miss only, so nothing is printed once the kernels are cached.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

from numba.core import event
from numba.core.errors import NumbaError

#: A kernel that numba cannot compile here: a typing, lowering or unsupported-feature error
#: (their common base). Errors of the kernels' own run (an index out of range) are not these.
COMPILE_ERRORS: tuple[type[Exception], ...] = (NumbaError,)

#: Measured for every specialisation (benchmarks/bench_compile_once.py): 166 s and 207 s on a
#: 2-core machine busy with other work.
START_LINE = ("tl_geometry: compiling the analysis kernels (once per install: 1 to 4 min, depending on "
              "the machine and its load) ...")


class _Report(event.Listener):
    """Times the compilations of this package's kernels and announces the first one. Only
    outermost events count (a kernel's callees compile inside it); numba compiles under one
    process-wide lock, so events never interleave."""

    def __init__(self) -> None:
        self.depth = 0
        self.ours = False
        self.since = 0.0
        self.seconds = 0.0
        self.announced = False

    def on_start(self, ev: Any) -> None:
        self.depth += 1
        if self.depth == 1:
            self.ours = _is_ours(ev.data)
            if self.ours:
                self.since = perf_counter()
                if not self.announced:
                    print(START_LINE, file=sys.stderr, flush=True)
                    self.announced = True

    def on_end(self, ev: Any) -> None:
        self.depth -= 1
        if self.depth == 0 and self.ours:
            self.seconds += perf_counter() - self.since
            self.ours = False


def _is_ours(data: Any) -> bool:
    """Whether the event compiles a kernel of this package (not the caller's own numba code)."""
    func = getattr(data.get("dispatcher") if isinstance(data, dict) else None, "py_func", None)
    return str(getattr(func, "__module__", "")).startswith(f"{__package__}.")


@contextmanager
def reporting() -> Iterator[None]:
    """Within: the start line of the first compilation of a kernel of this package; at the end,
    if one was printed, the seconds spent compiling (no end line when a kernel failed to compile:
    the caller says what happens instead)."""
    report = _Report()
    failed = False
    try:
        with event.install_listener("numba:compile", report):
            yield
    except COMPILE_ERRORS:
        failed = True
        raise
    finally:
        if report.announced and not failed:
            print(f"tl_geometry: compiled the analysis kernels in {report.seconds:.0f} s; later runs "
                  "load them from numba's cache.", file=sys.stderr, flush=True)
