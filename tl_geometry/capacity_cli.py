"""``tl-geometry capacity``: retrieval capacity of a model under top-N attention (issue 16).

Loads a model, cuts its text into windows, and for each mode (``renormalize``, ``delete``):
the loss with every head keeping only each query's top-N keys for every ``--n-values`` N, and
``N*`` (smallest N within ``--tolerance`` of the dense loss); then the per-head sweep at
``--head-n`` and Spearman's ρ between each head's F_N (and its shell certificate) and the loss
of sparsifying that head alone. Writes into ``--out DIR``::

    capacity.csv          n, mode, scope, tolerance, loss, dense_loss, relative_increase, ...
    capacity_heads.csv    layer, head, n, mode, f_score, shell_k0, shell_kn, loss_increase
    capacity.png|svg      loss against N per mode, N* marked
    capacity_heads.png    per head: geometry against loss increase, ρ in the titles
    capacity.html         the "Retrieval capacity" section (also added by ``tl-geometry report
                          --out DIR`` to the full report)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .ablation.topn import SparsifyMode

MODE_CHOICES = ("both", "renormalize", "delete")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--n-values takes ints ≥ 1 separated by commas; got {text!r}")
    return values


def add_parser(sub: Any) -> None:
    """Add the ``capacity`` subcommand to ``tl-geometry``'s subparsers."""
    from .ablation.capacity import DEFAULT_N_VALUES, DEFAULT_TOLERANCE
    from .models import DEFAULT_MODEL, MODELS

    p = sub.add_parser("capacity", help="loss under top-N attention: N* and geometry-vs-loss per head")
    p.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    p.add_argument("--text", metavar="FILE", help="plain-text file (default: built-in sample)")
    p.add_argument("--n-seqs", type=int, default=4, help="windows of text (default 4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window, BOS included")
    p.add_argument("--n-values", type=_ints, default=DEFAULT_N_VALUES, help="N values, e.g. 1,2,4,8")
    p.add_argument("--mode", choices=MODE_CHOICES, default="both",
                   help="renormalize the kept weights, delete the rest, or both (default)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="relative loss increase that still counts as dense (default 0.05)")
    p.add_argument("--head-n", type=int, default=4,
                   help="N of the per-head sweep and correlation (0: skip them; default 4)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="replicas per forward (default: by a 2 GiB memory budget)")
    p.add_argument("--out", metavar="DIR", default="capacity-results",
                   help="output folder (default capacity-results)")


def run(args: argparse.Namespace) -> int:
    """Run ``tl-geometry capacity``; returns the exit status."""
    problems = []
    if args.n_seqs < 1 or args.seq_len < 3:
        problems.append("--n-seqs must be ≥ 1 and --seq-len ≥ 3")
    if not args.tolerance >= 0:
        problems.append("--tolerance must be ≥ 0")
    if args.head_n < 0 or (args.batch_size is not None and args.batch_size < 1):
        problems.append("--head-n must be ≥ 0 and --batch-size ≥ 1")
    if args.text and not Path(args.text).is_file():
        problems.append(f"--text {args.text}: no such file")
    if problems:
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    import tl_geometry
    from tl_geometry.data import read_text

    text = read_text(args.text) if args.text else None
    print(f"Loading {args.model} (offline, from its PyPI package)...", file=sys.stderr)
    model = tl_geometry.load_model(args.model)
    try:
        return _capacity(model, text, args)
    except ValueError as err:  # too short a text, ...: the message names the fix
        print(f"error: {err}", file=sys.stderr)
        return 2


def _capacity(model: Any, text: str | None, args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    import tl_geometry
    from tl_geometry.report import capacity_section, write_section
    from tl_geometry.views.capacity import capacity_plot, correlation_plot
    from tl_geometry.views.plots import save_figure

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = tl_geometry.text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)
    modes: tuple[SparsifyMode, ...] = ("renormalize", "delete") if args.mode == "both" else (args.mode,)
    start = time.perf_counter()
    curves, heads = [], []
    for mode in modes:
        cap = tl_geometry.retrieval_capacity(model, tokens, args.n_values, mode=mode, tolerance=args.tolerance,
                                             batch_size=args.batch_size, progress=sys.stderr.isatty())
        curves.append(cap.to_pandas())
        line = f"{mode:>11}: dense loss {cap.dense_loss:.4f}, N* = {cap.n_star} (within {args.tolerance:.0%})"
        if args.head_n:
            corr = tl_geometry.capacity_correlation(model, tokens, args.head_n, mode=mode,
                                                    batch_size=args.batch_size, progress=sys.stderr.isatty())
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
