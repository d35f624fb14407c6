"""The wheel, installed on its own: built from the source tree, installed with ``--no-deps`` into a
fresh venv, and run from outside the source tree, by the command line and the Python API.

The fresh venv sees the dependencies already installed in the environment running the tests
through a ``.pth`` file (one line: that environment's site-packages), so nothing but the wheel is
installed and nothing is downloaded. A path line in a ``.pth`` file only extends ``sys.path``: the
``.pth`` files of the folder it names are not run, so the editable install of the source tree
found there does not hook itself in. Every run starts in a temporary folder: the source tree is
not on the path, and ``tl_geometry`` must come from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from repo_paths import REPO

from tl_geometry._version import __version__

ROOT = REPO
PACKAGE_DATA = ("tl_geometry/py.typed", "tl_geometry/inputs/sample_text.txt")
# The start of the warning of a run that fell back from the compiled kernels to the torch twins.
FALLBACK = "tl_geometry: the compiled (numba) kernels"

# The command line loads SmolLM2 (a real model, from its weights package and the weight cache).
pytestmark = [pytest.mark.real_model, pytest.mark.slow]  # a build and a fresh install that compiles every kernel


def run(cmd: list[str], *, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` without PYTHONPATH (so only the venv's own path counts); fail with its output."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} exited with {proc.returncode}\n"
                                  f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of what goes into it (pyproject.toml, README.md, tl_geometry/),
    so that the build writes nothing into the source tree; with the environment's setuptools
    (no build isolation), so that nothing is downloaded."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "tl_geometry", src / "tl_geometry",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.nbi", "*.nbc"))
    run([sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--quiet", "--no-deps",
         "--no-build-isolation", "--no-index", "--wheel-dir", str(tmp / "dist"), str(src)],
        cwd=tmp, timeout=300)
    wheels = sorted((tmp / "dist").glob("tl_geometry-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (--no-deps), then the test environment's
    site-packages added to its path. The wheel goes in first: pip then sees no other
    tl-geometry, and installs it rather than calling it satisfied."""
    folder = tmp_path_factory.mktemp("venv") / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(folder)], cwd=folder.parent, timeout=120)
    python = folder / "bin" / "python"
    run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python), "install",
         "--quiet", "--no-deps", "--no-index", str(wheel)], cwd=folder.parent, timeout=300)
    purelib = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       cwd=folder.parent, timeout=60).stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (purelib / "zz_test_environment.pth").write_text("".join(f"{path}\n" for path in ours))
    return folder


def test_the_wheel_holds_the_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(PACKAGE_DATA) <= names, sorted(set(PACKAGE_DATA) - names)
    assert not any(name.startswith(("tests/", "demos/", "benchmarks/")) for name in names)
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    assert "tl-geometry = tl_geometry.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_installed_wheel_is_what_python_imports(venv, tmp_path):
    code = """
import importlib.metadata, importlib.resources, json, sys
import tl_geometry
data = {"py.typed": importlib.resources.files("tl_geometry") / "py.typed",
        "sample_text.txt": importlib.resources.files("tl_geometry.inputs") / "sample_text.txt"}
dist = importlib.metadata.distribution("tl-geometry")
print(json.dumps({
    "file": tl_geometry.__file__,
    "data": {name: str(path) for name, path in data.items() if path.is_file()},
    "sample_chars": len(data["sample_text.txt"].read_text(encoding="utf-8")),
    "dist": str(dist.locate_file("")), "version": dist.version,
    "direct_url": dist.read_text("direct_url.json"),
}))
"""
    info = json.loads(run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, timeout=120).stdout)
    assert Path(info["file"]).is_relative_to(venv), info["file"]
    assert not Path(info["file"]).is_relative_to(ROOT), info["file"]
    assert sorted(info["data"]) == ["py.typed", "sample_text.txt"], info["data"]
    assert all(Path(path).is_relative_to(venv) for path in info["data"].values()), info["data"]
    assert info["sample_chars"] > 1000
    assert Path(info["dist"]).is_relative_to(venv) and info["version"] == __version__
    assert "editable" not in (info["direct_url"] or "")  # a wheel install, not the editable one


def test_analyze_heads_runs_from_the_wheel(venv, tmp_path):
    code = """
import json, torch, tl_geometry
g = torch.Generator().manual_seed(0)
causal = torch.ones(12, 12, dtype=torch.bool).tril()
cache = {}
for layer in range(2):
    scores = torch.randn(2, 3, 12, 12, generator=g).masked_fill(~causal, float("-inf"))
    cache[f"blocks.{layer}.attn.hook_pattern"] = scores.softmax(-1)
    cache[f"blocks.{layer}.attn.hook_v"] = torch.randn(2, 12, 3, 4, generator=g)
result = tl_geometry.analyze_heads(cache, n_values=(1, 2), random_samples=2, shuffle_samples=2,
                                   progress=False)
print(json.dumps({"file": tl_geometry.__file__, "shape": list(result.f_score.shape),
                  "finite": bool(torch.isfinite(result.f_score).all()), "layers": list(result.layers)}))
"""
    proc = run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, timeout=600)
    assert FALLBACK not in proc.stderr, proc.stderr  # the wheel's compiled kernels ran
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(info["file"]).is_relative_to(venv), info["file"]
    assert info["shape"] == [2, 3, 2] and info["finite"] and info["layers"] == [0, 1], info


def test_the_command_line_analyzes_the_built_in_text(venv, tmp_path):
    """`tl-geometry analyze`, the venv's own script, on the default model and the text shipped in
    the wheel (sample_text.txt), kept small: 2 windows of 32 tokens, N = 1, 2."""
    script = venv / "bin" / "tl-geometry"
    assert script.is_file()
    proc = run([str(script), "analyze", "--n-seqs", "2", "--seq-len", "32", "--n-values", "1,2",
                "--show-n", "2", "--random-samples", "2", "--shuffle-samples", "2", "--no-progress",
                "--csv", str(tmp_path / "heads.csv")], cwd=tmp_path, timeout=600)
    assert "smollm2-135m" in proc.stdout + proc.stderr and FALLBACK not in proc.stderr, proc.stderr
    rows = (tmp_path / "heads.csv").read_text(encoding="utf-8").splitlines()
    assert len(rows) > 30 * 9  # a header, then one row per (layer, head) at least
