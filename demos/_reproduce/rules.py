"""What every claim's rule shares: the verdict from per-run checks, the runs of a study, and the
headline range of N.

**Headline range** (SPEC §3): ``2 ≤ N ≤ (t+1)/4``, with ``t+1`` the number of keys of the analysed
query (the last query of a window: ``t+1`` = the window length, ``metadata["n_positions"]``).
``N = 1`` is trivial (Euclidean ``F_1 = 1``); larger ``N`` is "dense": precision cannot fall below
its floor ``N/(t+1)`` there, so raw scores rise for reasons that are not geometry. Dense N are
computed, plotted and shaded, never used by a verdict.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch import Tensor

from tl_geometry.result.tracking import agreement_vs_chance

from .document import HELD, NOT_HELD, PARTLY

HEADLINE = "2 ≤ N ≤ (t+1)/4"  # how the page names the range
SMALL_N = (2, 4, 8)  # the N at which claims 3 and 4 read per-head figures (inside the headline range)


def verdict(per_run: dict[str, list[bool]], core: str) -> str:
    """Held when every check holds on every run; not held when ``core`` holds on none; else
    partly held."""
    if all(all(v) for v in per_run.values()):
        return HELD
    return NOT_HELD if not any(per_run[core]) else PARTLY


def ticks(ok: bool) -> str:
    return "yes" if ok else "**no**"


def runs(study: Any) -> Iterator[tuple[str, str, Any]]:
    """``(model, corpus, analysis)`` of every run of the study, in order."""
    for (model, corpus), result in study.analyses.items():
        yield model, corpus, result


def keys_of_query(result: Any, default: int | None = None) -> int:
    """``t+1`` of the analysed (last) query: ``metadata["n_positions"]``, else ``default``."""
    value = result.metadata.get("n_positions", default)
    if value is None:
        raise ValueError("the analysis has no metadata['n_positions'] and no default was given.")
    return int(value)


def headline_ns(ns: Sequence[int], keys: int) -> list[int]:
    """The N of ``ns`` inside the headline range ``2 ≤ N ≤ keys/4`` (SPEC §3), in order."""
    return [n for n in ns if n >= 2 and 4 * n <= keys]


def headline(result: Any, default_keys: int | None = None) -> list[int]:
    """Positions (along ``n_values``) of the headline N of ``result``.

    Uses ``result.headline_n`` (the library's definition) where the result has it, and the same
    rule on ``metadata["n_positions"]`` (else ``default_keys``) for other result-like objects.
    """
    ns = result.n_values.tolist()
    chosen = getattr(result, "headline_n", None)
    if chosen is None:
        chosen = headline_ns(ns, keys_of_query(result, default_keys))
    return [ns.index(int(n)) for n in chosen]


def small_n(result: Any, default_keys: int | None = None) -> list[tuple[int, int]]:
    """``(N, position)`` of each of :data:`SMALL_N` that was analysed and lies in the headline range."""
    ns = result.n_values.tolist()
    inside = set(headline(result, default_keys))
    return [(n, ns.index(n)) for n in SMALL_N if n in ns and ns.index(n) in inside]


def agreement(a: Tensor, b: Tensor) -> tuple[float, float, int]:
    """``(share, chance, count)`` for two per-head best-N tensors: the share of heads where both
    are defined and equal, the share expected if one were shuffled across those heads
    (``Σ_n p_a(n) p_b(n)``, SPEC §6d), and the number of heads where both are defined — the
    library's :func:`tl_geometry.result.tracking.agreement_vs_chance`."""
    best = agreement_vs_chance(a, b)
    return best.agreement, best.chance, best.heads
