"""When to show progress bars by default: in a terminal or a Jupyter kernel, not in logs or CI."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def auto_progress() -> bool:
    """True when stderr is a terminal or the code runs in a Jupyter (IPython kernel) session."""
    try:
        if sys.stderr is not None and sys.stderr.isatty():
            return True
    except (AttributeError, ValueError):
        pass
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    try:
        ip = shell.get_ipython()
    except Exception:
        return False
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def progress_bar(items: Iterable[T], progress: bool | None, desc: str, unit: str) -> Iterable[T]:
    """``items``, wrapped in a progress bar when asked (``None``: :func:`auto_progress`)."""
    if progress is None:
        progress = auto_progress()
    if not isinstance(progress, bool):
        raise ValueError(f"progress must be True, False or None (automatic), got {progress!r}.")
    if not progress:
        return items
    from tqdm.auto import tqdm

    with warnings.catch_warnings():  # tqdm.auto without ipywidgets warns once per bar
        warnings.simplefilter("ignore")
        bar: Any = tqdm(items, desc=desc, unit=unit)
    return bar
