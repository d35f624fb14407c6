"""``tl-geometry ablate`` and ``tl-geometry prune`` (docs/ablation.md; what each does: :data:`ABLATE`,
:data:`PRUNE`)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

from ..ablation.hooks import MODES
from . import args as cli

ABLATE = """\
Print the loss of a model on real text with and without some heads. A head's output z (hook_z,
one slice per query head, so one query head at a time even under grouped-query attention) is
replaced by zeros or by its mean over the windows. The listed heads are ablated together, or with
--each one at a time (one line per head). The loss change comes with its standard error over the
windows; with --n-random the set is compared with random sets of as many heads (z and an
empirical p). Definitions: docs/math.md, section 7; docs/ablation.md.

examples:
  tl-geometry ablate --heads 3.4,5.0                 # layer 3 head 4 and layer 5 head 0, together
  tl-geometry ablate --heads 3.4,5.0 --each          # each head alone: Δ loss ± SE per head
  tl-geometry ablate --heads 0.3 --mode mean --text corpus.txt
  tl-geometry ablate --heads 1.5,1.4 --n-random 50 --same-layers
"""

PRUNE = """\
Score every head by the loss increase when it alone is ablated, rank the heads by several removal
orders (taxonomy, weight norm, entropy, random, oracle), and measure the loss on held-out windows
as heads are removed in each order. Writes DIR/sensitivity.csv, DIR/sparsification.csv and two
plots; tl-geometry report --out DIR then adds an Ablation section. See docs/ablation.md.

examples:
  tl-geometry prune --out prune-results
  tl-geometry prune --model gemma3-270m --text corpus.txt --retention 1,0.75,0.5 --n-random 5
"""


def _heads(text: str) -> list[tuple[int, int]]:
    """``"3.4,5.0"`` → ``[(3, 4), (5, 0)]``."""
    try:
        pairs = [tuple(int(x) for x in item.split(".")) for item in text.split(",") if item.strip()]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 for p in pairs):
        raise argparse.ArgumentTypeError(
            f"takes LAYER.HEAD pairs separated by commas, e.g. 3.4,5.0; got {text!r}")
    if any(x < 0 for p in pairs for x in p):
        raise argparse.ArgumentTypeError(f"layer and head indices start at 0; got {text!r}")
    twice = sorted({p for p in pairs if pairs.count(p) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"lists {'.'.join(map(str, twice[0]))} twice; give each head once")
    return pairs  # type: ignore[return-value]


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(not 0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"takes fractions in [0, 1] separated by commas, "
                                         f"e.g. 1,0.75,0.5; got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"lists a fraction twice; give each once, got {text!r}")
    return values


def _common(parser: argparse.ArgumentParser, n_seqs: int, seq_len: int) -> None:
    cli.add_model_options(parser, n_seqs=n_seqs, seq_len=seq_len)
    parser.add_argument("--mode", choices=MODES, default="zero",
                        help="replace a head's z by zeros or by its mean over the windows")


def add_parser(sub: Any, name: str) -> argparse.ArgumentParser:
    """Add ``ablate`` or ``prune`` (``name``) to ``tl-geometry``'s subparsers."""
    if name == "ablate":
        ablate = sub.add_parser(name, help="loss with and without some heads (ablation on hook_z)",
                                description=ABLATE)
        ablate.add_argument("--heads", type=_heads, required=True, metavar="L.H,...",
                            help="heads to ablate, e.g. 3.4,5.0 (layer 3 head 4 and layer 5 head 0)")
        _common(ablate, n_seqs=4, seq_len=128)
        ablate.add_argument("--each", action="store_true",
                            help="ablate the listed heads one at a time and print each one's loss "
                                 "change with its standard error (default: all together)")
        ablate.add_argument("--n-random", type=cli.positive_int, default=None, metavar="K",
                            help="also ablate K random sets of as many heads and report z and an "
                                 "empirical p (default: none)")
        ablate.add_argument("--same-layers", action="store_true",
                            help="draw the random sets from the same layers, as many heads per layer")
        ablate.add_argument("--seed", type=cli.seed, default=0, help="seed of the random sets")
        cli.add_progress_option(ablate)
        return ablate
    prune = sub.add_parser(name, help="head sensitivity, removal orders and sparsification curves",
                           description=PRUNE)
    _common(prune, n_seqs=2, seq_len=64)
    prune.add_argument("--retention", type=_fractions, default="1,0.9,0.75,0.5,0.25",
                       metavar="F,F,...", help="fractions of heads kept at which the loss is measured")
    prune.add_argument("--seed", type=cli.seed, default=0, help="first seed of the random orders")
    prune.add_argument("--n-random", type=cli.positive_int, default=3, metavar="K",
                       help="random orders (seeds seed, seed+1, ...)")
    prune.add_argument("--batch-heads", type=cli.positive_int, default=None, metavar="B",
                       help="heads scored per forward (default: by a 2 GiB memory budget)")
    prune.add_argument("--out", metavar="DIR", default="prune-results",
                       help="output folder for the CSV files and plots (created if needed)")
    cli.add_progress_option(prune)
    return prune


def run(args: argparse.Namespace) -> int:
    """Run ``ablate`` or ``prune``; returns the exit status (bad arguments raise ``UsageError``;
    head indices, checked after the load, a ``ValueError``)."""
    cli.check_model_and_windows(args, min_seq_len=3)
    if args.command == "ablate" and args.each and args.n_random:
        raise cli.UsageError("--n-random compares the listed heads as one set with random sets; "
                             "it does not combine with --each. Drop one of them.")
    if args.command == "prune":
        cli.check_output_dir(args.out, "--out")
        # Twice the windows: the first half scores the heads, the second half is held out.
        text = cli.read_input_text(argparse.Namespace(**{**vars(args), "n_seqs": 2 * args.n_seqs}))
    else:
        text = cli.read_input_text(args)

    model = cli.load_cli_model(args, log=sys.stderr)
    return _ablate(model, text, args) if args.command == "ablate" else _prune(model, text, args)


def _ablate(model: Any, text: str | None, args: argparse.Namespace) -> int:
    import torch

    from ..ablation import ablate_heads, ablation_vs_random
    from ..forward.losses import window_losses
    from ..functional.uncertainty import paired_window_se
    from ..inputs.text import text_windows

    tokens = text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)
    if args.each:
        return _ablate_each(model, tokens, args)
    ablation = ablate_heads(model, args.heads, args.mode, reference_tokens=tokens if args.mode == "mean" else None)
    with torch.no_grad():
        base = float(model(tokens, return_type="loss"))
        dense = window_losses(model, tokens)
        with ablation:
            ablated = float(model(tokens, return_type="loss"))
            per_window = window_losses(model, tokens)
    se = float(paired_window_se(per_window.loss - dense.loss, dense.weight)[0])
    heads = ", ".join(f"L{layer}H{head}" for layer, head in ablation.heads)
    _print_unablated(tokens, args, base)
    print(f"loss, {args.mode}-ablated {heads}: {ablated:.4f}  (perplexity {math.exp(ablated):.2f}, "
          f"Δ {ablated - base:+.4f} ± {se:.4f} SE over {tokens.shape[0]} windows)")
    if args.n_random:
        cmp = ablation_vs_random(model, tokens, args.heads, n_random=args.n_random,
                                 same_layers=args.same_layers, seed=args.seed, mode=args.mode,
                                 progress=cli.show_progress(args))
        print(cmp.summary())
    return 0


def _ablate_each(model: Any, tokens: Any, args: argparse.Namespace) -> int:
    """``ablate --each``: the listed heads one at a time, from one sensitivity sweep limited to
    them (the same loss changes and standard errors over windows as ``head_sensitivity``)."""
    from ..ablation import head_sensitivity

    progress = cli.show_progress(args)
    sens = head_sensitivity(model, tokens, args.mode, heads=args.heads, progress=progress)
    increase, se, verdicts = sens.loss_increase, sens.loss_increase_se, sens.criticality()
    _print_unablated(tokens, args, sens.base_loss)
    print(f"one head at a time, {args.mode}-ablated (Δ ± SE over {sens.n_windows} windows):")
    for layer, head in args.heads:
        loss = float(sens.loss[layer, head])
        print(f"  L{layer}H{head}  loss {loss:.4f}  (perplexity {math.exp(loss):.2f}, "
              f"Δ {float(increase[layer, head]):+.4f} ± {float(se[layer, head]):.4f} SE)"
              + (f"  {verdicts[layer][head]}" if verdicts[layer][head] in ("critical", "undecided") else ""))
    if any(verdicts[layer][head] in ("critical", "undecided") for layer, head in args.heads):
        print("critical: the 95% interval of Δ over the windows lies at or above max(0.1 nats, 5% "
              "of the unablated loss); undecided: it straddles that (docs/ablation.md)")
    return 0


def _print_unablated(tokens: Any, args: argparse.Namespace, loss: float) -> None:
    print(f"{tokens.shape[0]} × {tokens.shape[1]} tokens of {args.text or 'the built-in sample'}")
    print(f"loss without ablation  {loss:.4f}  (perplexity {math.exp(loss):.2f})")


def _prune(model: Any, text: str | None, args: argparse.Namespace) -> int:
    from ..ablation import head_orderings, head_sensitivity, sparsification_curve
    from ..analyze.from_model import analyze_model
    from ..inputs.text import text_windows

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Twice the windows: the first half scores the heads, the second half is held out.
    windows = text_windows(model, text, n_seqs=2 * args.n_seqs, seq_len=args.seq_len)
    scoring, held_out = windows[: args.n_seqs], windows[args.n_seqs:]
    progress = cli.show_progress(args)
    start = time.perf_counter()
    sens = head_sensitivity(model, scoring, args.mode, batch_heads=args.batch_heads, progress=progress)
    swept = time.perf_counter()
    analysis = analyze_model(model, scoring, n_values=(2,), progress=progress)
    seeds = range(args.seed, args.seed + args.n_random)
    orders = head_orderings(model, scoring, analysis=analysis, sensitivity=sens, seeds=seeds, progress=progress)
    # Mean ablation replaces a head by its mean z over the scoring windows, not the held-out ones.
    curve = sparsification_curve(model, held_out, orders, args.retention, mode=args.mode,
                                 reference_tokens=scoring if args.mode == "mean" else None,
                                 batch_size=args.batch_heads, progress=progress)
    done = time.perf_counter()

    sens.to_pandas().to_csv(out / "sensitivity.csv", index=False)
    curve.to_pandas().to_csv(out / "sparsification.csv", index=False)
    for name, figure in (("sensitivity.png", sens.plot()), ("sparsification.png", curve.plot())):
        figure.savefig(out / name, dpi=120)  # figures built without pyplot: nothing to close

    print(f"{len(scoring)} × {args.seq_len} scoring and {len(held_out)} × {args.seq_len} held-out tokens "
          f"of {args.text or 'the built-in sample'}; {args.mode} ablation; unablated loss "
          f"{sens.base_loss:.4f} (scoring), {curve.base_loss:.4f} (held out)")
    critical = sens.critical()
    threshold = max(0.1, 0.05 * sens.base_loss)
    print(f"\ncritical heads (the 95% interval of Δ loss over {sens.n_windows} windows at or above "
          f"{threshold:.3f} nats = max(0.1, 5% of the dense loss)): {len(critical)}"
          + (" — " + ", ".join(f"L{layer}H{head}" for layer, head in critical) if critical else ""))
    top = sens.top(10)
    print(top.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    print("\nheld-out loss by ordering (rows) and retention (columns):")
    print(curve.summary().to_string())
    print(f"\nsensitivity sweep {swept - start:.1f} s ({sens.metadata['forwards']} forwards), "
          f"orders + curves {done - swept:.1f} s; wrote {out}/sensitivity.csv, sparsification.csv, "
          "sensitivity.png, sparsification.png", file=sys.stderr)
    return 0
