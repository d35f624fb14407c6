"""How long `import tl_geometry` takes, and what it would cost if it loaded its heavy neighbours.

Each statement runs in a fresh interpreter ``--repeats`` times (median reported, in seconds):
``import torch`` (the floor: tl_geometry's tensors need it), ``import tl_geometry``, and for
comparison ``import transformers`` and ``import transformer_lens``, which ``import tl_geometry``
avoids until a loader is called. ``-X importtime`` gives the cumulative time of the
``tl_geometry`` package and its largest imports. The heavy modules found in ``sys.modules`` after
``import tl_geometry`` must be none.

    python benchmarks/bench_import.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys

from _common import RESULTS, write_report

HEAVY = ("transformers", "transformer_lens", "matplotlib", "pandas", "circuitsvis", "gguf")


def _timed_import(statement: str, repeats: int) -> float:
    """Median wall time of ``statement`` in fresh interpreters (interpreter start excluded)."""
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True).stdout) for _ in range(repeats)]
    return round(statistics.median(runs), 3)


def _importtime(module: str, top: int = 8) -> dict[str, float]:
    """Cumulative seconds of ``module`` and of its ``top`` largest direct-or-nested imports."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                         capture_output=True, text=True, check=True).stderr
    rows = []
    for line in err.splitlines():
        if not line.startswith("import time:") or "|" not in line or "cumulative" in line:
            continue
        _, cumulative, name = line.split("|")
        rows.append((name.strip(), int(cumulative) / 1e6))
    rows.sort(key=lambda row: -row[1])
    return {name: round(seconds, 3) for name, seconds in rows[:top]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    probe = f"import json, sys, tl_geometry; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    heavy = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1])
    report = {
        "benchmark": "import",
        "python": platform.python_version(),
        "repeats": args.repeats,
        "import_torch_s": _timed_import("import torch", args.repeats),
        "import_tl_geometry_s": _timed_import("import tl_geometry", args.repeats),
        "import_transformers_s": _timed_import("import transformers", args.repeats),
        "import_transformer_lens_s": _timed_import("import transformer_lens", args.repeats),
        "heavy_modules_after_import": heavy,
        "importtime_cumulative_s": _importtime("tl_geometry"),
    }
    report["tl_geometry_over_torch_s"] = round(report["import_tl_geometry_s"] - report["import_torch_s"], 3)
    write_report(report, RESULTS / "bench_import.json")


if __name__ == "__main__":
    main()
