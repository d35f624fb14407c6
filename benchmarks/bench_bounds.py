"""Bounds on real text (SPEC §6): the shell certificate against the measured F_N, best N, timing.

Per model (default SmolLM2-135M and Gemma-3-270M), 8 × 256 tokens of WikiText-2 test
(../shared/data, else the built-in sample), last-query protocol, ``analyze_heads(bounds=True)``:

* violations of the shell certificate (K = 0 and K = N; must be 0): per instance (every layer,
  head, sequence and N, ``functional.separability`` against ``functional.shell_bounds`` on the
  cache — the engine's figures equal these, tests/engine/test_engine_shell.py) and per mean (the
  analysis' shell bound above its measured P / R / F);
* Spearman ρ of the mean shell bound F̲_N with the mean measured F_N over heads × N in the
  headline range ``2 ≤ N ≤ (t+1)/4`` (and of the §6b envelope, for comparison);
* mean bound / mean measured F_2, the separated fractions (instances proved P = R = 1);
* the predicted-vs-measured best-N agreement over the heads where both are defined.

Writes benchmarks/results/bench_bounds.json.

    python benchmarks/bench_bounds.py [--models smollm2-135m gemma3-270m] [--n-seqs 8] [--seq-len 256]
                                      [--text ../shared/data/wikitext-2-test.txt]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from _common import RESULTS, real_text, write_report

KINDS = ("shell", "shell_n")
METRICS = ("precision", "recall", "f_score")
TOL = 1e-12


def _counts(column) -> dict[str, int]:
    """How many heads have each best N (``"none"``: undefined), as a JSON-ready dict."""
    counts = column.value_counts(dropna=False).sort_index()
    return {("none" if math.isnan(k) else str(int(k))): int(v) for k, v in counts.items()}


def _round(x: float) -> float | None:
    return None if math.isnan(x) else round(float(x), 4)


def instance_violations(cache, n_values: tuple[int, ...]) -> dict[str, int]:
    """Per-instance check at each sequence's last query, every layer and head: how many
    (instance, metric) bound values exceed the measured one, and how many were compared."""
    import tl_geometry.functional as F

    bad, total = dict.fromkeys(KINDS, 0), 0
    layer = 0
    while f"blocks.{layer}.attn.hook_pattern" in cache:
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"][:, :, -1].double()  # [b, h, k]
        v = cache[f"blocks.{layer}.attn.hook_v"].double()  # [b, k, kv, d]
        kv = F.kv_head_index(pattern.shape[1], v.shape[2])
        values = v.permute(0, 2, 1, 3)[:, kv]  # [b, h, k, d]
        for n in n_values:
            measured = F.separability(pattern, values, n)
            for kind in KINDS:
                bound = F.shell_bounds(pattern, values, n, k=0 if kind == "shell" else n)
                for m in METRICS:
                    b, x = getattr(bound, m), getattr(measured, m)
                    ok = ~torch.isnan(x)
                    bad[kind] += int((b[ok] > x[ok] + TOL).sum())
                    total += int(ok.sum()) if kind == "shell" else 0
        layer += 1
    return {"compared_per_kind": total, **{f"{k}_violations": v for k, v in bad.items()}}


def report_for(result, analyze_s: float, bounds_s: float, instances: dict[str, int]) -> dict:
    from tl_geometry.functional.stats import spearman

    ns = result.n_values.tolist()
    headline = [ns.index(n) for n in result.headline_n]
    mean_violations = {
        kind: int(sum(((result.bound(kind, m) > result.metric(m) + TOL)
                       & ~torch.isnan(result.metric(m))).sum() for m in METRICS))
        for kind in KINDS
    }
    measured = result.f_score[..., headline]
    i2 = ns.index(2)
    f2 = float(result.f_score[..., i2].nanmean())

    def per_n(x: torch.Tensor) -> dict[str, float | None]:
        return {str(n): _round(float(x[..., i].nanmean())) for i, n in enumerate(ns)}

    best = result.best_n()
    return {
        "analyze_s": round(analyze_s, 2),
        "analyze_with_bounds_s": round(bounds_s, 2),
        "headline_n": list(result.headline_n),
        "instance_violations": instances,
        "mean_violations": mean_violations,
        "spearman_vs_measured_f": {
            kind: _round(spearman(result.bound(kind, "f_score")[..., headline], measured))
            for kind in (*KINDS, "predicted")
        },
        "mean_bound_over_measured_f2": {
            kind: _round(float(result.bound(kind, "f_score")[..., i2].nanmean()) / f2)
            for kind in (*KINDS, "inversion", "certified")
        },
        "separated_fraction": {
            kind: per_n(result.bound(kind, "separated")) for kind in ("inversion", *KINDS)
        },
        "best_n_agreement": {kind: _round(result.best_n_agreement(kind)) for kind in (*KINDS, "predicted")},
        "best_n_counts": {column: _counts(best[column]) for column in best.columns[2:]},
        "mean_f_score": per_n(result.f_score),
        "mean_shell_f_bound": per_n(result.shell_f_score),
        "mean_shell_n_f_bound": per_n(result.shell_n_f_score),
        "mean_inversion_f_bound": per_n(result.bound("inversion", "f_score")),
        "mean_certified_f_bound": per_n(result.certified_f_score),
        "mean_predicted_f_envelope": per_n(result.predicted_f_score),
        "certified_fraction": {str(n): float(f) for n, f in zip(ns, result.certified_fraction)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--n-seqs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--text", help="a text file (default: ../shared/data's WikiText-2 test)")
    parser.add_argument("--out", default=str(RESULTS / "bench_bounds.json"))
    args = parser.parse_args()

    import tl_geometry

    text, text_name = real_text()
    if args.text:  # e.g. from a git worktree, where ../shared is not the project's
        text, text_name = Path(args.text).read_text(encoding="utf-8"), Path(args.text).stem
    n_values = tuple(n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n < args.seq_len)
    report: dict = {"input": {"text": text_name, "n_seqs": args.n_seqs, "seq_len": args.seq_len,
                              "queries": "last", "n_values": list(n_values),
                              "torch_threads": torch.get_num_threads()}}
    for name in args.models:
        model = tl_geometry.load_model(name)
        tokens = tl_geometry.text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
        start = time.perf_counter()
        tl_geometry.analyze_heads(cache, n_values=n_values, progress=False)
        plain_s = time.perf_counter() - start
        start = time.perf_counter()
        result = tl_geometry.analyze_heads(cache, n_values=n_values, bounds=True, model=model, progress=False)
        bounds_s = time.perf_counter() - start
        report[name] = report_for(result, plain_s, bounds_s, instance_violations(cache, n_values))
        del model, cache
    write_report(report, args.out)


if __name__ == "__main__":
    main()
