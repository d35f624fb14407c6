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
from numba import njit, typeof
from numba.core.errors import TypingError
from numba.core.typing.typeof import Purpose
from repo_paths import TESTS

import tl_geometry
from tl_geometry.engine import backend, check_options, key_votes, layer
from tl_geometry.engine.block import QueryKeys
from tl_geometry.engine.compiled import compilation, signatures
from tl_geometry.engine.layer import analyze_layer
from tl_geometry.functional.heads import sink_positions

COMPILED = Path(tl_geometry.__file__).parent / "engine" / "compiled"
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


@pytest.mark.slow
def test_the_compilation_is_announced_on_the_first_run_only(tmp_path):
    """A fresh process with an empty numba cache prints the start line once and the end line with
    the time; the next process loads the kernels from the cache and prints neither, even where
    its inputs differ (float64 rather than float32, every query rather than the last): the first
    run compiled every specialisation, not only those its own inputs needed."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import torch
        import tl_geometry
        from cases import make_case
        case = make_case(3, padding="left", dtype=getattr(torch, sys.argv[1]))
        cache = {{**case.cache(0), **case.cache(1)}}
        tl_geometry.analyze_heads(cache, n_values=(1, 2, 3), attention_mask=case.attention_mask,
                                  queries=sys.argv[2], random_samples=3, progress=False)
    """)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}

    def run(dtype: str, queries: str) -> str:
        done = subprocess.run([sys.executable, "-c", script, dtype, queries], env=env, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, done.stderr
        return done.stderr

    first, second = run("float32", "last"), run("float64", "all")
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


def _record_kernel_calls(monkeypatch) -> set:
    """``(kernel, argument types)`` of every call the engine makes to a kernel from now on, as
    numba's dispatch types them."""
    seen: set = set()
    for name, kernel in signatures.KERNELS.items():
        def record(*args, _name=name, _kernel=kernel):
            seen.add((_name, tuple(typeof(a, Purpose.argument) for a in args)))
            return _kernel(*args)

        monkeypatch.setattr(sys.modules[kernel.py_func.__module__], name.split(".")[1], record)
    return seen


def _keyed_layer(dtype, queries, tie=True):
    """One layer through the recompute path's source (rows from queries and keys)."""
    from test_key_votes import KeyedCompactRows

    gen = torch.Generator().manual_seed(5)
    batch, n_pos, n_heads, n_kv, d = 2, 14, 4, 2, 6
    q = torch.randn(batch, n_pos, n_heads, d, generator=gen, dtype=dtype)
    k = torch.randn(batch, n_pos, n_kv, d, generator=gen, dtype=dtype)
    v = torch.randn(batch, n_pos, n_kv, d, generator=gen)
    if tie:  # an exact tie with the sink: its rows are read again in float64
        k[:, 5], v[:, 5] = k[:, 0], v[:, 0]
    is_token = torch.ones(batch, n_pos, dtype=torch.bool)
    opts = check_options(n_values=(1, 2, 4), queries=queries, random_samples=3, shuffle_samples=2,
                         bounds=False, backend="numba")
    source = KeyedCompactRows(QueryKeys(q, k, 0.4, None, None, 3))
    return analyze_layer(source, v, is_token, sink_positions(is_token), opts, layer=0, mask_given=False)


def test_the_engine_calls_exactly_the_precompiled_specialisations(monkeypatch):
    """Every call of a kernel, on every path (float32, bfloat16 and float64 caches, output space,
    the recompute path's rows and votes, its blocks of queries, the logits of long windows, the
    rows a tie makes the votes read again), has the argument types of one entry of
    ``signatures.SIGNATURES``, and every entry is reached: the first run compiles all that a
    later run can need, and nothing else."""
    monkeypatch.setattr(backend, "_fallback", None)
    seen = _record_kernel_calls(monkeypatch)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        case = make_case(7, padding="left", sink=True, dtype=dtype)
        for queries in ("last", "all"):
            tl_geometry.analyze_heads(_two_layers(case), n_values=(1, 2, 3), attention_mask=case.attention_mask,
                                      queries=queries, random_samples=3, backend="numba", progress=False)
    case = make_case(8, window=4)
    W_O = torch.randn(2, case.pattern.shape[1], case.v.shape[-1], 7)
    tl_geometry.analyze_heads(_two_layers(case), W_O=W_O, space="output", n_values=(1, 2), random_samples=2,
                              backend="numba", progress=False)
    for dtype in (torch.float32, torch.float64):
        _keyed_layer(dtype, "last")
    whole = _keyed_layer(torch.float32, "all")
    monkeypatch.setattr(layer, "ROW_BLOCK_BYTES", 1)  # one query per block: strided blocks of the results
    monkeypatch.setattr(key_votes, "BLAS_MIN_KEYS", 1)  # the logits from matrix products
    for dtype in (torch.float32, torch.float64):
        blocked = _keyed_layer(dtype, "all")
        if dtype == torch.float32:
            for name, want, got in zip(whole._fields, whole, blocked):
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=name)
    missing = seen - set(signatures.SIGNATURES)
    assert not missing, f"calls with types that are not precompiled: {sorted(map(str, missing))}"
    unused = set(signatures.SIGNATURES) - seen
    assert not unused, f"precompiled types that no call uses: {sorted(map(str, unused))}"
