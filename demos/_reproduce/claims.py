"""The paper's claims 1–5, each turned into measures, tables, a figure and a verdict.

Every verdict rule is written out on the page and applied mechanically; thresholds that the paper
does not give are ours and are marked so. A rule is never adjusted to make a claim hold. The
claims live in their own modules: 1 in :mod:`.separability`, 2 and 3 in :mod:`.sink`, 4 in
:mod:`.certificates`, 5 in :mod:`.taxonomy`; 6 (ablation) in :mod:`.ablation`, 7 in
:mod:`.capacity`. The headline range of N and the verdict rule are in :mod:`.rules`.
"""

from __future__ import annotations

from .certificates import claim4
from .document import HELD, NOT_HELD, PARTLY
from .rules import verdict
from .separability import claim1
from .sink import claim2, claim3
from .taxonomy import claim5

CLAIMS = (claim1, claim2, claim3, claim4, claim5)

__all__ = ["CLAIMS", "HELD", "NOT_HELD", "PARTLY", "verdict"]
