"""Bounds on real text: certified heads and predicted best N (SPEC §6), with timing.

SmolLM2-135M on 8 × 128 tokens of WikiText-2 test (../shared/data, else the built-in sample),
last-query protocol. Writes benchmarks/results/bench_bounds.json.

    python benchmarks/bench_bounds.py [--n-seqs 8] [--seq-len 128] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import RESULTS, real_text, write_report


def _counts(best_n) -> dict[str, int]:
    """How many heads have each best N, as a JSON-ready dict."""
    return {str(k): int(v) for k, v in best_n.value_counts().sort_index().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n-seqs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default=str(RESULTS / "bench_bounds.json"))
    args = parser.parse_args()

    import tl_geometry
    from tl_geometry.functional.regime import REGIME_FIELDS

    model = tl_geometry.load_model(args.model)
    text, text_name = real_text()
    tokens = tl_geometry.text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    n_values = tuple(n for n in (1, 2, 4, 8, 16, 32, 64) if n < args.seq_len)
    start = time.perf_counter()
    tl_geometry.analyze_heads(cache, n_values=n_values)
    plain_s = time.perf_counter() - start
    start = time.perf_counter()
    result = tl_geometry.analyze_heads(cache, n_values=n_values, bounds=True, model=model)
    bounds_s = time.perf_counter() - start
    best = result.best_n()
    ns = result.n_values.tolist()

    def per_n(x: torch.Tensor) -> dict[str, float]:
        return {str(n): round(float(x[..., i].nanmean()), 4) for i, n in enumerate(ns)}

    report = {
        "input": {"model": args.model, "text": text_name,
                  "n_seqs": args.n_seqs, "seq_len": args.seq_len, "queries": "last"},
        "analyze_s": plain_s,
        "analyze_with_bounds_s": bounds_s,
        "certified_fraction": {str(n): float(f) for n, f in zip(ns, result.certified_fraction)},
        "best_n_match_fraction": float((best.measured_best_n == best.predicted_best_n).mean()),
        "measured_best_n_counts": _counts(best.measured_best_n),
        "predicted_best_n_counts": _counts(best.predicted_best_n),
        "mean_f_score": per_n(result.f_score),
        "mean_inversion_f_bound": per_n(result.bound("inversion", "f_score")),
        "mean_certified_f_bound": per_n(result.bound("certified", "f_score")),
        "mean_predicted_f_envelope": per_n(result.bound("predicted", "f_score")),
        "regime_median": {f: float(getattr(result, f"regime_{f}").nanmedian()) for f in REGIME_FIELDS},
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
