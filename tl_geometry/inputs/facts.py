"""What the analyses read of a model (or a tokenizer) besides its weights, from its attributes and
config without a forward, in one place: :func:`model_facts`."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from .capture import hf_model_of, model_windows
from .models import BOS_ATTRIBUTE, model_label, model_names, stated_bos, warn_unstated_bos


@dataclass(frozen=True)
class ModelFacts:
    """What a model or tokenizer says of itself besides its weights (:func:`model_facts`), read
    from its attributes and config without a forward; ``None`` where it does not say. Its methods
    turn a fact that is missing into the warning or error that names the fix."""

    name: str  # how messages name the model
    bos: bool | None  # trained with BOS at the start of a sequence (SPEC §1; stated_bos)
    bos_id: int | None  # its tokenizer's BOS token id
    windows: tuple[int | None, ...] | None  # each layer's sliding window (None: a global layer)
    n_layers: int | None  # n_layers, n_heads and d_vocab: from model.cfg
    n_heads: int | None
    d_vocab: int | None
    can_recompute: bool  # a Hugging Face model to capture queries and keys from (itself or a bridge's)

    def trained_with_bos(self, warn: bool = True) -> bool:
        """:func:`~tl_geometry.inputs.models.trained_with_bos` of these facts."""
        if self.bos is None and warn:
            warn_unstated_bos(self.name)
        return bool(self.bos)

    def bos_to_prepend(self, warn: bool = True) -> int | None:
        """The token a sequence starts with: BOS where the model was trained with it, else ``None``."""
        return self.bos_token() if self.trained_with_bos(warn) else None

    def bos_token(self) -> int:
        """The tokenizer's BOS id; ``ValueError`` naming the fix where it has none."""
        if self.bos_id is None:
            raise ValueError(f"{self.name} was trained with BOS at the start of a sequence but its "
                             "tokenizer has no BOS token (bos_token_id is None); set "
                             "tokenizer.bos_token to the model's BOS token, or pass token ids that "
                             "start with it.")
        return self.bos_id

    def shape(self) -> tuple[int, int]:
        """``(n_layers, n_heads)``; ``ValueError`` naming the fix where ``model.cfg`` lacks them."""
        if self.n_layers is None or self.n_heads is None:
            raise ValueError("model.cfg must give n_layers and n_heads: pass a TransformerLens "
                             "TransformerBridge (tl_geometry.load_model) or HookedTransformer.")
        return self.n_layers, self.n_heads

    def layer_windows(self, n_layers: int) -> list[int | None]:
        """Each layer's sliding window (``None``: global); ``ValueError`` where the config names
        another number of layers than ``n_layers``."""
        if self.windows is not None and len(self.windows) != n_layers:
            raise ValueError(f"{self.name}'s config names {len(self.windows)} layers' sliding windows "
                             f"but the model has {n_layers} layers; check the config (layer_types).")
        return [None] * n_layers if self.windows is None else list(self.windows)


_FACTS: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], ModelFacts]] = weakref.WeakKeyDictionary()


def model_facts(model: Any) -> ModelFacts:
    """The :class:`ModelFacts` of ``model`` (a model or a tokenizer), memoised per object (held
    weakly) where BOS is stated, and read again once what says it may have changed (its or its
    tokenizer's ``tl_geometry_bos``, the tokenizer, its BOS id, its names).

    Example:
        >>> facts = tl_geometry.inputs.model_facts(model)            # doctest: +SKIP
        >>> facts.n_layers, facts.bos_id, facts.trained_with_bos()  # doctest: +SKIP
    """
    tokenizer = getattr(model, "tokenizer", None) or model
    bos_id = getattr(tokenizer, "bos_token_id", None)
    stamp: tuple[Any, ...] | None = (getattr(model, BOS_ATTRIBUTE, None), id(tokenizer),
                                     getattr(tokenizer, BOS_ATTRIBUTE, None), bos_id, *model_names(model))
    try:
        kept = _FACTS.get(model)
    except TypeError:  # unhashable, or no weak reference (a SimpleNamespace, a str): read every time
        kept, stamp = None, None
    if kept is not None and kept[0] == stamp:
        return kept[1]
    cfg, hf_model, windows = getattr(model, "cfg", None), hf_model_of(model), model_windows(model)
    n_layers, n_heads, d_vocab = (getattr(cfg, name, None) for name in ("n_layers", "n_heads", "d_vocab"))
    facts = ModelFacts(
        name=model_label(model), bos=stated_bos(model), bos_id=None if bos_id is None else int(bos_id),
        windows=None if windows is None else tuple(windows), n_layers=_size(n_layers),
        n_heads=_size(n_heads), d_vocab=_size(d_vocab),
        can_recompute=callable(getattr(hf_model, "get_input_embeddings", None)) and hasattr(hf_model, "config"))
    if stamp is not None and facts.bos is not None:
        _FACTS[model] = (stamp, facts)
    return facts


def _size(value: Any) -> int | None:
    """A size ``model.cfg`` states (a positive int), else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
