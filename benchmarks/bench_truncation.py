"""Certified top-N truncation (SPEC §10): per-head policies against a uniform N (not run in CI).

On windows of real text (WikiText-2 test when available; the first ``--cal-seqs`` windows calibrate,
the next ``--eval-seqs`` are held out):

1. ``analyze_model`` over every query of the calibration windows gives each head's 90th-percentile
   tail mass ``τ_N`` on the ``--n-values`` grid, hence its certified budget ``k_ε``
   (``truncation_budgets``) for each ``--eps``: a per-head policy ``TopNPolicy.from_result``.
2. On the held-out windows: the loss of each policy (renormalised top-N, every head at its own N;
   heads with no certified N stay dense) against the loss of a uniform N with the same mean number
   of kept keys per (query, head) (``TopNPolicy.kept_keys``: the nearest integer N), and the loss
   of every uniform N of the grid (the loss-against-budget curve). Every difference comes with its
   standard error over the held-out windows (paired).
3. With ``--corr-n``: ``capacity_correlation`` at that N on ``--corr-seqs`` short held-out windows:
   Spearman's ρ across heads of F_N, the tail mass and the relative truncation error against the
   loss of sparsifying each head alone.

    python benchmarks/bench_truncation.py [--model smollm2-135m] [--seq-len 64] [--cal-seqs 4]
        [--eval-seqs 8] [--n-values 1,2,4,8,16,32] [--eps 0.01,0.05,0.1,0.2,0.3]
        [--corr-n 4] [--corr-seqs 2] [--corr-seq-len 48] [--out benchmarks/results/bench_truncation.json]
"""

from __future__ import annotations

import argparse
import math
import platform
import time

import torch
from _common import RESULTS, real_text, write_report


def _window_losses(model, tokens: torch.Tensor, hooks=None) -> torch.Tensor:
    """Mean next-token loss of every window (float64), under ``hooks`` if given."""
    with torch.no_grad():
        if hooks is None:
            per_token = model(tokens, return_type="loss", loss_per_token=True)
        else:
            with hooks:
                per_token = model(tokens, return_type="loss", loss_per_token=True)
    return per_token.double().mean(-1).cpu()


def _compare(losses: torch.Tensor, other: torch.Tensor) -> dict:
    """Mean loss of ``losses``, and its paired difference from ``other`` with the standard error."""
    diff = losses - other
    se = float(diff.std(unbiased=True) / math.sqrt(len(diff))) if len(diff) > 1 else math.nan
    return {"loss": float(losses.mean()), "minus": float(diff.mean()), "se": se}


def _nearest_uniform(target: float, n_pos: int, n_layers: int, n_heads: int) -> tuple[int, float]:
    """The integer N whose uniform policy keeps the number of keys nearest ``target`` (ties → the
    smaller N), with that number."""
    from tl_geometry.capacity import TopNPolicy

    best = None
    for n in range(1, n_pos + 1):
        kept = TopNPolicy.uniform(n, n_layers, n_heads).kept_keys(n_pos)
        if best is None or abs(kept - target) < abs(best[1] - target):
            best = (n, kept)
        if kept > target:
            break
    assert best is not None
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", help="plain-text file (default: WikiText-2 test if present)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--cal-seqs", type=int, default=4, help="calibration windows (the budgets)")
    parser.add_argument("--eval-seqs", type=int, default=8, help="held-out windows (the losses)")
    parser.add_argument("--n-values", default="1,2,4,8,16,32")
    parser.add_argument("--eps", default="0.01,0.05,0.1,0.2,0.3")
    parser.add_argument("--corr-n", type=int, default=4, help="N of capacity_correlation (0: skip it)")
    parser.add_argument("--corr-seqs", type=int, default=2)
    parser.add_argument("--corr-seq-len", type=int, default=48)
    parser.add_argument("--out", default=str(RESULTS / "bench_truncation.json"))
    args = parser.parse_args()
    n_values = tuple(int(x) for x in args.n_values.split(","))
    eps_values = tuple(float(x) for x in args.eps.split(","))

    import tl_geometry
    from tl_geometry.capacity import TopNPolicy, top_n_attention

    start = time.perf_counter()
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text, text_name = f.read(), args.text.rsplit("/", 1)[-1]
    else:
        text, text_name = real_text()
    model = tl_geometry.load_model(args.model)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    windows = tl_geometry.text_windows(model, text, n_seqs=args.cal_seqs + args.eval_seqs, seq_len=args.seq_len)
    calibration, held_out = windows[: args.cal_seqs], windows[args.cal_seqs:]

    t0 = time.perf_counter()
    result = tl_geometry.analyze_model(model, calibration, n_values=n_values, queries="all",
                                       random_samples=0, shuffle_samples=0, progress=False)
    analyze_s = time.perf_counter() - t0
    p90 = result.truncation_percentile("tail_mass")  # [layer, head, n]
    print(f"analyze_model over {calibration.shape[0]}×{args.seq_len} tokens, every query: {analyze_s:.1f} s",
          flush=True)

    dense = _window_losses(model, held_out)
    uniform = {}
    for n in n_values:
        losses = _window_losses(model, held_out, top_n_attention(model, n))
        kept = TopNPolicy.uniform(n, n_layers, n_heads).kept_keys(args.seq_len)
        uniform[str(n)] = {"kept_keys": kept, **_compare(losses, dense)}
        print(f"uniform N={n:>3}: kept {kept:6.2f} keys, loss {uniform[str(n)]['loss']:.4f}", flush=True)

    policies = []
    for eps in eps_values:
        policy = TopNPolicy.from_result(result, eps, n_layers=n_layers)
        budgets = policy.n[policy.mask]
        row: dict = {"eps": eps, "dense_heads": int((~policy.mask).sum()),
                     "budget_counts": {str(n): int((budgets == n).sum()) for n in n_values},
                     "kept_keys": policy.kept_keys(args.seq_len)}
        if policy.mask.any():
            losses = _window_losses(model, held_out, top_n_attention(model, policy))
            n_match, kept_match = _nearest_uniform(row["kept_keys"], args.seq_len, n_layers, n_heads)
            matched = _window_losses(model, held_out, top_n_attention(model, n_match))
            row.update(policy=_compare(losses, dense), uniform_n=n_match, uniform_kept_keys=kept_match,
                       uniform=_compare(matched, dense), policy_minus_uniform=_compare(losses, matched))
            print(f"ε={eps}: {row['dense_heads']} dense heads, kept {row['kept_keys']:.2f} keys, loss "
                  f"{row['policy']['loss']:.4f}; uniform N={n_match} (kept {kept_match:.2f}) "
                  f"{row['uniform']['loss']:.4f}; policy − uniform {row['policy_minus_uniform']['minus']:+.4f} "
                  f"± {row['policy_minus_uniform']['se']:.4f}", flush=True)
        else:
            row["policy"] = {"loss": float(dense.mean()), "minus": 0.0, "se": 0.0}
            print(f"ε={eps}: no head certified: the policy is the dense model", flush=True)
        policies.append(row)

    correlation = None
    if args.corr_n:
        corr_tokens = tl_geometry.text_windows(model, text, n_seqs=args.cal_seqs + args.eval_seqs + args.corr_seqs,
                                               seq_len=args.corr_seq_len)[-args.corr_seqs:]
        t0 = time.perf_counter()
        corr = tl_geometry.capacity.capacity_correlation(model, corr_tokens, args.corr_n)
        correlation = {"n": args.corr_n, "tokens": list(corr_tokens.shape), "rho": corr.rho,
                       "seconds": time.perf_counter() - t0,
                       "mean_scores": {k: float(v.nanmean()) for k, v in corr.scores.items()},
                       "summary": corr.summary()}
        print(corr.summary(), flush=True)

    report = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "processor": platform.processor() or platform.machine()},
        "input": {"model": args.model, "text": text_name, "seq_len": args.seq_len, "cal_seqs": args.cal_seqs,
                  "eval_seqs": args.eval_seqs, "n_values": list(n_values), "eps": list(eps_values),
                  "mode": "renormalize", "queries": "all"},
        "analyze_s": analyze_s,
        "p90_tail_mass_median_over_heads": {str(n): float(p90[..., i].nanmedian()) for i, n in enumerate(n_values)},
        "dense_loss": float(dense.mean()),
        "uniform": uniform,
        "policies": policies,
        "correlation": correlation,
        "total_s": time.perf_counter() - start,
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
