"""Where the tests find the repository and the shared helpers, whatever folder of tests/ a test
module sits in (tests/<package folder>/test_*.py)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent  # the shared helpers: cases.py, reference.py, data/, ...
REPO = TESTS.parent  # docs/, demos/, benchmarks/, scripts/, pyproject.toml
