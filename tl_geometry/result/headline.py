"""The headline range of N (SPEC §3): ``2 ≤ N ≤ (t+1)/4``; a larger N is *dense* (computed,
plotted and shaded, never headlined). Also the reading of a top − null gap
(:func:`geometry_reading`) and which null a result's ``shuffled`` group is (:func:`shuffle_kind`).
"""

from __future__ import annotations

import math

from .protocol import AnalysisLike


def layer_windows(result: AnalysisLike) -> tuple[int | None, ...]:
    """``metadata["window"]``: the sliding window of each layer (SPEC §1, ours), ``None`` for a
    global one; all ``None`` when the result does not record them (made before the option)."""
    saved = result.metadata.get("window")
    n_layers = len(result.layers)
    if not isinstance(saved, (list, tuple)) or len(saved) != n_layers:
        return (None,) * n_layers
    return tuple(None if w is None else int(w) for w in saved)


def dense_from(result: AnalysisLike) -> float:
    """``|T_t|/4`` with ``|T_t| = metadata["n_positions"]`` or the narrowest sliding window if
    smaller (ours): a larger N is dense (SPEC §3). ``inf`` where not recorded."""
    n_positions = result.metadata.get("n_positions")
    if not isinstance(n_positions, int | float) or isinstance(n_positions, bool):
        return math.inf
    windows = [w for w in layer_windows(result) if w is not None]
    return min([n_positions, *windows]) / 4


def headline_n(result: AnalysisLike) -> tuple[int, ...]:
    """Analysed N in the headline range ``2 ≤ N ≤ (t+1)/4`` (SPEC §3; see :func:`dense_from`)."""
    limit = dense_from(result)
    return tuple(n for n in result.n_values.tolist() if 2 <= n <= limit)


def is_dense(result: AnalysisLike, n: int) -> bool:
    """``N > (t+1)/4``: the precision floor ``N/(t+1)`` lifts P_N and F_N there (SPEC §3)."""
    return n > dense_from(result)


def headline_text(result: AnalysisLike) -> str:
    """One line: the headline range and which analysed N it holds."""
    limit, ns = dense_from(result), result.headline_n
    held = f"N = {', '.join(map(str, ns))}" if ns else "no analysed N"
    if math.isinf(limit):
        return f"Headline range 2 ≤ N ≤ (t+1)/4, t+1 not recorded: every analysed N ≥ 2 ({held})."
    return (f"Headline range 2 ≤ N ≤ (t+1)/4 = {limit:g}: {held}; larger N is dense "
            "(precision cannot fall below N/(t+1)): shown, marked †, never headlined.")


def n_label(result: AnalysisLike, n: int) -> str:
    """``"8"``, or ``"64†"`` for a dense N."""
    return f"{n}†" if is_dense(result, n) else str(n)


#: (ours) The size of ``F(top) − F(null)`` below which a verdict calls the two equal; the gap
#: has two signs and both are read (SPEC §3, corrected reading).
GEOMETRY_GAP = 0.05

#: The three readings of a top − null gap, by :func:`geometry_reading`.
RAISES, LOWERS, EQUAL = "geometry raises separability", "geometry lowers separability", "equal"


def geometry_reading(gap: float, threshold: float = GEOMETRY_GAP) -> str:
    """What a gap ``F(top) − F(null)`` says (SPEC §3): ``≥ threshold`` → :data:`RAISES`,
    ``≤ −threshold`` → :data:`LOWERS` (a negative gap is geometry too, never "equal"), in
    between → :data:`EQUAL`; ``"undefined"`` for NaN."""
    if math.isnan(gap):
        return "undefined"
    if gap >= threshold:
        return RAISES
    if gap <= -threshold:
        return LOWERS
    return EQUAL


def shuffle_kind(result: AnalysisLike) -> str:
    """Which null the result's ``shuffled`` group is (SPEC §3): ``metadata["shuffle"]``;
    ``"values"`` for results made before the option (the only null there was)."""
    kind = result.metadata.get("shuffle", "values")
    return kind if isinstance(kind, str) else "values"
