"""Forward passes that end at the last hook an analysis reads: what comes after it (later blocks,
the logits: ``[batch, pos, d_vocab]`` floats, 4.3 GB for one 4,096-token Gemma-3 window) would be
computed for nothing, so that hook raises :class:`StopForward`.
"""

from __future__ import annotations

import contextlib
from typing import Any


class StopForward(BaseException):
    """Raised by the last hook an analysis reads. A ``BaseException`` (as ``KeyboardInterrupt``),
    so that a model whose forward catches ``Exception`` cannot swallow it."""


def forward_until_stopped(model: Any, tokens: Any, **kwargs: Any) -> None:
    """``model(tokens, **kwargs)``, up to the hook that raises :class:`StopForward` (the whole
    pass where none does); an error of the model's own passes through."""
    with contextlib.suppress(StopForward):
        model(tokens, **kwargs)
