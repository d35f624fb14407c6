"""When to show a progress bar by default, and the bar the long-running functions use."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = ["auto_progress", "progress_bar"]

T = TypeVar("T")


def _in_jupyter_kernel() -> bool:
    # Only look at an IPython that is already imported: importing it here would cost a second and
    # could not make a plain script a notebook.
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    shell = get_ipython() if callable(get_ipython) else None
    # A kernel's shell (ZMQInteractiveShell) has a ``kernel``; the terminal IPython shell has none.
    return getattr(shell, "kernel", None) is not None


def auto_progress() -> bool:
    """Whether a long call should show a progress bar when the caller did not say.

    True when standard error is a terminal or when running inside a Jupyter kernel (notebooks,
    VS Code, JupyterLab), where a bar is visible; False for pipes, log files and CI, where a bar
    would only add noise.

    >>> auto_progress()  # doctest: +SKIP
    True
    """
    stderr = sys.stderr
    try:
        if stderr is not None and stderr.isatty():
            return True
    except (AttributeError, ValueError):  # a replaced or closed stream
        pass
    return _in_jupyter_kernel()


def check_progress(progress: Any) -> bool:
    """``progress`` as a bool: ``True``, ``False`` or ``None`` (:func:`auto_progress`). Anything
    else (``"yes"``, ``1``) is refused, the same in every function that takes it."""
    if progress is None:
        return auto_progress()
    if not isinstance(progress, bool):
        raise ValueError(f"progress must be True, False or None (automatic), got {progress!r}.")
    return progress


def progress_bar(items: Iterable[T], progress: bool | None, desc: str, unit: str) -> Iterable[T]:
    """``items``, wrapped in a progress bar when asked (``None``: :func:`auto_progress`)."""
    if not check_progress(progress):
        return items
    from tqdm.auto import tqdm

    with warnings.catch_warnings():  # tqdm.auto without ipywidgets warns once per bar
        warnings.simplefilter("ignore")
        bar: Any = tqdm(items, desc=desc, unit=unit)
    return bar
