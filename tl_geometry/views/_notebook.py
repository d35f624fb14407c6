"""circuitsvis's 1.3 MB script once per notebook, not once per widget output.

In a Jupyter kernel the first widget output carries the script (it defines ``window.CircuitsVis``)
and every later call waits in ``window.tlgPending`` until it has run, whatever order a frontend
draws the outputs in. When the cell that carries it runs again (by cell id, or source), the next
widget output carries it anew; after clearing it by hand, :func:`reset_notebook_bundle`. Outside
a kernel, and in Colab (separate frames), every output carries the script.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["bundle_in_this_output", "bundle_loader", "deferred_call", "in_notebook", "reset_notebook_bundle"]

#: Shown in a notebook widget until circuitsvis draws it (React replaces it). Plain text, no
#: element: the browser test counts element children of widget roots to see which rendered.
WAITING = (
    "This widget is drawn by circuitsvis's script, which the notebook's first widget output "
    "loads. If this text stays: trust the notebook, or run "
    "tl_geometry.views.reset_notebook_bundle() and re-run this cell."
)


def bundle_loader(bundle: str) -> str:
    """JavaScript that defines ``window.CircuitsVis`` from ``bundle`` (run inside a function that
    returns it) unless it is defined, then runs the widget calls waiting for it."""
    return (
        f"window.CircuitsVis=window.CircuitsVis||(function(){{\n{bundle}\n;return CircuitsVis}})();"
        "(window.tlgPending||[]).splice(0).forEach(function(f){f()});"
    )


def deferred_call(call: str) -> str:
    """``call`` (JavaScript using ``CircuitsVis``) now if the script ran, else once it has."""
    return (
        "(function(f){if(window.CircuitsVis)f();else(window.tlgPending=window.tlgPending||[])"
        f".push(f)}})(function(){{{call}}});"
    )


class _Tracker:
    """Which cell's output carries the script in this kernel (``None``: none does)."""

    def __init__(self) -> None:
        self.owner: tuple[str, str] | None = None
        self.shells: set[int] = set()

    def _pre_run_cell(self, info: Any) -> None:
        # The owner cell runs again: its outputs, the script included, are about to be replaced.
        if self.owner is not None and _key(getattr(info, "cell_id", None),
                                           getattr(info, "raw_cell", None)) == self.owner:
            self.owner = None

    def carry(self, shell: Any) -> bool:
        if id(shell) not in self.shells:
            shell.events.register("pre_run_cell", self._pre_run_cell)
            self.shells.add(id(shell))
        if self.owner is not None:
            return False
        self.owner = _current_key(shell)
        return True


_TRACKER = _Tracker()


def _key(cell_id: Any, source: Any) -> tuple[str, str]:
    if cell_id:
        return ("id", str(cell_id))
    return ("source", str(source or "").rstrip())


def _current_key(shell: Any) -> tuple[str, str]:
    """The running cell: its frontend cell id (JupyterLab, Notebook 7 and VS Code send one in
    the request's metadata), else its source as the kernel's history stored it."""
    try:
        cell_id = shell.kernel.get_parent().get("metadata", {}).get("cellId")
    except Exception:  # an unusual kernel: fall back on the source
        cell_id = None
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None) or [""]
    return _key(cell_id, history[-1])


def _kernel_shell() -> Any:
    """The IPython shell of a Jupyter kernel whose outputs share one page, else ``None``."""
    ipython = sys.modules.get("IPython")
    if ipython is None or "google.colab" in sys.modules:
        return None
    shell = ipython.get_ipython()
    return shell if getattr(shell, "kernel", None) is not None else None


def bundle_in_this_output() -> bool:
    """Whether the widget output being made now must carry circuitsvis's script."""
    shell = _kernel_shell()
    return True if shell is None else _TRACKER.carry(shell)


def in_notebook() -> bool:
    """Whether outputs go to a Jupyter kernel's shared page (widget calls must wait)."""
    return _kernel_shell() is not None


def reset_notebook_bundle() -> None:
    """Make the next widget output in this kernel carry circuitsvis's script again: after
    clearing by hand the output that carried it, then re-run any widget cell.

    >>> from tl_geometry import views
    >>> views.reset_notebook_bundle()
    """
    _TRACKER.owner = None
