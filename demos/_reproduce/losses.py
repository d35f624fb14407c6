"""What claims 6 and 7 share (SPEC §7–§8): each ablation and capacity loss is kept per window, a
resample of the windows recomputes every loss as the prediction-weighted mean over the drawn
windows (:func:`tl_geometry.functional.uncertainty.window_mean`), so a loss change, a relative
increase or a ρ over heads gets its seeded bootstrap interval from :func:`.intervals.bootstraps`
(the heads fixed); :func:`tally` counts the outcomes per model.
"""

from __future__ import annotations

from collections.abc import Sequence

from .document import HELD, NOT_HELD
from .intervals import UNDECIDED


def tally(outcomes: Sequence[str], unit: str = "models") -> str:
    """``held/all``, with the undecided ones and those without a verdict (too few windows, or a
    table saved without its per-window losses)."""
    held, undecided = outcomes.count(HELD), outcomes.count(UNDECIDED)
    none = len(outcomes) - held - undecided - outcomes.count(NOT_HELD)
    extra = ([f"{undecided} undecided"] * bool(undecided)
             + [f"{none} without a verdict: too few windows or no per-window losses"] * bool(none))
    return f"{held}/{len(outcomes)} {unit}" + (f" ({'; '.join(extra)})" if extra else "")


__all__ = ["tally"]
