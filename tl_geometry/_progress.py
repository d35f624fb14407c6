"""When to show a progress bar by default."""

from __future__ import annotations

import sys

__all__ = ["auto_progress"]


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
