"""Forward passes that end at the last hook an analysis reads.

An analysis reads a model through hooks on its blocks. What comes after the last of them (later
blocks, the unembedding, the logits: ``[batch, pos, d_vocab]`` floats, 4.3 GB for one
4,096-token Gemma-3 window) would be computed for nothing, so that hook raises
:class:`StopForward` and :func:`forward_until_stopped` ends the pass there.
"""

from __future__ import annotations

from typing import Any


class StopForward(BaseException):
    """Raised by the last hook an analysis reads. A ``BaseException`` (as ``KeyboardInterrupt``),
    so that a model whose forward catches ``Exception`` cannot swallow it."""


def forward_until_stopped(model: Any, tokens: Any, **kwargs: Any) -> None:
    """``model(tokens, **kwargs)``, up to the hook that raises :class:`StopForward` (the whole
    pass where none does); an error of the model's own passes through."""
    try:
        model(tokens, **kwargs)
    except StopForward:
        pass
