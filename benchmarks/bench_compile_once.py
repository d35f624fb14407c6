"""Whether the compiled kernels compile once per install: two fresh processes, one numba cache.

Both processes share a new, empty ``NUMBA_CACHE_DIR`` and run small default analyses
(``analyze_heads`` on a tiny synthetic cache of 2 sequences × 24 positions, 2 layers, 4 heads):
the first on a float32 cache at the last query and at every query, the second the same and then
on a float64 and a bfloat16 cache, whose rows and values reach other specialisations of the
kernels. Per process: its wall time, the seconds numba spent compiling (outermost
``numba:compile`` events), the cache hits and misses of every kernel of
``tl_geometry.engine.compiled`` (a miss is a compilation), the kernels that missed, whether the
"compiling the analysis kernels" line was printed, and the ``.nbi`` / ``.nbc`` files in the
cache after it. Once per install means the second process has no miss.

    python benchmarks/bench_compile_once.py [--before DIR] [--out benchmarks/results/bench_compile_once_<date>.json]

``--before DIR`` runs the same protocol, in its own empty cache, on the ``tl_geometry`` package
found in ``DIR`` (e.g. an export of the previous commit), recorded as ``"before"``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import RESULTS, ROOT, write_report

FIRST = [("float32", "last"), ("float32", "all")]
SECOND = [*FIRST, ("float64", "last"), ("float64", "all"), ("bfloat16", "last")]

CHILD = r"""
import json, sys, time
start = time.perf_counter()
sys.path.insert(0, {package!r})
import torch
import tl_geometry
from numba.core import event


class Timer(event.Listener):
    # Outermost events only: compiling a kernel compiles the functions it calls inside its own.
    depth, seconds, since = 0, 0.0, 0.0

    def on_start(self, ev):
        self.depth += 1
        if self.depth == 1:
            self.since = time.perf_counter()

    def on_end(self, ev):
        self.depth -= 1
        if self.depth == 0:
            self.seconds += time.perf_counter() - self.since


def tiny_cache(dtype, batch=2, n_pos=24, n_heads=4, n_kv=2, d=8, n_layers=2):
    g = torch.Generator().manual_seed(0)
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    cache = {{}}
    for layer in range(n_layers):
        logits = torch.randn(batch, n_heads, n_pos, n_pos, generator=g).masked_fill(~causal, -torch.inf)
        cache[f"blocks.{{layer}}.attn.hook_pattern"] = logits.softmax(-1).to(dtype)
        cache[f"blocks.{{layer}}.attn.hook_v"] = torch.randn(batch, n_pos, n_kv, d, generator=g).to(dtype)
    return cache


timer, runs = Timer(), []
with event.install_listener("numba:compile", timer):
    for dtype, queries in {work!r}:
        begin = time.perf_counter()
        tl_geometry.analyze_heads(tiny_cache(getattr(torch, dtype)), queries=queries, progress=False)
        runs.append(dict(dtype=dtype, queries=queries, seconds=round(time.perf_counter() - begin, 2)))
hits = misses = 0
missed = set()
for name, module in list(sys.modules.items()):
    if not name.startswith("tl_geometry.engine.compiled."):
        continue
    for attr in vars(module).values():
        stats = getattr(attr, "stats", None)
        if stats is None or getattr(getattr(attr, "py_func", None), "__module__", None) != name:
            continue
        hits += sum(stats.cache_hits.values())
        misses += sum(stats.cache_misses.values())
        if stats.cache_misses:
            missed.add(name.rsplit(".", 1)[1] + "." + attr.py_func.__name__)
print(json.dumps(dict(runs=runs, compile_s=round(timer.seconds, 2), cache_hits=hits, cache_misses=misses,
                      missed=sorted(missed), wall_s=round(time.perf_counter() - start, 2))))
"""


def _process(package: Path, cache_dir: Path, work: list[tuple[str, str]]) -> dict:
    """One fresh interpreter running ``work`` with numba's cache in ``cache_dir``."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-c", CHILD.format(package=str(package), work=work)], env=env,
                          capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.splitlines()[-1])
    result["announced"] = "compiling the analysis kernels" in done.stderr
    result["cache_files"] = {suffix: len(list(cache_dir.rglob(f"*.{suffix}"))) for suffix in ("nbi", "nbc")}
    return result


def _protocol(package: Path) -> dict:
    """The two processes on one new, empty numba cache."""
    with tempfile.TemporaryDirectory(prefix="numba-cache-") as folder:
        cache_dir = Path(folder)
        first = _process(package, cache_dir, FIRST)
        second = _process(package, cache_dir, SECOND)
    return {"first_process": first, "second_process": second,
            "second_process_cache_misses": second["cache_misses"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", metavar="DIR", default=None,
                        help="a folder holding another tl_geometry package to run the protocol on")
    today = datetime.date.today().isoformat()
    parser.add_argument("--out", default=str(RESULTS / f"bench_compile_once_{today}.json"))
    args = parser.parse_args()
    import numba

    report = {
        "benchmark": "compile_once",
        "date": today,
        "protocol": "two fresh processes sharing a new NUMBA_CACHE_DIR; first: float32 cache, last and "
                    "all queries; second: the same, then float64 (last, all) and bfloat16 (last)",
        "python": platform.python_version(),
        "numba": numba.__version__,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "after": _protocol(ROOT),
    }
    if args.before is not None:
        report["before"] = _protocol(Path(args.before).resolve())
    report["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_report(report, args.out)


if __name__ == "__main__":
    main()
