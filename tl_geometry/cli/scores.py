"""``tl-geometry scores``: the head scores other tools use (SPEC §9), per layer and head.

Previous-token, duplicate-token and induction scores on repeated random tokens, the sink rate
(and the model's Sink^ε) on real-text windows, and a retrieval score; see
:func:`tl_geometry.head_scores`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .args import (
    UsageError,
    add_progress_option,
    check_distinct_paths,
    check_model,
    check_output_file,
    positive_int,
    read_input_text,
    seed,
)

DESCRIPTION = """\
Head scores from attention patterns alone (docs/labels.md): previous_token, duplicate_token and
induction (TransformerLens head_detector's patterns, as a mean weight on the expected key) on
32 random tokens repeated; sink_rate on 64-token windows of real text, with the model's
Sink^ε (share of heads with sink_rate > 0.3); retrieval on a random needle repeated at the end
of a text window. Every sequence starts with BOS only where the model was trained with one
(SmolLM2, Gemma-3; not Qwen2.5-Coder). Compare them with the Retriever / Mixer / Reset labels: a Retriever is not
a retrieval or induction head.

examples:
  tl-geometry scores
  tl-geometry scores --model gemma3-270m --csv scores.csv
  tl-geometry scores --text corpus.txt --sort induction --top 10
"""

#: Columns ``--sort`` accepts (the scores of SPEC §9).
SORTABLE = ("previous_token", "duplicate_token", "induction", "sink_rate", "retrieval")


def add_parser(sub: Any, name: str) -> argparse.ArgumentParser:
    """Add ``scores`` to the ``tl-geometry`` subcommands."""
    from ..inputs.models import DEFAULT_MODEL, MODELS

    parser = sub.add_parser(name, help="head scores others use (induction, previous token, sink rate, ...)",
                            description=DESCRIPTION)
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, metavar="NAME|PATH",
        help=f"a built-in model ({', '.join(sorted(MODELS))}), a local Hugging Face folder or a .gguf file")
    parser.add_argument("--text", metavar="FILE",
                        help="UTF-8 plain-text file for the 64-token windows (default: the built-in sample)")
    parser.add_argument("--n-seqs", type=positive_int, default=8, metavar="K",
                        help="text windows (the repeated random sequences are 8)")
    parser.add_argument("--seed", type=seed, default=0,
                        help="seed of the random tokens, a whole number in [0, 2**63 - 1]")
    parser.add_argument("--sort", choices=SORTABLE, default=None,
                        help="print the heads by this score, largest first (default: layer order)")
    parser.add_argument("--top", type=positive_int, default=None, metavar="K",
                        help="print only the first K heads")
    parser.add_argument("--csv", metavar="PATH", help="also write the table as CSV")
    add_progress_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """``tl-geometry scores``; returns the exit status (bad arguments raise ``UsageError``)."""
    check_model(args.model)
    check_output_file(args.csv, "--csv")
    check_distinct_paths(args, ("--csv",))
    if args.top is not None and args.sort is None:
        raise UsageError("--top needs --sort (which score ranks the heads), e.g. --sort induction --top 10.")
    # The windows of SPEC §9; read_input_text checks that the text (a --text file or the built-in
    # sample) has enough bytes for --n-seqs of them, before the load.
    args.seq_len = 64
    text = read_input_text(args)
    from ..analyze.head_scores import head_scores
    from ..inputs.models import load_model
    from ..inputs.text import text_windows

    print(f"Loading {args.model} (offline)...", file=sys.stderr)
    model = load_model(args.model)
    windows = text_windows(model, text, n_seqs=args.n_seqs, seq_len=64)
    table = head_scores(model, windows=windows, seed=args.seed)
    shown = table if args.sort is None else table.sort_values(args.sort, ascending=False, kind="stable")
    if args.top is not None:
        shown = shown.head(args.top)
    print(shown.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    eps = table.attrs["sink_epsilon"]
    print(f"\nSink^ε (share of heads with sink_rate > {table.attrs['epsilon']}): {100 * eps:.1f} %")
    if args.csv:
        path = Path(args.csv).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(path, index=False)
        print(f"wrote {path}", file=sys.stderr)
    return 0
