"""Benchmark retrieval capacity (top-N attention, issue 16) on SmolLM2-135M and Gemma-3-270M.

For each model, on windows of real text (WikiText-2 test when available): the dense loss and
the loss with every head keeping only each query's top-N keys for N in --n-values, in both modes
(renormalise, delete), and N* (smallest N within --tolerance of the dense loss); the per-head
sweep at --head-n (one head alone sparsified, batched) and Spearman's ρ between each head's
F_N / shell certificates (last query, SPEC §3 / §6d) and that head's loss increase; and the cost
of each sweep against one forward of the same batch.

    python benchmarks/bench_capacity.py [--text FILE] [--n-seqs 4] [--seq-len 128]
        [--head-n 4] [--head-n-seqs 2] [--head-seq-len 64] [--head-modes renormalize]
        [--models smollm2-135m,gemma3-270m]
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


def _model_report(name: str, text: str | None, args: argparse.Namespace) -> dict:
    import tl_geometry

    start = time.perf_counter()
    model = tl_geometry.load_model(name)
    load_s = time.perf_counter() - start
    tokens = tl_geometry.text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)

    def forward():
        with torch.no_grad():
            return model(tokens, return_type="loss")

    forward()  # warm-up
    fwd, fwd_runs = _median_time(forward, args.repeats)
    report: dict = {"model": name, "load_s": load_s, "tokens": list(tokens.shape),
                    "n_layers": model.cfg.n_layers, "n_heads": model.cfg.n_heads,
                    "n_kv_heads": getattr(model.cfg, "n_key_value_heads", None) or model.cfg.n_heads,
                    "forward_s": fwd, "forward_runs_s": fwd_runs, "capacity": {}, "heads": {}}
    for mode in ("renormalize", "delete"):
        start = time.perf_counter()
        cap = tl_geometry.capacity.retrieval_capacity(model, tokens, args.n_values, mode=mode, tolerance=args.tolerance)
        seconds = time.perf_counter() - start
        report["capacity"][mode] = {
            "dense_loss": cap.dense_loss, "n_star": cap.n_star,
            "loss": dict(zip(map(str, cap.n_values), cap.loss.tolist())),
            "relative_increase": dict(zip(map(str, cap.n_values), cap.relative_increase.tolist())),
            "seconds": seconds, "forwards": cap.metadata["forwards"], "over_forward": seconds / fwd,
        }
        print(f"{name} {mode}: N* = {cap.n_star}, {seconds:.1f} s", flush=True)
    # The per-head sweep runs L·H copies of its batch: on a small CPU it gets shorter windows.
    head_tokens = tl_geometry.text_windows(model, text, n_seqs=args.head_n_seqs, seq_len=args.head_seq_len)

    def head_forward():
        with torch.no_grad():
            return model(head_tokens, return_type="loss")

    head_fwd, _ = _median_time(head_forward, args.repeats)
    report["head_tokens"], report["head_forward_s"] = list(head_tokens.shape), head_fwd
    for mode in args.head_modes:
        start = time.perf_counter()
        sweep = tl_geometry.capacity.capacity_sweep(model, head_tokens, (args.head_n,), by="head", mode=mode)
        sweep_s = time.perf_counter() - start
        start = time.perf_counter()
        corr = tl_geometry.capacity.capacity_correlation(model, head_tokens, args.head_n, mode=mode, sweep=sweep)
        geometry_s = time.perf_counter() - start
        increase = corr.loss_increase
        flat = increase.flatten()
        top = flat.argsort(descending=True)[:5].tolist()
        report["heads"][mode] = {
            "n": args.head_n, "rho": corr.rho, "sweep_s": sweep_s, "sweep_forwards": sweep.metadata["forwards"],
            "replicas": sweep.metadata["replicas"], "sweep_over_forward": sweep_s / head_fwd,
            "geometry_s": geometry_s,
            "loss_increase": {"median": float(flat.median()), "max": float(flat.max()),
                              "min": float(flat.min())},
            "top_heads": [{"layer": i // model.cfg.n_heads, "head": i % model.cfg.n_heads,
                           "loss_increase": float(flat[i])} for i in top],
            "mean_scores": {k: float(v.nanmean()) for k, v in corr.scores.items()},
        }
        print(f"{name} heads {mode}: ρ = {corr.rho}, sweep {sweep_s:.1f} s", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", help="plain-text file (default: WikiText-2 test if present)")
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--n-seqs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--n-values", default="1,2,4,8,16,32,64")
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--head-n", type=int, default=4)
    parser.add_argument("--head-n-seqs", type=int, default=2, help="windows of the per-head sweep")
    parser.add_argument("--head-seq-len", type=int, default=64, help="their length")
    parser.add_argument("--head-modes", default="renormalize", help="modes of the per-head sweep")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "bench_capacity.json"))
    args = parser.parse_args()
    args.n_values = tuple(int(x) for x in args.n_values.split(","))
    args.head_modes = tuple(x for x in args.head_modes.split(",") if x)
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text, text_name = f.read(), args.text.rsplit("/", 1)[-1]
    else:
        text, text_name = real_text()
    start = time.perf_counter()
    models = [_model_report(name, text, args) for name in args.models.split(",")]
    report = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "processor": platform.processor() or platform.machine()},
        "input": {"text": text_name, "n_seqs": args.n_seqs, "seq_len": args.seq_len,
                  "n_values": list(args.n_values), "tolerance": args.tolerance, "head_n": args.head_n,
                  "head_n_seqs": args.head_n_seqs, "head_seq_len": args.head_seq_len},
        "models": models,
        "total_s": time.perf_counter() - start,
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
