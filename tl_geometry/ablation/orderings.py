"""Head removal orders for structured sparsification (SPEC §7): first removed first.

Five families: the taxonomy-informed order (ours, see ``docs/ablation.md``), weight magnitude,
attention entropy, random permutations, and the single-head sensitivity oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..forward import hooks as _forward
from ..functional.heads import kv_head_index
from ..functional.taxonomy import CLASSES, labels_from_votes
from ..inputs.cache import check_attention_mask
from ..inputs.facts import model_facts
from . import hooks as _hooks
from .sensitivity import HeadSensitivity

#: The head removal orders that ``head_orderings`` builds, by name.
ORDERINGS = ("taxonomy", "weight_norm", "entropy", "random", "oracle")
#: Taxonomy order (ours): Mixers go first, then Resets, Retrievers last.
TAXONOMY_REMOVAL = ("Mixer", "Reset", "Retriever")
PATTERN_HOOK = "blocks.{layer}.attn.hook_pattern"


class Ordering(NamedTuple):
    """A full removal order: ``heads[0]`` is removed first. ``seed`` is set for random orders."""

    name: str
    heads: tuple[tuple[int, int], ...]
    seed: int | None = None


def _pairs(flat: Int[Tensor, " k"], n_heads: int) -> tuple[tuple[int, int], ...]:
    return tuple((i // n_heads, i % n_heads) for i in flat.tolist())


def _argsort(score: Float[Tensor, "layer head"]) -> Int[Tensor, " k"]:
    """Flat head indices by increasing score; NaN last; ties by (layer, head)."""
    return torch.nan_to_num(score.double().flatten(), nan=float("inf")).argsort(stable=True)


def _ascending(score: Float[Tensor, "layer head"]) -> tuple[tuple[int, int], ...]:
    return _pairs(_argsort(score), score.shape[1])


def taxonomy_order(analysis: Any, *, n: int = 2) -> Ordering:
    """Remove by class (Mixer, then Reset, then Retriever), inside a class by F-gain at ``N=n``.

    (ours, why in ``docs/ablation.md``) ``analysis`` is a :class:`~tl_geometry.HeadAnalysis` of
    every layer. A head's class is its plurality source-winner label (SPEC §5); inside a class,
    the smallest ``F_n − F_n^random`` goes first and NaN last. Unlabelled heads (no votes) go
    after every class: with no evidence of what they do, never as the Retrievers an all-zero
    vote would tie to.

    Examples:
        >>> tl_geometry.taxonomy_order(result).heads[:3]      # doctest: +SKIP
    """
    layers = tuple(getattr(analysis, "layers", ()))
    if layers != tuple(range(len(layers))) or not layers:
        raise ValueError(f"The taxonomy order needs an analysis of every layer from 0; got layers {layers}.")
    values = analysis.n_values.tolist()
    if n not in values:
        raise ValueError(f"The analysis has no N={n} (n_values {values}); analyse with n_values including {n}.")
    gain = analysis.f_gain[:, :, values.index(n)]
    # Index UNLABELLED (−1) reads the last entry: the rank after every class.
    rank_of_class = torch.tensor([TAXONOMY_REMOVAL.index(c) for c in CLASSES] + [len(TAXONOMY_REMOVAL)])
    klass = rank_of_class[labels_from_votes(analysis.vote_counts)]
    # Two stable sorts: by F-gain, then by class; the class sort keeps the F-gain order inside.
    by_gain = _argsort(gain)
    order = by_gain[klass.flatten()[by_gain].argsort(stable=True)]
    return Ordering("taxonomy", _pairs(order, gain.shape[1]))


def weight_norms(model: Any) -> Float[Tensor, "layer head"]:
    """``‖W_V^h‖_F · ‖W_O^h‖_F`` per query head; under GQA ``W_V^h`` is its KV head's."""
    n_layers, n_heads = model_facts(model).shape()
    try:
        W_V, W_O = model.W_V, model.W_O
    except (AttributeError, NotImplementedError) as err:
        raise ValueError("The weight-norm order needs model.W_V and model.W_O (TransformerLens "
                         f"stacked weights): {err}") from None
    with torch.no_grad():
        v = W_V.detach().float().flatten(2).norm(dim=-1).cpu()  # [layer, head or kv_head]
        o = W_O.detach().float().flatten(2).norm(dim=-1).cpu()  # [layer, head]
    if o.shape != (n_layers, n_heads) or v.shape[0] != n_layers:
        raise ValueError(f"W_V {tuple(W_V.shape)} / W_O {tuple(W_O.shape)} do not match "
                         f"{n_layers} layers × {n_heads} heads.")
    if v.shape[1] != n_heads:
        v = v[:, kv_head_index(n_heads, v.shape[1])]
    return v * o


def weight_norm_order(model: Any) -> Ordering:
    """Smallest ``‖W_V^h‖_F · ‖W_O^h‖_F`` first (:func:`weight_norms`).

    Examples:
        >>> tl_geometry.weight_norm_order(model).heads[:3]    # doctest: +SKIP
    """
    return Ordering("weight_norm", _ascending(weight_norms(model)))


@torch.no_grad()
def attention_entropy(
    model: Any, tokens: Int[Tensor, "batch pos"], attention_mask: Tensor | None = None
) -> Float[Tensor, "layer head"]:
    """Mean attention entropy ``−Σ_i α_i log α_i`` (nats) per head over valid queries ``t ≥ 1``
    (a sequence's first real token attends only to itself, entropy 0 for every head), reduced
    inside the hooks: no cache is built."""
    tokens = _forward.check_tokens(tokens, model=model)
    n_layers, n_heads = model_facts(model).shape()
    valid = check_attention_mask(attention_mask, *tokens.shape)
    queries = valid & (valid.cumsum(-1) >= 2)
    if not queries.any():
        raise ValueError("No query has a key besides itself: the windows need ≥ 2 real tokens.")
    device = _forward.model_device(model)
    keep = queries.to(device)[:, None, :]
    n_queries = int(queries.sum())
    out = torch.zeros(n_layers, n_heads, dtype=torch.float64)

    def capture(layer: int):
        def hook(pattern: Tensor, hook: Any = None) -> None:
            entropy = -torch.special.xlogy(pattern.double(), pattern.double()).sum(-1)  # [b, head, q]
            # where, not a 0/1 weight: a padded query's row may be NaN (fully masked), NaN · 0 = NaN.
            out[layer] = (torch.where(keep, entropy, 0.0).sum(dim=(0, 2)) / n_queries).cpu()

        return hook

    fwd = [(PATTERN_HOOK.format(layer=layer), capture(layer)) for layer in range(n_layers)]
    kwargs = {} if attention_mask is None else {"attention_mask": valid.long().to(device)}
    with model.hooks(fwd_hooks=fwd):
        model(tokens.to(device), return_type=None, **kwargs)
    return out


def entropy_order(model: Any, tokens: Tensor, attention_mask: Tensor | None = None) -> Ordering:
    """Highest mean attention entropy first (:func:`attention_entropy`): diffuse heads average
    over the context and are removed before sharply focused ones (see ``docs/ablation.md``).

    Examples:
        >>> tl_geometry.entropy_order(model, tokens).heads[:3]   # doctest: +SKIP
    """
    return Ordering("entropy", _ascending(-attention_entropy(model, tokens, attention_mask)))


def random_order(n_layers: int, n_heads: int, seed: int) -> Ordering:
    """A uniformly random permutation of all heads from ``torch.Generator().manual_seed(seed)``."""
    generator = torch.Generator().manual_seed(seed)
    return Ordering("random", _pairs(torch.randperm(n_layers * n_heads, generator=generator), n_heads), seed)


def oracle_order(sensitivity: HeadSensitivity) -> Ordering:
    """Smallest single-head loss increase first (:func:`head_sensitivity` on all heads)."""
    if sensitivity.loss.isnan().any():
        raise ValueError("The oracle order needs every head scored: run head_sensitivity without heads=.")
    return Ordering("oracle", _ascending(sensitivity.loss_increase))


def head_orderings(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    *,
    attention_mask: Tensor | None = None,
    which: Sequence[str] = ORDERINGS,
    seeds: Sequence[int] = (0, 1, 2),
    analysis: Any = None,
    sensitivity: HeadSensitivity | None = None,
    n: int = 2,
    mode: _hooks.Mode = "zero",
    progress: bool = True,
) -> list[Ordering]:
    """The removal orders named in ``which``, computed on ``tokens`` (keep them apart from the
    held-out tokens of :func:`sparsification_curve`): ``"taxonomy"`` uses ``analysis`` (else
    :func:`tl_geometry.analyze_model` at ``n_values=(n,)``), ``"oracle"`` ``sensitivity`` (else
    a full :func:`head_sensitivity` in ``mode``), ``"random"`` one order per seed.

    Examples:
        >>> orders = tl_geometry.ablation.head_orderings(model, tokens)          # doctest: +SKIP
        >>> [o.name for o in orders]
        ['taxonomy', 'weight_norm', 'entropy', 'random', 'random', 'random', 'oracle']
    """
    unknown = [w for w in which if w not in ORDERINGS]
    if unknown:
        raise ValueError(f"Unknown ordering(s) {unknown}; choose from {ORDERINGS}.")
    n_layers, n_heads = model_facts(model).shape()
    out: list[Ordering] = []
    for name in which:
        if name == "taxonomy":
            if analysis is None:
                from ..analyze.from_model import analyze_model

                analysis = analyze_model(model, tokens, attention_mask=attention_mask, n_values=(n,),
                                         progress=progress)
            out.append(taxonomy_order(analysis, n=n))
        elif name == "weight_norm":
            out.append(weight_norm_order(model))
        elif name == "entropy":
            out.append(entropy_order(model, tokens, attention_mask))
        elif name == "random":
            if not seeds:
                raise ValueError("The random ordering needs at least one seed.")
            out.extend(random_order(n_layers, n_heads, int(s)) for s in seeds)
        else:
            if sensitivity is None:
                from .sensitivity import head_sensitivity

                sensitivity = head_sensitivity(model, tokens, mode, attention_mask=attention_mask,
                                               progress=progress)
            out.append(oracle_order(sensitivity))
    return out
