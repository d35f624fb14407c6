"""``tl-geometry capacity``: retrieval capacity of a model under top-N attention (per mode, the
loss curve over ``--n-values`` and N*; the per-head sweep at ``--head-n`` and its Spearman ρ with
each head's geometry). Writes into ``--out DIR`` the tables, plots and page of docs/capacity.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..capacity.topn import SPARSIFY_MODES
from . import args as cli

if TYPE_CHECKING:
    from ..capacity.topn import SparsifyMode

MODE_CHOICES = ("both", *SPARSIFY_MODES)


DESCRIPTION = """\
Retrieval capacity: the loss when every head keeps only each query's top-N keys (renormalised,
or the rest deleted), N* (the smallest N within --tolerance of the dense loss), and, per head,
Spearman's rho between its F_N (and shell certificate) and the loss of sparsifying it alone.
See docs/capacity.md.

examples:
  tl-geometry capacity --out capacity-results
  tl-geometry capacity --model gemma3-270m --text corpus.txt --n-values 2,4,8,16,32 --mode delete
  tl-geometry capacity --head-n 0          # N curves only, no per-head sweep
"""


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):  # inf / nan: N* would be meaningless
        raise argparse.ArgumentTypeError(f"expected a finite relative loss increase ≥ 0 such as "
                                         f"0.05, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    value = cli.whole_number(text, "a whole number ≥ 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number ≥ 0, got {text!r}")
    return value


def add_parser(sub: Any, name: str) -> argparse.ArgumentParser:
    """Add the ``capacity`` subcommand to ``tl-geometry``'s subparsers."""
    from ..capacity.sweep import DEFAULT_N_VALUES, DEFAULT_TOLERANCE

    p = sub.add_parser(name, help="loss under top-N attention: N* and geometry-vs-loss per head",
                       description=DESCRIPTION)
    cli.add_model_options(p, n_seqs=4, seq_len=128)
    p.add_argument("--n-values", type=cli.int_list, default=",".join(map(str, DEFAULT_N_VALUES)),
                   metavar="N,N,...", help="N values of the loss curves")
    p.add_argument("--mode", choices=MODE_CHOICES, default="both",
                   help="renormalize the kept weights, delete the rest, or both")
    p.add_argument("--tolerance", type=_fraction, default=DEFAULT_TOLERANCE,
                   help="relative loss increase that still counts as dense")
    p.add_argument("--head-n", type=_non_negative, default=4,
                   help="N of the per-head sweep and correlation (0: skip them)")
    p.add_argument("--batch-size", type=cli.positive_int, default=None,
                   help="replicas per forward (default: by a 2 GiB memory budget)")
    p.add_argument("--out", metavar="DIR", default="capacity-results", help="output folder")
    cli.add_progress_option(p)
    return p


def _check_n_fits(args: argparse.Namespace) -> None:
    """Some N must be shorter than the windows: an N ≥ --seq-len keeps every key and only
    repeats the dense loss, so a run where no N is shorter would measure nothing."""
    cli.check_n_below(args, "so every curve point is the dense loss")
    if args.head_n >= args.seq_len:
        raise cli.UsageError(f"--head-n {args.head_n} is ≥ --seq-len {args.seq_len}: the per-head "
                             "sweep would keep every key; give a smaller --head-n (0 skips it) or "
                             "longer windows.")


def run(args: argparse.Namespace) -> int:
    """Run ``tl-geometry capacity``; returns the exit status (bad arguments raise ``UsageError``)."""
    cli.check_model_and_windows(args, min_seq_len=3)
    _check_n_fits(args)
    cli.check_output_dir(args.out, "--out")
    text = cli.read_input_text(args)
    model = cli.load_cli_model(args, log=sys.stderr)
    return _capacity(model, text, args)


def _capacity(model: Any, text: str | None, args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    from ..capacity import capacity_correlation, retrieval_capacity
    from ..inputs.text import text_windows
    from ..views.capacity import capacity_plot, correlation_plot
    from ..views.plots import save_figure
    from ..views.report import capacity_section, write_section

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)
    modes: tuple[SparsifyMode, ...] = ("renormalize", "delete") if args.mode == "both" else (args.mode,)
    start = time.perf_counter()
    curves, heads = [], []
    progress = cli.show_progress(args)
    for mode in modes:
        cap = retrieval_capacity(model, tokens, args.n_values, mode=mode, tolerance=args.tolerance,
                                 batch_size=args.batch_size, progress=progress)
        curves.append(cap.to_pandas())
        line = f"{mode:>11}: dense loss {cap.dense_loss:.4f}, N* = {cap.n_star} (within {args.tolerance:.0%})"
        if args.head_n:
            corr = capacity_correlation(model, tokens, args.head_n, mode=mode, batch_size=args.batch_size,
                                        progress=progress)
            heads.append(corr.to_pandas())
            line += f"; Spearman ρ vs Δ loss at N={args.head_n}: " + ", ".join(
                f"{name} {rho:+.3f}" for name, rho in corr.rho.items())
        print(line)
    seconds = time.perf_counter() - start
    curve = pd.concat(curves, ignore_index=True)
    curve.to_csv(out / "capacity.csv", index=False)
    print(curve.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    figures = [("capacity", capacity_plot(curve))]
    if heads:
        table = pd.concat(heads, ignore_index=True)
        table.to_csv(out / "capacity_heads.csv", index=False)
        for mode in modes:
            figures.append((f"capacity_heads_{mode}", correlation_plot(table[table["mode"] == mode])))
    for name, figure in figures:
        save_figure(figure, out / name, dpi=100)
    page = write_section(capacity_section(out, out / "figures"), out / "capacity.html",
                         title=f"Retrieval capacity — {args.model}")
    print(f"\n{len(tokens)} × {args.seq_len} tokens of {args.text or 'the built-in sample'}; "
          f"{seconds:.1f} s; wrote {out}/capacity.csv" + (", capacity_heads.csv" if heads else "")
          + f", plots and {page.name}", file=sys.stderr)
    return 0
