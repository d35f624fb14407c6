"""Benchmark the single-head sensitivity sweep and the sparsification curves (SPEC §7).

SmolLM2-135M on real text (WikiText-2 test from ../shared/data when present, else the built-in
sample), split into scoring windows (sensitivity, analysis, orders) and distinct held-out windows
(curves). Times one unablated forward of the scoring batch, the batched sweep of all L·H heads,
and the naive loop (one ablated forward per head) on a few heads, extrapolated to all heads.
Then the held-out loss of every order at every retention (random: mean ± std over the seeds) and
the critical heads.

    python benchmarks/bench_ablation.py [--n-seqs 2] [--seq-len 64] [--eval-n-seqs 4]
        [--eval-seq-len 128] [--mode zero] [--naive-heads 6]

The sweep's arithmetic is L·H ablated forwards whatever the batching: batching removes per-call
overhead (and parallelises on an accelerator), so on a CPU expect sweep / forward ≈ L·H / (a
small factor).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from _common import RESULTS, real_text, write_report


def _median_time(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-seqs", type=int, default=2, help="scoring windows")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--eval-n-seqs", type=int, default=4, help="held-out windows")
    parser.add_argument("--eval-seq-len", type=int, default=128)
    parser.add_argument("--mode", choices=("zero", "mean"), default="zero")
    parser.add_argument("--naive-heads", type=int, default=6, help="heads timed one forward each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "bench_ablation.json"))
    args = parser.parse_args()

    import tl_geometry

    model = tl_geometry.load_model("smollm2-135m")
    text, text_name = real_text()
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    # Scoring windows come first in the text, held-out windows after them: no overlap.
    body_score = args.n_seqs * (args.seq_len - 1)
    scoring = tl_geometry.text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)
    ids = model.tokenizer(text if text is not None else tl_geometry.sample_text(),
                          add_special_tokens=False)["input_ids"]
    rest = model.tokenizer.decode(ids[body_score:])
    held_out = tl_geometry.text_windows(model, rest, n_seqs=args.eval_n_seqs, seq_len=args.eval_seq_len)

    def forward():
        with torch.no_grad():
            return model(scoring, return_type="loss")

    forward()  # warm-up
    fwd, fwd_runs = _median_time(forward, args.repeats)

    start = time.perf_counter()
    sens = tl_geometry.ablation.head_sensitivity(model, scoring, args.mode, progress=False)
    sweep = time.perf_counter() - start

    # Naive: one ablated forward per head, through the same public hooks.
    step = max(1, n_layers * n_heads // args.naive_heads)
    some = [divmod(i, n_heads) for i in range(0, n_layers * n_heads, step)][: args.naive_heads]
    ref = scoring if args.mode == "mean" else None
    start = time.perf_counter()
    naive_losses = []
    for layer, head in some:
        ablation = tl_geometry.ablation.ablate_heads(model, [(layer, head)], args.mode, reference_tokens=ref)
        with ablation, torch.no_grad():
            naive_losses.append(float(model(scoring, return_type="loss")))
    naive_per_head = (time.perf_counter() - start) / len(some)
    agree = max(abs(a - sens.loss[l, h].item()) for a, (l, h) in zip(naive_losses, some))

    start = time.perf_counter()
    analysis = tl_geometry.analyze_model(model, scoring, n_values=(2,))
    orders = tl_geometry.ablation.head_orderings(model, scoring, analysis=analysis, sensitivity=sens, progress=False)
    order_s = time.perf_counter() - start
    start = time.perf_counter()
    curve = tl_geometry.ablation.sparsification_curve(model, held_out, orders, mode=args.mode, progress=False)
    curve_s = time.perf_counter() - start

    table = curve.to_pandas()
    stats = table.groupby(["ordering", "retention"], sort=False)["loss"].agg(["mean", "std", "count"])
    losses: dict[str, dict[str, dict[str, float]]] = {}
    for (name, retention), row in stats.iterrows():
        cell = {"loss": row["mean"]}
        if row["count"] > 1:
            cell.update(std=row["std"], seeds=int(row["count"]))
        losses.setdefault(name, {})[f"{retention:g}"] = cell
    counts = {label: sum(row.count(label) for row in analysis.labels) for label in ("Retriever", "Mixer", "Reset")}
    top = sens.top(10)
    report = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "processor": platform.processor() or platform.machine()},
        "input": {"model": "smollm2-135m", "text": text_name, "mode": args.mode,
                  "scoring": list(scoring.shape), "held_out": list(held_out.shape),
                  "heads": n_layers * n_heads},
        "forward_s": fwd, "forward_runs_s": fwd_runs,
        "sweep_s": sweep, "sweep_forwards": sens.metadata["forwards"],
        "heads_per_forward": sens.metadata["heads_per_forward"],
        "sweep_over_forward": sweep / fwd,
        "naive_per_head_s": naive_per_head, "naive_heads_timed": len(some),
        "naive_extrapolated_s": naive_per_head * n_layers * n_heads,
        "naive_over_sweep": naive_per_head * n_layers * n_heads / sweep,
        "batched_vs_naive_max_abs_diff": agree,
        "orders_s": order_s, "curves_s": curve_s,
        "base_loss_scoring": sens.base_loss, "base_loss_held_out": curve.base_loss,
        "taxonomy_counts": counts,
        "critical_heads": [list(p) for p in sens.critical()],
        "top_heads": [{"layer": int(r.layer), "head": int(r.head), "loss_increase": float(r.loss_increase)}
                      for r in top.itertuples()],
        "held_out_loss": losses,
    }
    write_report(report, args.out)
    print(curve.summary().to_string())


if __name__ == "__main__":
    main()
