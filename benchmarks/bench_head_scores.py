"""head_scores on one long window against analyze_model of the same window, in one process.

One window of ``--seq-len`` tokens (default 4,096) of real text (WikiText-2 test when
../shared/data has it, else the built-in sample) for ``--model`` (default Gemma-3-270M, whose
262,144-token unembedding the scores never need). Each phase after the load: wall time and peak
resident memory (VmHWM, reset before the phase), both the process's peak during the phase and
that peak above the resident size before it:

* ``head_scores``: ``tl_geometry.head_scores(model, windows=window)``: 8 repeated sequences
  (``R = 32``), the window (Sink^ε reads its first 64 tokens: no forward apart) and the window
  with its needle (``T + 48`` tokens), each by its default path (the capture of queries and
  keys on a transformers model: 24.4–25.5 s and 2.2 GiB on one thread, 59.6 s and 2.95 GiB by
  the pattern path);
* ``analyze_model``: ``tl_geometry.analyze_model(model, window, attention=...)``, every other
  option at its default; ``--attention recompute`` (default) is the path whose memory does not
  grow as ``T²`` (``"auto"`` takes the pattern path for one window of 4,096 tokens, whose
  ``[4, T, T]`` pattern is under its 1 GiB threshold: 32.4 s and 3.0 GiB on one thread since that
  path's forward ends at the last layer read, 48.8 s and 6.3 GiB before, with the logits;
  results/bench_head_scores_auto_2026-12-07.json).

Each phase's figures are printed to stderr as soon as it ends.

The ratio is head_scores' time over analyze_model's. The thread settings and the load average
are recorded: on a shared machine run it with one thread (``OMP_NUM_THREADS=1``, and
``NUMBA_NUM_THREADS=1``, whose OpenMP layer may otherwise raise torch's thread count).

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/bench_head_scores.py [--model gemma3-270m] [--seq-len 4096]
        [--out benchmarks/results/bench_head_scores.json]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from _common import RESULTS, real_text, write_report


def _rss_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _measure(fn) -> dict:
    """Seconds, and the peak resident GiB during ``fn`` (absolute, and above the size before)."""
    gc.collect()
    try:  # hand freed heap back to the OS, so the baseline is what is really held
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    base, threads = _rss_gib("VmRSS"), torch.get_num_threads()
    Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    peak = _rss_gib("VmHWM")
    return {"s": seconds, "peak_rss_gib": peak, "peak_above_start_gib": peak - base, "start_rss_gib": base,
            # numba's OpenMP layer may raise torch's thread count (NUMBA_NUM_THREADS pins it too)
            "torch_threads_before_after": [threads, torch.get_num_threads()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--attention", default="recompute", choices=["recompute", "pattern", "auto"])
    parser.add_argument("--out", default=str(RESULTS / "bench_head_scores.json"))
    args = parser.parse_args()
    import tl_geometry

    torch.set_grad_enabled(False)
    start = time.perf_counter()
    model = tl_geometry.load_model(args.model)
    load_s = time.perf_counter() - start
    text, text_name = real_text()
    window = tl_geometry.text_windows(model, text, n_seqs=1, seq_len=args.seq_len)
    scores = {}

    def run_scores():
        scores["table"] = tl_geometry.head_scores(model, windows=window)

    head_scores = _measure(run_scores)
    print(json.dumps({"head_scores": head_scores}), file=sys.stderr, flush=True)
    analyze_model = _measure(lambda: tl_geometry.analyze_model(model, window, attention=args.attention,
                                                               progress=False))
    print(json.dumps({"analyze_model": analyze_model}), file=sys.stderr, flush=True)
    table = scores["table"]
    report = {
        "model": args.model, "text": text_name, "n_windows": 1, "seq_len": args.seq_len,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "numba_num_threads": os.environ.get("NUMBA_NUM_THREADS"),
        "load_average_1m_5m_15m": list(os.getloadavg()), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "load_s": load_s,
        "head_scores": {**head_scores, "repeat": table.attrs["repeat"],
                        "sink_epsilon": table.attrs["sink_epsilon"]},
        "analyze_model": {**analyze_model, "attention": args.attention},
        "head_scores_over_analyze_model": head_scores["s"] / analyze_model["s"],
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
