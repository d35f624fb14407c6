"""The ``tl-geometry`` command.

``tl-geometry analyze`` loads an offline model (default SmolLM2-135M), runs it on the built-in
sample text (or ``--text FILE``) with only ``hook_pattern`` and ``hook_v`` cached, and prints the
per-head summary: taxonomy, sink figures and F_N of the top-N sets against random subsets.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _n_values(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--n-values takes comma-separated ints, got {text!r}") from err


def _parser() -> argparse.ArgumentParser:
    from .models import DEFAULT_MODEL, MODELS

    parser = argparse.ArgumentParser(prog="tl-geometry", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    analyze = sub.add_parser("analyze", help="per-head geometric analysis of a model on a text")
    analyze.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    analyze.add_argument("--text", metavar="FILE", help="plain-text file (default: built-in sample)")
    analyze.add_argument("--n-seqs", type=int, default=8, help="windows of text (default 8)")
    analyze.add_argument("--seq-len", type=int, default=128, help="tokens per window, BOS included")
    analyze.add_argument("--queries", choices=("last", "all"), default="last")
    analyze.add_argument("--n-values", type=_n_values, default=(1, 2, 4, 8, 16, 32, 64))
    analyze.add_argument("--random-samples", type=int, default=16)
    analyze.add_argument("--seed", type=int, default=0)
    analyze.add_argument("--distance", choices=("euclidean", "cosine"), default="euclidean")
    analyze.add_argument("--bounds", action="store_true",
                         help="add inversion certificates, regime bounds and envelopes (SPEC §6)")
    analyze.add_argument("--show-n", type=_n_values, default=(2, 4, 8), help="N shown in the table")
    analyze.add_argument("--stream", action="store_true",
                         help="analyse inside the forward pass (no cache; memory of one layer)")
    analyze.add_argument("--batch-size", type=int, default=8, help="sequences per forward with --stream")
    analyze.add_argument("--save", metavar="PATH", help="also save the HeadAnalysis (torch file)")
    analyze.add_argument("--csv", metavar="PATH", help="also write the long-form table as CSV")
    from . import report_cli

    report_cli.add_parser(sub)
    from . import ablation_cli

    ablation_cli.add_parsers(sub)
    from . import capacity_cli

    capacity_cli.add_parser(sub)
    return parser


def _distributed() -> tuple[int, int]:
    """(rank, world size); under torchrun, initialise torch.distributed (gloo on CPU, nccl on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "report":
        from . import report_cli

        return report_cli.run(args, parser)
    if args.command == "capacity":
        from . import capacity_cli

        return capacity_cli.run(args)
    if args.command in ("ablate", "prune"):
        from . import ablation_cli

        return ablation_cli.run(args)
    # Check what can be checked before spending half a minute loading the model.
    if args.n_seqs < 1 or args.seq_len < 2:
        parser.error("--n-seqs must be ≥ 1 and --seq-len ≥ 2")
    if args.random_samples < 1:
        parser.error("--random-samples must be ≥ 1")
    if not [n for n in args.n_values if 1 <= n < args.seq_len]:
        parser.error(f"--n-values needs at least one N with 1 ≤ N < --seq-len ({args.seq_len})")
    if args.text and not Path(args.text).is_file():
        parser.error(f"--text {args.text}: no such file")
    import torch

    import tl_geometry
    from tl_geometry.data import read_text

    text = read_text(args.text) if args.text else None
    rank, world = _distributed()
    log = sys.stderr if rank == 0 else open(os.devnull, "w")  # noqa: SIM115
    start = time.perf_counter()
    print(f"Loading {args.model} (offline, from its PyPI package)...", file=log)
    model = tl_geometry.load_model(args.model)
    tokens = tl_geometry.text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)
    n_values = tuple(n for n in args.n_values if n < args.seq_len)  # larger N cannot be evaluated
    options = dict(n_values=n_values, queries=args.queries, random_samples=args.random_samples,
                   seed=args.seed, distance=args.distance, bounds=args.bounds)
    loaded = time.perf_counter()
    if args.stream or world > 1:
        # Under torchrun every rank analyses its share of the windows; the sums are all-reduced.
        result = tl_geometry.analyze_model(
            model, tokens, batch_size=args.batch_size, shard=(rank, world) if world > 1 else None,
            progress=sys.stderr.isatty() and rank == 0, **options,
        )
        timing = f"streaming analysis on {world} process(es) {time.perf_counter() - loaded:.2f} s"
    else:
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
        forward = time.perf_counter()
        result = tl_geometry.analyze_heads(cache, model=model, progress=sys.stderr.isatty(), **options)
        timing = (f"forward (pattern + v cached) {forward - loaded:.2f} s, "
                  f"analysis {time.perf_counter() - forward:.2f} s")
    result.metadata["text"] = args.text or "built-in sample"
    if rank != 0:
        return 0
    print(result.summary(n_values=args.show_n))
    print(f"\nload {loaded - start:.1f} s, {timing}", file=log)
    if args.save:
        print(f"saved {result.save(args.save)}", file=sys.stderr)
    if args.csv:
        result.to_pandas().to_csv(args.csv, index=False)
        print(f"wrote {args.csv}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
