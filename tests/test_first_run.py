"""The first run: the compiled kernels are cached on disk, their one-time compilation is announced
(and only then), and a kernel that numba cannot compile sends the run to the torch twins."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from cases import make_case
from numba import njit
from numba.core.errors import TypingError

import tl_geometry
from tl_geometry.engine import backend
from tl_geometry.engine.compiled import compilation

COMPILED = Path(tl_geometry.__file__).parent / "engine" / "compiled"
TESTS = Path(__file__).parent
END_LINE = "tl_geometry: compiled the analysis kernels in "


def _two_layers(case):
    return {**case.cache(0), **case.cache(1)}


def _analyze(case, name):
    return tl_geometry.analyze_heads(_two_layers(case), backend=name, n_values=(1, 2, 3),
                                     attention_mask=case.attention_mask, random_samples=3, progress=False)


def _assert_same(got, want):
    for field in ("scores", "sink"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got.vote_counts, want.vote_counts)
    assert torch.equal(got.group_counts, want.group_counts)


def _fallback_warnings(record):
    return [w for w in record if "tl_geometry: the compiled (numba) kernels" in str(w.message)]


def test_every_kernel_is_cached_on_disk():
    """Every ``@njit`` kernel says ``cache=True``: a second process loads it instead of compiling."""
    uncached = []
    for path in sorted(COMPILED.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                call = deco if isinstance(deco, ast.Call) else None
                name = getattr(call.func if call else deco, "id", None)
                if name == "njit" and not any(k.arg == "cache" and getattr(k.value, "value", None) is True
                                              for k in (call.keywords if call else [])):
                    uncached.append(f"{path.name}:{node.name}")
    assert not uncached, uncached


def test_the_compilation_is_announced_on_the_first_run_only(tmp_path):
    """A fresh process with an empty numba cache prints the start line once and the end line with
    the time; the next process loads the kernels from the cache and prints neither."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import tl_geometry
        from cases import make_case
        case = make_case(3, padding="left")
        cache = {{**case.cache(0), **case.cache(1)}}
        tl_geometry.analyze_heads(cache, n_values=(1, 2, 3), attention_mask=case.attention_mask,
                                  random_samples=3, progress=False)
    """)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}

    def run() -> str:
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stderr
        return done.stderr

    first, second = run(), run()
    assert first.count(compilation.START_LINE) == 1, first
    assert first.count(END_LINE) == 1, first
    assert first.index(compilation.START_LINE) < first.index(END_LINE)
    assert compilation.START_LINE not in second and END_LINE not in second, second
    assert any((tmp_path / "numba").rglob("*.nbi"))


def test_other_numba_code_is_not_announced(capsys):
    """Compiling the caller's own numba function inside a layer's work prints nothing."""

    @njit
    def add_one(x):  # pragma: no cover - compiled
        return x + 1

    with compilation.reporting():
        assert add_one(1) == 2
    assert capsys.readouterr().err == ""


def test_a_kernel_that_fails_to_compile_falls_back_to_the_torch_twins(monkeypatch):
    """A numba error from a kernel: the layer starts over on the torch twins and so does the rest
    of the run, with one warning; the results are the twins' own, bit for bit."""
    monkeypatch.setattr(backend, "_fallback", None)
    case = make_case(11, padding="left", sink=True)
    want = _analyze(case, "torch")

    def fails(*args):
        raise TypingError("Failed in nopython mode pipeline (step: nopython frontend)")

    monkeypatch.setattr(backend._kernels().score, "score_rows", fails)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = _analyze(case, "auto")
        again = _analyze(case, "auto")  # the rest of the process stays on the twins, silently
    _assert_same(got, want)
    _assert_same(again, want)
    found = _fallback_warnings(record)
    assert len(found) == 1, [str(w.message) for w in record]
    message = str(found[0].message)
    assert "TypingError" in message and "reinstall numba" in message and "backend='torch'" in message
    assert "float64 round-off" in message
    assert isinstance(backend._fallback, TypingError)


def test_a_forced_numba_backend_raises_instead(monkeypatch):
    monkeypatch.setattr(backend, "_fallback", None)

    def fails(*args):
        raise TypingError("no kernel here")

    monkeypatch.setattr(backend._kernels().score, "score_rows", fails)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(TypingError, match="no kernel here"):
            _analyze(make_case(12), "numba")
    assert not _fallback_warnings(record)
    assert backend._fallback is None


def test_a_numba_that_cannot_be_imported_falls_back_too(monkeypatch):
    monkeypatch.setattr(backend, "_fallback", None)
    case = make_case(13, padding="right")
    want = _analyze(case, "torch")

    def missing():
        raise ImportError("numba needs NumPy 2.x or older")

    monkeypatch.setattr(backend, "_kernels", missing)
    with pytest.raises(ImportError):
        _analyze(case, "numba")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = _analyze(case, "auto")
    _assert_same(got, want)
    assert len(_fallback_warnings(record)) == 1
    assert "could not be loaded" in str(_fallback_warnings(record)[0].message)
