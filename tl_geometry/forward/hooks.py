"""Hook lists on a TransformerLens model (:class:`HookContext`; ``ablation.HeadAblation`` and
``capacity.TopNAttention`` are two), and the checks every forward with hooks makes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from jaxtyping import Bool
from torch import Tensor

from ..inputs.facts import model_facts
from ..inputs.tokens import check_token_tensor

#: ``(hook_name, fn)`` pairs, as ``model.run_with_hooks(fwd_hooks=...)`` takes them.
HookList = list[tuple[str, Callable[..., Tensor]]]


def model_device(model: Any) -> torch.device:
    """The device of a TransformerLens model (``model.cfg.device``); CPU where it names none."""
    return torch.device(getattr(getattr(model, "cfg", None), "device", None) or "cpu")


def check_tokens(tokens: Any, name: str = "tokens", model: Any = None) -> Tensor:
    """``tokens`` must be ``[batch, pos]`` integer ids with data, at least one sequence of two
    tokens, and (with ``model``) ids inside its vocabulary: the check ``analyze_model`` makes, so
    no entry point fails with an ``IndexError`` from the embedding."""
    return check_token_tensor(tokens, name, model_facts(model).d_vocab, min_pos=2)


def head_mask(heads: Any, n_layers: int, n_heads: int) -> Bool[Tensor, "layer head"]:
    """``[layer, head]`` bool mask from ``(layer, head)`` pairs or from a bool mask itself.

    Pairs are checked for shape, range and duplicates, with the offending entry in the message.
    """
    if isinstance(heads, Tensor) and heads.dtype == torch.bool:
        if heads.shape != (n_layers, n_heads):
            raise ValueError(f"A head mask must be [n_layers, n_heads] = [{n_layers}, {n_heads}], "
                             f"got {tuple(heads.shape)}.")
        return heads.detach().cpu().clone()
    if isinstance(heads, Tensor):
        heads = heads.tolist()
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Iterable):
        raise ValueError(f"heads must be (layer, head) pairs, e.g. [(3, 4), (5, 0)], got {heads!r}.")
    mask = torch.zeros(n_layers, n_heads, dtype=torch.bool)
    for i, pair in enumerate(heads):
        if (not isinstance(pair, Sequence) or isinstance(pair, str) or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
            raise ValueError(f"heads[{i}] = {pair!r} is not a (layer, head) pair of ints.")
        layer, head = pair
        if not 0 <= layer < n_layers:
            raise ValueError(f"heads[{i}] = {tuple(pair)}: layer {layer} is out of range; "
                             f"the model has {n_layers} layers (0..{n_layers - 1}).")
        if not 0 <= head < n_heads:
            raise ValueError(f"heads[{i}] = {tuple(pair)}: head {head} is out of range; "
                             f"the model has {n_heads} query heads per layer (0..{n_heads - 1}).")
        if mask[layer, head]:
            raise ValueError(f"heads[{i}] = {tuple(pair)} is listed twice.")
        mask[layer, head] = True
    return mask


class HookContext(list):
    """``(hook_name, fn)`` pairs that also work as a context manager on their model.

    A list for ``model.run_with_hooks(tokens, fwd_hooks=...)``; ``with ...:`` adds the hooks and
    removes them on any exit, exception included. Re-entrant: each ``with`` removes its own.
    """

    model: Any
    _contexts: list[Any]
    #: The call that makes one, for the error message.
    _made_by = "..."

    @property
    def hooks(self) -> HookList:
        """The ``(hook_name, fn)`` pairs as a plain list."""
        return list(self)

    def __enter__(self) -> Any:
        context = self.model.hooks(fwd_hooks=list(self))
        context.__enter__()
        self._contexts.append(context)
        return self

    def __exit__(self, *exc: Any) -> Any:
        if not self._contexts:
            name = type(self).__name__
            raise RuntimeError(
                f"{name}.__exit__ was called without a matching __enter__: none of its hooks are "
                f"active. Use it as `with {self._made_by}: ...`, or pass it to "
                "model.run_with_hooks(tokens, fwd_hooks=...)."
            )
        return self._contexts.pop().__exit__(*exc)
