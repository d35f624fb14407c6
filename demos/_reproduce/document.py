"""The Markdown page: one :class:`Claim` section per claim with its verdict, a tiny table
formatter (no tabulate) and number formatting."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

#: The three verdicts a claim's rule can give.
HELD, PARTLY, NOT_HELD = "held", "partly held", "not held"


@dataclass
class Claim:
    """One claim's section of the page."""

    number: int
    title: str
    paper: str
    rule: str
    verdict: str
    because: str
    blocks: list[str] = field(default_factory=list)  # Markdown tables and paragraphs
    figures: list[tuple[str, str]] = field(default_factory=list)  # (file name, caption)
    disagreements: list[str] = field(default_factory=list)  # plain sentences, with numbers


def fmt(x: float | None, digits: int = 3) -> str:
    """A number for a table: fixed digits, ``–`` for NaN/None."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, (int,)) and not isinstance(x, bool):
        return str(x)
    return f"{x:.{digits}f}"


def pct(x: float | None, digits: int = 1) -> str:
    """A fraction as a percentage."""
    return "–" if x is None or math.isnan(x) else f"{100 * x:.{digits}f} %"


def _numeric(cell: object) -> bool:
    """Whether a cell reads as a number (a count, a fraction, a percentage, a ratio)."""
    text = str(cell).replace("%", "").replace("/", "").replace("–", "0").replace(" ", "")
    try:
        float(text.lstrip("+-"))
    except ValueError:
        return False
    return True


def table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A GitHub Markdown table; ``align`` holds one of ``l r c`` per column (default: numeric
    columns right, the others left)."""
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"Row {row!r} has {len(row)} cells, the header {len(header)}.")
    align = align or "".join("r" if rows and all(_numeric(row[i]) for row in rows) else "l"
                             for i in range(len(header)))
    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(marks[a] for a in align) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines)


def page(header: Sequence[str], claims: Sequence[Claim], figure_dir: str,
         sections: Sequence[str] = ()) -> str:
    """The results page: ``header`` paragraphs, a verdict table, the disagreements, ``sections``
    (Markdown lines, e.g. the size comparison), then one section per claim with its rule, tables
    and figures (``figure_dir`` relative to the page)."""
    out = list(header)
    out += ["## Verdicts", "", table(
        ["claim", "verdict", "numbers"],
        [[f"{c.number}. {c.title}", f"**{c.verdict}**", c.because] for c in claims], "llr"), ""]
    disagree = [c for c in claims if c.verdict != HELD]
    out += ["## Where our models disagree with the paper", ""]
    for c in disagree:
        out.append(f"- **Claim {c.number} ({c.verdict}).** " + (" ".join(c.disagreements) or c.because))
    if not disagree:
        out.append("- Nowhere: every claim held under the rules below.")
    out.append("")
    out += sections
    for c in claims:
        out += [f"## Claim {c.number}: {c.title}", "", f"> {c.paper}", "",
                f"**Rule.** {c.rule}", "", f"**Verdict: {c.verdict}.** {c.because}", ""]
        for block in c.blocks:
            out += [block, ""]
        for name, caption in c.figures:
            out += [f"![{caption}]({figure_dir}/{name})", "", f"*{caption}*", ""]
    return "\n".join(out).rstrip() + "\n"
