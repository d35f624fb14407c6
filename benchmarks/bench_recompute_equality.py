"""How closely the recompute path reproduces the pattern path, at the lengths the tests cannot afford.

For each case (model, sequences × tokens, chosen queries) the same windows of real text are
analysed at every layer with every default by ``analyze_model(attention="pattern")`` (eager
attention, ``hook_pattern``) and by ``analyze_model(attention="recompute")`` (SDPA forward, rows
recomputed in float64 from the captured queries and keys), with the same seed. The two forwards
round differently in float32 (about 1e-6 in α), so exact equality is not expected where two keys
are within that of a tie; the report says how far apart the two results are:

* votes and labels: how many (layer, head) vote counts and labels differ;
* sink figures: the largest absolute difference;
* scores: the share of finite per-(layer, head, N, metric) entries that differ by more than 1e-6,
  and the largest difference, per group (top, random, shuffled, sink-removed);
* the truncation figures (SPEC §10): the largest difference, and the largest relative to
  ``max(1, |figure|)``, which must stay within 1e-5 (the kept mass is summed over the selected
  keys, so round-off of α decides no figure; a relative error of 5 carries the forwards' 1e-6).

With ``--cache`` a third analysis, ``analyze_heads`` of the model's own ``run_with_cache`` on the
same windows (the path a TransformerLens user takes), is compared with the recompute path too.

    python benchmarks/bench_recompute_equality.py [--cases smollm2-135m:2x640,gemma3-270m:1x900]
        [--queries last,all] [--cache] [--out benchmarks/results/bench_recompute_equality.json]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from _common import RESULTS, ROOT, real_text, write_report

sys.path.insert(0, str(ROOT))
import tl_geometry
from tl_geometry.functional.separability import METRIC_NAMES, TRUNCATION_NAMES
from tl_geometry.result.schema import GROUPS

TOLERANCE = 1e-6


def compare(a: tl_geometry.HeadAnalysis, b: tl_geometry.HeadAnalysis) -> dict:
    """Where ``b`` (recompute) departs from ``a`` (pattern)."""
    votes_differ = (a.vote_counts != b.vote_counts).any(-1)
    labels_differ = sum(x != y for ra, rb in zip(a.labels, b.labels) for x, y in zip(ra, rb))
    nan_differ = int((torch.isnan(a.scores) != torch.isnan(b.scores)).sum())
    finite = torch.isfinite(a.scores) & torch.isfinite(b.scores)
    diff = (a.scores - b.scores).abs()
    groups = {}
    for i, group in enumerate(GROUPS):
        f, d = finite[i], diff[i]
        if bool(f.any()):
            groups[group] = dict(share_over_tolerance=float((d > TOLERANCE)[f].double().mean()),
                                 max_abs_diff=float(d[f].max()))
    cut = [METRIC_NAMES.index(m) for m in TRUNCATION_NAMES]
    cut_finite = finite[:, cut]
    sink = (a.sink - b.sink).abs()
    return dict(
        heads=int(votes_differ.numel()),
        vote_counts_differ=int(votes_differ.sum()),
        max_vote_count_diff=int((a.vote_counts - b.vote_counts).abs().max()),
        labels_differ=int(labels_differ),
        nan_pattern_differ=nan_differ,
        sink_max_abs_diff=float(sink[torch.isfinite(sink)].max()),
        score_share_over_tolerance=float((diff > TOLERANCE)[finite].double().mean()),
        score_max_abs_diff=float(diff[finite].max()),
        truncation_finite=int(cut_finite.sum()),
        truncation_max_abs_diff=float(diff[:, cut][cut_finite].max()) if bool(cut_finite.any()) else None,
        # Relative errors above 1 (an output o_N far from a small o) scale their forwards' difference.
        truncation_max_scaled_diff=float((diff[:, cut] / a.scores[:, cut].abs().clamp_min(1))[cut_finite].max())
        if bool(cut_finite.any()) else None,
        groups=groups,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="smollm2-135m:2x640,gemma3-270m:1x900")
    parser.add_argument("--queries", default="last,all")
    parser.add_argument("--cache", action="store_true",
                        help="also compare analyze_heads(run_with_cache) with the recompute path")
    parser.add_argument("--out", default=str(RESULTS / "bench_recompute_equality.json"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    text, source = real_text()
    report: dict = {"text": source, "tolerance": TOLERANCE, "protocol": "every layer, every default, seed 0",
                    "runs": []}
    for case in args.cases.split(","):
        name, shape = case.split(":")
        n_seqs, seq_len = (int(x) for x in shape.split("x"))
        model = tl_geometry.load_model(name)
        tokens = tl_geometry.text_windows(model, text, n_seqs=n_seqs, seq_len=seq_len)
        for queries in args.queries.split(","):
            row: dict = dict(model=name, n_seqs=n_seqs, seq_len=seq_len, queries=queries)
            results = {}
            for path in ("pattern", "recompute"):
                start = time.perf_counter()
                results[path] = tl_geometry.analyze_model(model, tokens, queries=queries, attention=path,
                                                          progress=False)
                row[f"{path}_s"] = time.perf_counter() - start
            row.update(compare(results["pattern"], results["recompute"]))
            if args.cache:
                start = time.perf_counter()
                _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
                sinks = results["pattern"].metadata["sink"]["positions"]
                from_cache = tl_geometry.analyze_heads(cache, queries=queries, sink=sinks, progress=False)
                row["cache_s"] = time.perf_counter() - start
                row["cache_vs_recompute"] = compare(from_cache, results["recompute"])
                del cache
            print(row, file=sys.stderr)
            report["runs"].append(row)
        del model
    write_report(report, args.out)


if __name__ == "__main__":
    main()
