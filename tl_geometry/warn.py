"""Warnings that point at the caller's line, not at the library frame that noticed the problem."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import FrameType

_PACKAGE = str(Path(__file__).resolve().parent)


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` with the stack level of the first frame outside this package (what
    ``skip_file_prefixes`` does from Python 3.12 on), however deep the call that warns."""
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level + 1)
