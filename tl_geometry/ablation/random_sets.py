"""A set of heads against random sets of the same size (SPEC §7 uncertainty, ours).

Removing a set of heads raises the loss by ``ΔL``; is that more than removing as many heads
picked at random? :func:`ablation_vs_random` ablates the set and ``n_random`` random sets of the
same size (from all heads, or from the same layers) in batched forwards and reports the random
sets' mean and sd, ``z`` and an empirical p-value.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..forward import hooks as _forward
from ..functional.uncertainty import empirical_p, null_z, paired_window_se
from . import hooks as _hooks
from .hooks import Mode
from .run import ablated_losses, positive_int, prepare_ablation


@dataclass
class AblationVsRandom:
    """The loss increase of one set of heads next to that of random sets of the same size.

    ``heads`` is the set (sorted ``(layer, head)`` pairs); ``loss_increase`` its ``ΔL`` and
    ``loss_increase_se`` the standard error over windows (paired, SPEC §7);
    ``random_sets[r]`` (``[layer, head]`` bool) and ``random_increase[r]`` /
    ``random_increase_se[r]`` the same for random set ``r``. The summary figures are
    properties: :attr:`random_mean`, :attr:`random_sd`, :attr:`z`, :attr:`p_value`.
    """

    heads: list[tuple[int, int]]
    base_loss: float
    loss: float
    loss_increase_se: float
    random_sets: Bool[Tensor, "sample layer head"]
    random_loss: Float[Tensor, " sample"]
    random_increase_se: Float[Tensor, " sample"]
    same_layers: bool = False
    seed: int = 0
    mode: str = "zero"
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def loss_increase(self) -> float:
        """``ΔL = L(set ablated) − L(dense)``."""
        return self.loss - self.base_loss

    @property
    def random_increase(self) -> Float[Tensor, " sample"]:
        """``ΔL`` of each random set."""
        return self.random_loss - self.base_loss

    @property
    def n_random(self) -> int:
        return int(self.random_loss.numel())

    @property
    def random_mean(self) -> float:
        """Mean ``ΔL`` of the random sets (the null's mean)."""
        return null_z(self.loss_increase, self.random_increase)[0]

    @property
    def random_sd(self) -> float:
        """Sample sd (``n − 1``) of the random sets' ``ΔL``; NaN for fewer than 2 sets."""
        return null_z(self.loss_increase, self.random_increase)[1]

    @property
    def z(self) -> float:
        """``(ΔL − random_mean) / random_sd``; NaN where the sd is NaN or 0."""
        return null_z(self.loss_increase, self.random_increase)[2]

    @property
    def p_value(self) -> float:
        """One-sided empirical p-value ``(1 + #{random ΔL ≥ ΔL}) / (1 + n_random)``: how often
        random sets of the same size hurt at least as much (never below ``1 / (1 + n_random)``)."""
        return empirical_p(self.loss_increase, self.random_increase)

    def to_pandas(self):
        """One row per set: ``set`` (``"chosen"`` or ``"random"``), ``sample`` (the random set's
        index; <NA> for the chosen set), ``heads`` (``"L1H5 L3H0"``), ``loss``,
        ``loss_increase``, ``loss_increase_se``."""
        import pandas as pd

        rows = [{"set": "chosen", "sample": None, "heads": _names(self.heads), "loss": self.loss,
                 "loss_increase": self.loss_increase, "loss_increase_se": self.loss_increase_se}]
        for r in range(self.n_random):
            pairs = [tuple(p) for p in self.random_sets[r].nonzero().tolist()]
            rows.append({"set": "random", "sample": r, "heads": _names(pairs),
                         "loss": float(self.random_loss[r]),
                         "loss_increase": float(self.random_increase[r]),
                         "loss_increase_se": float(self.random_increase_se[r])})
        table = pd.DataFrame(rows)
        table["sample"] = table["sample"].astype("Int64")
        return table

    def summary(self) -> str:
        """One paragraph: the set's ΔL ± SE against the random sets' mean ± sd, z and p."""
        where = "the same layers" if self.same_layers else "all heads"
        return (f"{len(self.heads)} heads {self.mode}-ablated: ΔL = {self.loss_increase:+.4f} ± "
                f"{self.loss_increase_se:.4f} (SE over windows); {self.n_random} random sets of "
                f"{len(self.heads)} heads from {where} (seed {self.seed}): mean "
                f"{self.random_mean:+.4f}, sd {self.random_sd:.4f}; z = {self.z:.2f}, "
                f"empirical p = {self.p_value:.3g}")

    def __repr__(self) -> str:
        return f"AblationVsRandom({self.summary()})"


def _names(pairs: Iterable[tuple[int, int]]) -> str:
    return " ".join(f"L{layer}H{head}" for layer, head in pairs)


def random_head_sets(
    chosen: Bool[Tensor, "layer head"], n_random: int, *, same_layers: bool = False, seed: int = 0
) -> Bool[Tensor, "sample layer head"]:
    """``n_random`` random sets with as many heads as ``chosen``: uniform over all heads, or,
    with ``same_layers``, uniform inside each layer with the same count per layer as
    ``chosen``. Seeded (``torch.Generator().manual_seed(seed)``): the same seed gives the same
    sets. A random set may coincide with ``chosen``; each is drawn independently.
    """
    n_layers, n_heads = chosen.shape
    gen = torch.Generator().manual_seed(seed)
    if same_layers:
        keys = torch.rand(n_random, n_layers, n_heads, generator=gen)
        rank = keys.argsort(-1).argsort(-1)  # a uniform permutation of each layer's heads
        return rank < chosen.sum(-1)[None, :, None]
    keys = torch.rand(n_random, n_layers * n_heads, generator=gen)
    rank = keys.argsort(-1).argsort(-1)
    return (rank < int(chosen.sum())).reshape(n_random, n_layers, n_heads)


def ablation_vs_random(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    heads: Iterable[tuple[int, int]] | Bool[Tensor, "layer head"],
    *,
    n_random: int = 100,
    same_layers: bool = False,
    seed: int = 0,
    mode: Mode = "zero",
    attention_mask: Tensor | None = None,
    reference_tokens: Tensor | None = None,
    reference_attention_mask: Tensor | None = None,
    batch_size: int | None = None,
    progress: bool = True,
) -> AblationVsRandom:
    """Loss increase of ablating ``heads`` together, against random sets of the same size
    (SPEC §7, ours).

    The set and ``n_random`` random sets of ``|heads|`` heads each — drawn uniformly from all
    heads, or with ``same_layers=True`` from the same layers with the same count per layer
    (:func:`random_head_sets`, seeded) — are ablated on ``tokens``, each as one replica of the
    batch in the stacked forwards of :func:`head_sensitivity` (``batch_size`` replicas per
    forward; default: by memory budget). Reported: ``ΔL`` of the set with its SE over windows
    (paired), and against the random sets' ``ΔL``: their mean and sample sd,
    ``z = (ΔL − mean) / sd`` and the one-sided empirical p-value
    ``(1 + #{random ΔL ≥ ΔL}) / (1 + n_random)``.

    Args:
        heads: ``(layer, head)`` pairs or a ``[n_layers, n_heads]`` bool mask (not empty).
        n_random: number of random sets (≥ 1; the p-value cannot go below ``1/(1 + n_random)``).
        mode: ``"zero"`` or ``"mean"`` (means over ``reference_tokens``, default ``tokens``).

    Examples:
        >>> cmp = tl_geometry.ablation.ablation_vs_random(model, tokens, [(1, 5), (1, 4)],  # doctest: +SKIP
        ...                                           n_random=50)
        >>> cmp.z, cmp.p_value; print(cmp.summary())                                         # doctest: +SKIP
    """
    # The model's hook_z is checked below, once the heads are known to be valid.
    tokens, n_layers, n_heads, progress = prepare_ablation(
        model, tokens, mode, reference_tokens, reference_attention_mask, progress, check_hooks=False)
    positive_int("n_random", n_random)
    positive_int("batch_size", batch_size, allow_none=True)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}.")
    chosen = _forward.head_mask(heads, n_layers, n_heads)
    if not chosen.any():
        raise ValueError("heads is empty: give the (layer, head) pairs of the set to compare, e.g. [(1, 5)].")
    _hooks.check_hooks(model, range(n_layers))
    start = time.perf_counter()
    sets = random_head_sets(chosen, n_random, same_layers=same_layers, seed=seed)
    base, dense, windows = ablated_losses(
        model, tokens, torch.cat([chosen[None], sets]), mode, attention_mask=attention_mask,
        reference_tokens=reference_tokens, reference_attention_mask=reference_attention_mask,
        per_forward=batch_size, progress=progress, label="ablation vs random", unit="set")
    assert windows is not None  # the chosen set is not empty
    se = paired_window_se(windows.loss - dense.loss, dense.weight)
    total = windows.total
    metadata = {"tokens": list(tokens.shape), "n_windows": int((dense.weight > 0).sum()),
                "seconds": time.perf_counter() - start, "masked": attention_mask is not None}
    return AblationVsRandom(
        heads=[tuple(p) for p in chosen.nonzero().tolist()], base_loss=base, loss=float(total[0]),
        loss_increase_se=float(se[0]),
        random_sets=sets, random_loss=total[1:], random_increase_se=se[1:],
        same_layers=bool(same_layers), seed=seed, mode=mode, metadata=metadata,
    )
