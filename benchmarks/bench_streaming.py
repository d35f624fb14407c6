"""Streaming (analyze_model) against cache-then-analyze (run_with_cache + analyze_heads).

SmolLM2-135M on WikiText-2 test windows (../shared/data, else the built-in sample), last-query
protocol. For each sequence length T (default 128, 256, 512, 1024; ``batch`` windows each) and
each path: wall time and the peak resident memory above the loaded model (VmHWM, reset before
each run). Then the peak of both paths as the analysed depth grows (8, 16, 30 layers) at T=512,
and the forward pass alone for throughput. The time exponent is the slope of log(time) on
log(T). Writes benchmarks/results/bench_streaming.json.

    python benchmarks/bench_streaming.py [--lengths 128,256,512,1024] [--batch 4]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch
from _common import RESULTS, real_text, write_report


def _rss(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _measure(fn) -> tuple[float, float]:
    """(seconds, peak MiB above the resident size before the run)."""
    gc.collect()
    try:  # hand freed heap back to the OS, so the baseline is what is really held
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    base = _rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, _rss("VmHWM") - base


def _slope(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="128,256,512,1024")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default=str(RESULTS / "bench_streaming.json"))
    args = parser.parse_args()
    import tl_geometry

    model = tl_geometry.load_model("smollm2-135m")
    text, text_name = real_text()
    lengths = [int(x) for x in args.lengths.split(",")]
    n_values = (1, 2, 4, 8, 16, 32, 64)
    rows = []
    for T in lengths:
        tokens = tl_geometry.text_windows(model, text, n_seqs=args.batch, seq_len=T)

        def forward():
            with torch.no_grad():
                model(tokens)

        def cached():
            with torch.no_grad():
                _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
            tl_geometry.analyze_heads(cache, n_values=n_values)

        def streamed():
            tl_geometry.analyze_model(model, tokens, batch_size=args.batch, n_values=n_values)

        forward()  # warm-up
        row = {"T": T, "tokens": args.batch * T}
        for name, fn in (("forward", forward), ("cache_then_analyze", cached), ("streaming", streamed)):
            seconds, peak = _measure(fn)
            row[f"{name}_s"], row[f"{name}_peak_mib"] = round(seconds, 3), round(peak, 1)
        row["streaming_tokens_per_s"] = round(row["tokens"] / row["streaming_s"], 1)
        row["forward_tokens_per_s"] = round(row["tokens"] / row["forward_s"], 1)
        print(json.dumps(row), file=sys.stderr)
        rows.append(row)
    depth = []
    tokens = tl_geometry.text_windows(model, text, n_seqs=args.batch, seq_len=512)
    for n_layers in (8, 16, 30):
        layers = list(range(n_layers))
        names = {f"blocks.{l}.attn.{h}" for l in layers for h in ("hook_pattern", "hook_v")}

        def cached():
            with torch.no_grad():
                _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
            tl_geometry.analyze_heads(cache, n_values=n_values, layers=layers)

        def streamed():
            tl_geometry.analyze_model(model, tokens, batch_size=args.batch, n_values=n_values, layers=layers)

        entry = {"layers": n_layers, "T": 512}
        for name, fn in (("cache_then_analyze", cached), ("streaming", streamed)):
            seconds, peak = _measure(fn)
            entry[f"{name}_s"], entry[f"{name}_peak_mib"] = round(seconds, 3), round(peak, 1)
        print(json.dumps(entry), file=sys.stderr)
        depth.append(entry)
    report = {
        "input": {"model": "smollm2-135m", "text": text_name,
                  "windows_per_length": args.batch, "queries": "last", "random_samples": 16,
                  "threads": torch.get_num_threads()},
        "by_length": rows,
        "by_depth": depth,
        "time_exponent": {
            k: round(_slope([r["T"] for r in rows], [r[f"{k}_s"] for r in rows]), 2)
            for k in ("forward", "cache_then_analyze", "streaming")
        },
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
