"""Shared by the benchmark scripts: the real text they run on and how they write results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-test.txt"
RESULTS = ROOT / "benchmarks" / "results"


def real_text() -> tuple[str | None, str]:
    """WikiText-2 test when ../shared/data has it (else None: the built-in sample), and its name."""
    if WIKITEXT.exists():
        return WIKITEXT.read_text(encoding="utf-8"), "wikitext-2-test"
    return None, "built-in sample"


def write_report(report: dict, out: str | Path) -> None:
    """Print the report as JSON and save it to ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"wrote {out}", file=sys.stderr)
