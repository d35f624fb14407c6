"""The type checker sees the attribute shortcuts of ``HeadAnalysis``: ``result.f_score`` is a
``Tensor``, a misspelt shortcut is an error (mypy with the package's own settings)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest
from repo_paths import REPO

pytest.importorskip("mypy")

ROOT = REPO

SNIPPET = textwrap.dedent("""\
    from torch import Tensor
    from typing_extensions import assert_type

    import tl_geometry


    def misspelt(r: tl_geometry.HeadAnalysis) -> None:
        r.f_scroe


    def declared(r: tl_geometry.HeadAnalysis) -> Tensor:
        assert_type(r.f_score, Tensor)
        assert_type(r.certified_f_score, Tensor)
        return r.f_score + 1
""")


def test_mypy_types_the_shortcuts_and_rejects_a_misspelt_one(tmp_path):
    # A module name of its own: mypy's cache remembers a module's file, and a "snippet" cached by
    # an earlier run in another temporary folder would have its errors reported against that path.
    snippet = tmp_path / f"snippet_{uuid.uuid4().hex}.py"
    snippet.write_text(SNIPPET)
    # Run from the repository root: mypy finds tl_geometry there, and reuses the cache of
    # `mypy tl_geometry` (the lint step), so only the snippet is checked anew.
    run = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                          "--no-error-summary", "--show-error-codes", str(snippet)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    # Only the snippet's own errors: those of the package are the lint step's concern.
    errors = [line for line in run.stdout.splitlines() if line.startswith(f"{snippet}:") and ": error:" in line]
    line = SNIPPET.splitlines().index("    r.f_scroe") + 1
    assert run.returncode == 1, run.stdout + run.stderr
    assert errors == [f'{snippet}:{line}: error: "HeadAnalysis" has no attribute "f_scroe"  [attr-defined]'], (
        run.stdout)
