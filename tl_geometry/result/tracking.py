"""Does a bound track the measured F_N? (SPEC §6d, "Reading 'tracks'", ours): Spearman's ρ
within each headline N (:func:`rho_by_n`; pooling ``(head, N)`` pairs would inflate ρ through the
shared decline with N) and the best-N agreement against its chance level
(:func:`agreement_vs_chance`: a bound that always says N = 2 agrees often where most heads peak
there, and predicts nothing).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from ..functional.stats import spearman
from .headline import headline_n
from .protocol import AnalysisLike

#: Seeded shuffles behind the permutation p-value of a best-N agreement.
N_SHUFFLES = 1000
#: A best-N agreement "predicts" (ours) when it exceeds chance with a shuffle p-value at most this.
AGREEMENT_P = 0.05


class BestNAgreement(NamedTuple):
    """A bound's best-N agreement with the measured best N, against chance (SPEC §6d).

    ``agreement``: share of the ``heads`` (where both best Ns are defined) with the same best N;
    ``chance``: its expectation when the bound's best Ns are shuffled across those heads,
    ``Σ_n p_measured(n) p_bound(n)`` (exact); ``p_value``: ``(1 + #{shuffles agreeing at least as
    often}) / (1 + n_shuffles)`` over seeded shuffles. NaN where no head has both defined.
    """

    agreement: float
    chance: float
    p_value: float
    heads: int
    n_shuffles: int

    @property
    def excess(self) -> float:
        """``agreement − chance``: what the bound predicts beyond the two distributions of best N."""
        return self.agreement - self.chance

    @property
    def above_chance(self) -> bool:
        """Agreement above chance with a shuffle p-value ≤ :data:`AGREEMENT_P` (ours); an
        agreement at or below chance predicts nothing."""
        return self.excess > 0 and self.p_value <= AGREEMENT_P

    def text(self) -> str:
        """``"64.8 % of 270 heads (chance 58.2 %, excess +6.6 points, shuffle p = 0.012)"``."""
        if not self.heads:
            return "undefined (no head with both best Ns)"
        return (f"{100 * self.agreement:.1f} % of {self.heads} heads (chance {100 * self.chance:.1f} %, "
                f"excess {100 * self.excess:+.1f} points, shuffle p = {self.p_value:.3f})")


def agreement_vs_chance(
    measured: Float[Tensor, "*head"], predicted: Float[Tensor, "*head"], *,
    n_shuffles: int = N_SHUFFLES, seed: int = 0,
) -> BestNAgreement:
    """Best-N agreement of ``predicted`` with ``measured`` (per head, NaN where undefined) over
    the heads where both are defined, its exact chance level ``Σ_n p_measured(n) p_predicted(n)``
    and the permutation p-value over ``n_shuffles`` shuffles seeded with ``seed``."""
    if isinstance(n_shuffles, bool) or not isinstance(n_shuffles, int) or n_shuffles < 1:
        raise ValueError(f"n_shuffles must be a positive int, got {n_shuffles!r}.")
    a, b = measured.flatten().double(), predicted.flatten().double()
    keep = ~torch.isnan(a) & ~torch.isnan(b)
    a, b = a[keep], b[keep]
    k = int(keep.sum())
    if not k:
        return BestNAgreement(math.nan, math.nan, math.nan, 0, n_shuffles)
    agreement = float((a == b).double().mean())
    values = torch.unique(torch.cat([a, b]))
    p_a = (a[None, :] == values[:, None]).double().mean(-1)
    p_b = (b[None, :] == values[:, None]).double().mean(-1)
    chance = float((p_a * p_b).sum())
    gen = torch.Generator().manual_seed(seed)
    perm = torch.rand(n_shuffles, k, generator=gen).argsort(-1)
    shuffled = (b[perm] == a[None, :]).double().mean(-1)
    # A tolerance below 1/k: equal shares computed from equal counts are equal.
    p_value = (1 + int((shuffled >= agreement - 0.5 / k).sum())) / (1 + n_shuffles)
    return BestNAgreement(agreement, chance, p_value, k, n_shuffles)


def rho_by_n(result: AnalysisLike, kind: str = "shell_n", metric: str = "f_score"):
    """Per headline N (SPEC §3), Spearman's ρ across heads between the mean bound ``kind`` on
    ``metric`` and the measured mean ``metric``, as a ``DataFrame`` ``n, rho, heads`` (heads
    with both finite; ρ is NaN with fewer than 3 or a constant side). Never pooled over N."""
    import pandas as pd

    bound, measured = result.bound(kind, metric), result.metric(metric)
    ns = result.n_values.tolist()
    rows = []
    for n in headline_n(result):
        i = ns.index(n)
        x, y = bound[..., i], measured[..., i]
        rows.append({"n": n, "rho": spearman(x, y), "heads": int((x.isfinite() & y.isfinite()).sum())})
    return pd.DataFrame(rows, columns=["n", "rho", "heads"])

