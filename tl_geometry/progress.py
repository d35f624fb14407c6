"""When to show progress by default, and how: a bar where one is visible, plain lines elsewhere.

On a terminal or in a notebook the long-running functions draw a tqdm bar. Where standard error
is a file or a pipe a bar is invisible (it redraws itself with carriage returns), so a run that
asked for progress (``progress=True``; the command line unless ``--no-progress``) writes plain
lines instead, such as ``tl_geometry: analyze_heads 12/30 layers (40 %), 1 min 10 s elapsed``:
one at the start, one at every tenth of the work, and one at the first step done
:data:`LINE_INTERVAL_S` seconds or more after the last line, whichever comes first.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Sized
from typing import Any, TypeVar

__all__ = ["ProgressLines", "auto_progress", "check_progress", "progress_bar", "progress_counter"]

T = TypeVar("T")

#: Seconds after which the next step done writes a plain progress line, whatever its share.
LINE_INTERVAL_S = 30.0
#: The clock of the plain lines (a test replaces it to make their times deterministic).
_clock = time.monotonic


def auto_progress() -> bool:
    """Whether a bar would be visible: standard error is a terminal, or this runs inside a
    Jupyter kernel (notebooks, VS Code, JupyterLab). It is what ``progress=None`` means; False for
    pipes, log files and CI, where ``progress=True`` writes plain lines instead.

    >>> auto_progress()  # doctest: +SKIP
    True
    """
    stderr = sys.stderr
    try:
        if stderr is not None and stderr.isatty():
            return True
    except (AttributeError, ValueError):  # a replaced or closed stream
        pass
    # Only an IPython already imported: importing it here would cost a second and could not make
    # a plain script a notebook. A kernel's shell (ZMQInteractiveShell) has a ``kernel``; the
    # terminal IPython shell has none.
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    shell = get_ipython() if callable(get_ipython) else None
    return getattr(shell, "kernel", None) is not None


def check_progress(progress: Any) -> bool:
    """``progress`` as a bool: ``True``, ``False`` or ``None`` (:func:`auto_progress`). Anything
    else (``"yes"``, ``1``) is refused, the same in every function that takes it."""
    if progress is None:
        return auto_progress()
    if not isinstance(progress, bool):
        raise ValueError(f"progress must be True, False or None (automatic), got {progress!r}.")
    return progress


def _duration(seconds: float) -> str:
    """``"45 s"``, ``"1 min 10 s"``, ``"2 h 05 min"``."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def _plural(unit: str, count: int | None) -> str:
    if count == 1:
        return unit
    return unit + ("es" if unit.endswith(("s", "sh", "ch", "x")) else "s")


class ProgressLines:
    """Progress of ``total`` steps as plain lines on standard error (no carriage return, no
    colour): what a log file can show of a bar. ``update``, ``set_postfix_str`` and ``close``
    are tqdm's, so the functions that advance a bar advance this alike."""

    def __init__(self, total: int | None, desc: str, unit: str, postfix: str = "") -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0
        self.postfix = postfix
        self.start = self.last = _clock()
        self.tenths = 0  # the tenths of the work done at the last line
        self._write(self.start)

    def update(self, n: int = 1) -> None:
        """``n`` more steps done; a line where they reach another tenth of the work or the last
        line is :data:`LINE_INTERVAL_S` old."""
        self.n += n
        now = _clock()
        tenths = 10 * self.n // self.total if self.total else 0
        if tenths > self.tenths or now - self.last >= LINE_INTERVAL_S:
            self.tenths = tenths
            self._write(now)

    def set_postfix_str(self, text: str) -> None:
        """Text after the counts on the next lines (the stage a run is in)."""
        self.postfix = text

    def close(self) -> None:
        """Nothing to release: every line is already written."""

    def _write(self, now: float) -> None:
        self.last = now
        if self.total:
            done = f"{self.n}/{self.total} {_plural(self.unit, self.total)} ({100 * self.n // self.total} %)"
        else:  # an iterable of unknown length
            done = f"{self.n} {_plural(self.unit, self.n)}"
        stage = f"; {self.postfix}" if self.postfix else ""
        print(f"tl_geometry: {self.desc} {done}, {_duration(now - self.start)} elapsed{stage}",
              file=sys.stderr, flush=True)


def _tqdm(**kwargs: Any) -> Any:
    from tqdm.auto import tqdm

    with warnings.catch_warnings():  # tqdm.auto without ipywidgets warns once per bar
        warnings.simplefilter("ignore")
        return tqdm(**kwargs)


def progress_counter(total: int | None, desc: str, unit: str, postfix: str = "", **bar_options: Any) -> Any:
    """A progress display of ``total`` steps, advanced with ``update(n)`` and ended with
    ``close()``: a tqdm bar where one is visible (:func:`auto_progress`; ``bar_options`` go to
    tqdm), else :class:`ProgressLines`. For a caller that has decided to show progress."""
    if auto_progress():
        return _tqdm(total=total, desc=desc, unit=unit, postfix=postfix or None, **bar_options)
    return ProgressLines(total, desc, unit, postfix)


def progress_bar(items: Iterable[T], progress: bool | None, desc: str, unit: str) -> Iterable[T]:
    """``items``, with progress shown as they are consumed: nothing with ``progress=False``; a bar
    where one is visible; plain lines on standard error elsewhere with ``progress=True``
    (``None``: a bar where visible, else nothing)."""
    if not check_progress(progress):
        return items
    if auto_progress():
        bar: Any = _tqdm(iterable=items, desc=desc, unit=unit)
        return bar
    lines = ProgressLines(len(items) if isinstance(items, Sized) else None, desc, unit)
    return _stepped(items, lines)


def _stepped(items: Iterable[T], lines: ProgressLines) -> Iterator[T]:
    """``items``, with ``lines`` advanced by one after each."""
    for item in items:
        yield item
        lines.update()
