"""``tl-geometry ablate`` and ``tl-geometry prune`` (SPEC §7), wired into :mod:`tl_geometry.cli`.

``ablate`` prints the loss of a model on real text with and without some heads.
``prune`` runs the single-head sensitivity sweep, the geometric analysis and every removal order
on one set of windows, then the sparsification curves on *other* (held-out) windows, and writes
``sensitivity.csv``, ``sparsification.csv``, ``sensitivity.png`` and ``sparsification.png``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

COMMANDS = ("ablate", "prune")


def _heads(text: str) -> list[tuple[int, int]]:
    """``"3.4,5.0"`` → ``[(3, 4), (5, 0)]``."""
    try:
        pairs = [tuple(int(x) for x in item.split(".")) for item in text.split(",") if item.strip()]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 for p in pairs):
        raise argparse.ArgumentTypeError(
            f"--heads takes LAYER.HEAD pairs separated by commas, e.g. 3.4,5.0; got {text!r}")
    return pairs  # type: ignore[return-value]


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(not 0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"--retention takes fractions in [0, 1] separated by commas; got {text!r}")
    return values


def _common(parser: argparse.ArgumentParser, n_seqs: int, seq_len: int) -> None:
    from .models import DEFAULT_MODEL, MODELS

    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    parser.add_argument("--text", metavar="FILE", help="plain-text file (default: built-in sample)")
    parser.add_argument("--n-seqs", type=int, default=n_seqs, help=f"windows of text (default {n_seqs})")
    parser.add_argument("--seq-len", type=int, default=seq_len, help="tokens per window, BOS included")
    parser.add_argument("--mode", choices=("zero", "mean"), default="zero",
                        help="replace a head's z by zeros or by its mean over the windows")


def add_parsers(sub: Any) -> None:
    """Add the ``ablate`` and ``prune`` subcommands to ``tl-geometry``'s subparsers."""
    ablate = sub.add_parser("ablate", help="loss with and without some heads (ablation on hook_z)")
    ablate.add_argument("--heads", type=_heads, required=True, metavar="L.H,...",
                        help="heads to ablate, e.g. 3.4,5.0 (layer 3 head 4 and layer 5 head 0)")
    _common(ablate, n_seqs=4, seq_len=128)

    prune = sub.add_parser("prune", help="head sensitivity, removal orders and sparsification curves")
    _common(prune, n_seqs=2, seq_len=64)
    prune.add_argument("--retention", type=_fractions, default=(1.0, 0.9, 0.75, 0.5, 0.25))
    prune.add_argument("--seed", type=int, default=0, help="first seed of the random orders")
    prune.add_argument("--n-random", type=int, default=3, help="random orders (seeds seed, seed+1, ...)")
    prune.add_argument("--batch-heads", type=int, default=None,
                       help="heads scored per forward (default: by a 2 GiB memory budget)")
    prune.add_argument("--out", metavar="DIR", default="prune-results",
                       help="output folder for the CSV files and plots (default prune-results)")


def run(args: argparse.Namespace) -> int:
    """Run ``ablate`` or ``prune``; returns the exit status."""
    if args.n_seqs < 1 or args.seq_len < 3:
        print("error: --n-seqs must be ≥ 1 and --seq-len ≥ 3", file=sys.stderr)
        return 2
    if args.text and not Path(args.text).is_file():
        print(f"error: --text {args.text}: no such file", file=sys.stderr)
        return 2
    if args.command == "prune" and (args.n_random < 1 or (args.batch_heads is not None and args.batch_heads < 1)):
        print("error: --n-random and --batch-heads must be ≥ 1", file=sys.stderr)
        return 2
    import tl_geometry
    from tl_geometry.data import read_text

    text = read_text(args.text) if args.text else None
    print(f"Loading {args.model} (offline, from its PyPI package)...", file=sys.stderr)
    model = tl_geometry.load_model(args.model)
    try:
        return _ablate(model, text, args) if args.command == "ablate" else _prune(model, text, args)
    except ValueError as err:  # bad heads, too short a text, ...: the message names the fix
        print(f"error: {err}", file=sys.stderr)
        return 2


def _ablate(model: Any, text: str | None, args: argparse.Namespace) -> int:
    import torch

    import tl_geometry

    tokens = tl_geometry.text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)
    ablation = tl_geometry.ablate_heads(model, args.heads, args.mode,
                                        reference_tokens=tokens if args.mode == "mean" else None)
    with torch.no_grad():
        base = float(model(tokens, return_type="loss"))
        with ablation:
            ablated = float(model(tokens, return_type="loss"))
    heads = ", ".join(f"L{layer}H{head}" for layer, head in ablation.heads)
    print(f"{tokens.shape[0]} × {tokens.shape[1]} tokens of {args.text or 'the built-in sample'}")
    print(f"loss without ablation  {base:.4f}  (perplexity {math.exp(base):.2f})")
    print(f"loss, {args.mode}-ablated {heads}: {ablated:.4f}  (perplexity {math.exp(ablated):.2f}, "
          f"Δ {ablated - base:+.4f})")
    return 0


def _prune(model: Any, text: str | None, args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import tl_geometry

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Twice the windows: the first half scores the heads, the second half is held out.
    windows = tl_geometry.text_windows(model, text, n_seqs=2 * args.n_seqs, seq_len=args.seq_len)
    scoring, held_out = windows[: args.n_seqs], windows[args.n_seqs:]
    start = time.perf_counter()
    sens = tl_geometry.head_sensitivity(model, scoring, args.mode, batch_heads=args.batch_heads)
    swept = time.perf_counter()
    analysis = tl_geometry.analyze_model(model, scoring, n_values=(2,))
    seeds = range(args.seed, args.seed + args.n_random)
    orders = tl_geometry.head_orderings(model, scoring, analysis=analysis, sensitivity=sens, seeds=seeds)
    # Mean ablation replaces a head by its mean z over the scoring windows, not the held-out ones.
    curve = tl_geometry.sparsification_curve(model, held_out, orders, args.retention, mode=args.mode,
                                             reference_tokens=scoring if args.mode == "mean" else None,
                                             batch_size=args.batch_heads)
    done = time.perf_counter()

    sens.to_pandas().to_csv(out / "sensitivity.csv", index=False)
    curve.to_pandas().to_csv(out / "sparsification.csv", index=False)
    for name, figure in (("sensitivity.png", sens.plot()), ("sparsification.png", curve.plot())):
        figure.tight_layout()
        figure.savefig(out / name, dpi=120)
        plt.close(figure)

    print(f"{len(scoring)} × {args.seq_len} scoring and {len(held_out)} × {args.seq_len} held-out tokens "
          f"of {args.text or 'the built-in sample'}; {args.mode} ablation; unablated loss "
          f"{sens.base_loss:.4f} (scoring), {curve.base_loss:.4f} (held out)")
    critical = sens.critical()
    print(f"\ncritical heads (Δ loss > median + 3.5·1.4826·MAD): {len(critical)}")
    top = sens.top(10)
    print(top.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    print("\nheld-out loss by ordering (rows) and retention (columns):")
    print(curve.summary().to_string())
    print(f"\nsensitivity sweep {swept - start:.1f} s ({sens.metadata['forwards']} forwards), "
          f"orders + curves {done - swept:.1f} s; wrote {out}/sensitivity.csv, sparsification.csv, "
          "sensitivity.png, sparsification.png", file=sys.stderr)
    return 0
