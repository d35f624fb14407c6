"""``tl_geometry.inputs.from_nnsight``, checked in a process of its own (tests/nnsight_checks.py).

Importing nnsight gives every Python object a ``save`` method (it patches ``object``), which no
later test of this session could undo: argparse, for one, then leaves an option named ``save``
without its default. So nnsight is never imported here; its checks run in a child pytest.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from repo_paths import TESTS

CHECKS = TESTS / "nnsight_checks.py"


@pytest.mark.skipif(importlib.util.find_spec("nnsight") is None, reason="nnsight is not installed")
def test_from_nnsight_in_its_own_process(request):
    marks = request.config.option.markexpr  # e.g. dev.sh test --fast: the child leaves out the same
    proc = subprocess.run([sys.executable, "-m", "pytest", str(CHECKS), "-q", "-p", "no:cacheprovider",
                           *(["-m", marks] if marks else [])],
                          cwd=CHECKS.parent.parent, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
