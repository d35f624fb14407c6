"""``tl-geometry analyze``: load a model, run it on text, print the per-head summary.

Only ``hook_pattern`` and ``hook_v`` are cached; with ``--stream``, ``--attention recompute`` or
under ``torchrun`` nothing is: the analysis runs inside the forward pass.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, get_args

from ..analyze.from_model import ATTENTION_SOURCES
from ..engine.options import DEFAULT_N_VALUES, DEFAULT_SHUFFLE, Distance, ShuffleKind
from . import args as cli

DESCRIPTION = """\
Per-head geometric analysis of a model on real text: for each layer and head, the precision,
recall and F-score of the top-N attended keys' contributions α_i·v_i against the rest, next to
random subsets of the same size; the attention-sink figures; the Retriever / Mixer / Reset class.
Definitions: docs/math.md.

examples:
  tl-geometry analyze
  tl-geometry analyze --model gemma3-270m --text corpus.txt --n-seqs 16 --seq-len 256
  tl-geometry analyze --model ./my-hf-folder --n-values 2,4,8 --show-n 2,4 --csv heads.csv
  tl-geometry analyze --bounds --save run.pt        # then HeadAnalysis.load("run.pt")
  tl-geometry analyze --model gemma3-270m --n-seqs 1 --seq-len 4096 --attention recompute
  tl-geometry analyze --labels labels.csv           # one row per head: class, votes, margin, stability
  tl-geometry analyze --shuffle norms --save norms.pt  # a decomposition null (same seed, same permutations)
  torchrun --nproc-per-node 2 -m tl_geometry analyze --n-seqs 64 --save run.pt
"""


#: ``--shuffle``'s choices: the analysis option's ``Literal``, one source.
SHUFFLE_CHOICES: tuple[str, ...] = get_args(ShuffleKind)


def add_parser(sub: Any, name: str) -> argparse.ArgumentParser:
    """Add ``analyze`` to the ``tl-geometry`` subcommands."""
    parser = sub.add_parser(name, help="per-head geometric analysis of a model on a text",
                            description=DESCRIPTION)
    cli.add_model_options(parser, n_seqs=8, seq_len=128)
    parser.add_argument("--queries", type=cli.query_option, default="last", metavar="last|all|K",
                        help="analyse each window's last query, every query (slower, ~50×), or a seeded "
                             "sample of K positions per window (the votes read every query whatever it is)")
    parser.add_argument("--n-values", type=cli.int_list, default=",".join(map(str, DEFAULT_N_VALUES)),
                        metavar="N,N,...",
                        help="selection sizes N, distinct and ≥ 1, separated by commas; an N ≥ "
                             "--seq-len is dropped")
    parser.add_argument("--random-samples", type=cli.positive_int, default=None, metavar="R",
                        help="random subsets per query and head for the baseline (default: 16 at the "
                             "last query, 4 with more queries; more: slower, less noisy)")
    parser.add_argument("--shuffle-samples", type=cli.positive_int, default=None, metavar="R",
                        help="value permutations per query and head for the value-shuffle null "
                             "(same attention and top-N set, values shuffled; default as --random-samples)")
    parser.add_argument("--shuffle", choices=SHUFFLE_CHOICES, default=DEFAULT_SHUFFLE,
                        help="which null the 'shuffled' group is: values (the non-sink values "
                             "permuted), norms or directions (only their norms or only their "
                             "directions permuted), unselected (only the values outside the top-N "
                             "set permuted); docs/math.md, section 3")
    parser.add_argument("--seed", type=cli.seed, default=0,
                        help="seed of the random baseline and the shuffle")
    cli.add_sink_option(parser)
    parser.add_argument("--distance", choices=get_args(Distance), default="euclidean",
                        help="distance between contributions and their aggregate")
    parser.add_argument("--bounds", action="store_true",
                        help="add inversion certificates, regime bounds and envelopes "
                             "(docs/math.md, section 6)")
    parser.add_argument("--show-n", type=cli.int_list, default="2,4,8", metavar="N,N,...",
                        help="which N the printed table shows (those also in --n-values)")
    parser.add_argument("--stream", action="store_true",
                        help="analyse inside the forward pass: no cache, memory of one layer")
    parser.add_argument("--batch-size", type=cli.positive_int, default=8, metavar="B",
                        help="sequences per forward with --stream or torchrun")
    parser.add_argument("--attention", choices=ATTENTION_SOURCES, default="auto",
                        help="pattern: cache each layer's attention pattern; recompute: run SDPA "
                             "attention and recompute only the rows the analysis reads from the "
                             "captured queries and keys (long contexts; implies --stream); auto: "
                             "recompute when the patterns would not fit comfortably")
    parser.add_argument("--save", metavar="PATH", help="also save the HeadAnalysis (torch file)")
    parser.add_argument("--per-window", action="store_true",
                        help="keep each window's own means in the saved analysis (window_scores, "
                             "window_sink, window_bounds: what a bootstrap over windows resamples)")
    parser.add_argument("--csv", metavar="PATH", help="also write the long-form table as CSV")
    parser.add_argument("--labels", metavar="FILE",
                        help="also write the head labels (class, vote fractions, margin, stability; "
                             "docs/labels.md) as CSV or JSON, by the suffix")
    cli.add_progress_option(parser)
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


#: With ``--attention auto``, a cache of patterns above this size is not built: the analysis
#: streams and recomputes the rows it reads.
AUTO_CACHE_BYTES = 4 << 30


def _recompute(args: argparse.Namespace, model: Any, tokens: Any) -> bool:
    """Whether ``--attention`` sends the run down the recompute path (which streams)."""
    if args.attention != "auto":
        return bool(args.attention == "recompute")
    from ..analyze.recompute import pattern_bytes

    n_seqs, n_pos = tokens.shape
    return model.cfg.n_layers * pattern_bytes(n_seqs, model.cfg.n_heads, n_pos) > AUTO_CACHE_BYTES


def check(args: argparse.Namespace) -> str | None:
    """Every check that needs no model; returns the ``--text`` contents (``None``: built-in)."""
    cli.check_model_and_windows(args, min_seq_len=2)
    if isinstance(args.sink, int) and args.sink >= args.seq_len:
        raise cli.UsageError(f"--sink {args.sink} is past the end of a window of --seq-len "
                             f"{args.seq_len} tokens; use a position below {args.seq_len} or --sink auto.")
    cli.check_n_below(args, f"and a window's last query has only {args.seq_len} keys")
    cli.check_output_file(args.save, "--save")
    cli.check_output_file(args.csv, "--csv")
    cli.check_labels_file(args.labels)
    cli.check_distinct_paths(args, ("--save", "--csv", "--labels"))
    return cli.read_input_text(args)


def run(args: argparse.Namespace) -> int:
    """``tl-geometry analyze``; returns the exit status (bad arguments raise ``UsageError``)."""
    text = check(args)
    import torch

    from ..analyze.from_cache import analyze_heads
    from ..analyze.from_model import analyze_model
    from ..inputs.cache import CACHE_NAMES_FILTER
    from ..inputs.text import text_windows

    rank, world = _distributed()
    log = sys.stderr if rank == 0 else open(os.devnull, "w")  # noqa: SIM115
    progress = cli.show_progress(args) and rank == 0
    n_values = tuple(n for n in args.n_values if n < args.seq_len)  # larger N cannot be evaluated
    if len(n_values) < len(args.n_values):
        dropped = ",".join(str(n) for n in args.n_values if n >= args.seq_len)
        print(f"note: N = {dropped} dropped (not below --seq-len {args.seq_len})", file=log)
    start = time.perf_counter()
    model = cli.load_cli_model(args, log=log)
    tokens = text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)
    options = dict(n_values=n_values, queries=args.queries, random_samples=args.random_samples,
                   shuffle_samples=args.shuffle_samples, shuffle=args.shuffle, seed=args.seed,
                   distance=args.distance, bounds=args.bounds, per_window=args.per_window)
    loaded = time.perf_counter()
    if args.stream or world > 1 or _recompute(args, model, tokens):
        # Under torchrun every rank analyses its share of the windows; the sums are all-reduced.
        result = analyze_model(
            model, tokens, batch_size=args.batch_size, shard=(rank, world) if world > 1 else None,
            progress=progress, attention=args.attention, sink=args.sink, **options,
        )
        timing = f"streaming analysis on {world} process(es) {time.perf_counter() - loaded:.2f} s"
    else:
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter=CACHE_NAMES_FILTER)
        forward = time.perf_counter()
        result = analyze_heads(cache, model=model, progress=progress, sink=args.sink, **options)
        timing = (f"forward (pattern + v cached) {forward - loaded:.2f} s, "
                  f"analysis {time.perf_counter() - forward:.2f} s")
    result.metadata["text"] = args.text or "built-in sample"
    if rank != 0:
        return 0
    print(result.summary(n_values=args.show_n))
    print(f"\nload {loaded - start:.1f} s, {timing}", file=log)
    if args.save:
        print(f"saved {result.save(Path(args.save).expanduser())}", file=sys.stderr)
    if args.csv:
        Path(args.csv).expanduser().parent.mkdir(parents=True, exist_ok=True)
        result.to_pandas().to_csv(Path(args.csv).expanduser(), index=False)
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.labels:
        print(f"wrote {result.export_labels(Path(args.labels).expanduser())}", file=sys.stderr)
    return 0
