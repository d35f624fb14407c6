"""``tl-geometry scores``: the head scores other tools use (SPEC §9; :func:`tl_geometry.head_scores`),
per layer and head."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..analyze.head_scores import DEFAULT_SEQ_LEN, MIN_REPEAT, MIN_SEQ_LEN, RETRIEVAL_EXTRA
from ..functional.head_scores import REPEAT_LENGTH, SINK_EPSILON_LENGTH
from . import args as cli

DESCRIPTION = """\
Head scores from attention patterns alone (docs/labels.md): previous_token, duplicate_token and
induction (TransformerLens head_detector's patterns, as a mean weight on the expected key) on
R random tokens repeated (--repeat, 32); sink_rate, the mean weight on key 0, on windows of real
text of --seq-len tokens (128, as tl-geometry analyze: give the analysis's length so that scores
and labels come from the same context), and the model's Sink^ε (share of heads with sink_rate
> 0.3 on 64-token windows of the same text, whatever --seq-len); retrieval on a random needle
repeated at the end of a text window. Every sequence starts with BOS only where the model was
trained with one (SmolLM2, Gemma-3; not Qwen2.5-Coder). Compare them with the Retriever / Mixer /
Reset labels: a Retriever is not a retrieval or induction head.

examples:
  tl-geometry scores
  tl-geometry scores --model gemma3-270m --seq-len 256 --csv scores.csv
  tl-geometry scores --text corpus.txt --sort induction --top 10
"""

#: Columns ``--sort`` accepts (the scores of SPEC §9).
SORTABLE = ("previous_token", "duplicate_token", "induction", "sink_rate", "retrieval")


def repeat_length(text: str) -> int:
    """``--repeat``: a whole number ≥ 2 (with R = 1 the induction key is the query itself)."""
    value = cli.positive_int(text)
    if value < MIN_REPEAT:
        raise argparse.ArgumentTypeError(f"must be ≥ {MIN_REPEAT} (with R = 1 the induction key is the "
                                         f"query itself), got {value}")
    return value


def add_parser(sub: Any, name: str) -> argparse.ArgumentParser:
    """Add ``scores`` to the ``tl-geometry`` subcommands."""
    from ..inputs.models import DEFAULT_MODEL, MODELS

    parser = sub.add_parser(name, help="head scores others use (induction, previous token, sink rate, ...)",
                            description=DESCRIPTION)
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, metavar="NAME|PATH",
        help=f"a built-in model ({', '.join(sorted(MODELS))}), a local Hugging Face folder or a .gguf file")
    cli.add_bos_option(parser)
    parser.add_argument("--text", metavar="FILE",
                        help="UTF-8 plain-text file to cut into windows (default: the built-in sample)")
    parser.add_argument("--n-seqs", type=cli.positive_int, default=8, metavar="K",
                        help="text windows (the repeated random sequences are 8)")
    parser.add_argument("--seq-len", type=cli.positive_int, default=DEFAULT_SEQ_LEN, metavar="T",
                        help="tokens per text window, BOS included, for sink_rate and retrieval "
                             "(Sink^ε reads 64-token windows whatever T)")
    parser.add_argument("--repeat", type=repeat_length, default=REPEAT_LENGTH, metavar="R",
                        help="random tokens repeated twice for previous_token, duplicate_token and "
                             "induction, ≥ 2; at most w - 1 on sliding-window layers (Gemma-3: 511)")
    parser.add_argument("--seed", type=cli.seed, default=0,
                        help="seed of the random tokens, a whole number in [0, 2**63 - 1]")
    cli.add_sink_option(parser)
    parser.add_argument("--sort", choices=SORTABLE, default=None,
                        help="print the heads by this score, largest first (default: layer order)")
    parser.add_argument("--top", type=cli.positive_int, default=None, metavar="K",
                        help="print only the first K heads")
    parser.add_argument("--csv", metavar="PATH", help="also write the table as CSV")
    cli.add_progress_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """``tl-geometry scores``; returns the exit status (bad arguments raise ``UsageError``)."""
    cli.check_model_and_windows(args, min_seq_len=MIN_SEQ_LEN)
    _check_context(args)
    cli.check_output_file(args.csv, "--csv")
    cli.check_distinct_paths(args, ("--csv",))
    if args.top is not None and args.sort is None:
        raise cli.UsageError("--top needs --sort (which score ranks the heads), e.g. --sort induction "
                             "--top 10.")
    text = cli.read_input_text(args)
    from ..analyze.head_scores import head_scores
    from ..inputs.text import text_windows

    model = cli.load_cli_model(args, log=sys.stderr)
    windows = text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)
    # Sink^ε reads --n-seqs windows of 64 tokens of the same text, the same ones whatever --seq-len.
    sink_windows = None
    if args.seq_len != SINK_EPSILON_LENGTH:
        sink_windows = text_windows(model, text, n_seqs=args.n_seqs, seq_len=SINK_EPSILON_LENGTH)
    _check_window(args, model)
    table = head_scores(model, windows=windows, sink_windows=sink_windows, repeat=args.repeat,
                        seed=args.seed, sink=args.sink)
    shown = table if args.sort is None else table.sort_values(args.sort, ascending=False, kind="stable")
    if args.top is not None:
        shown = shown.head(args.top)
    print(shown.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    eps, attrs = table.attrs["sink_epsilon"], table.attrs
    print(f"\nsink_rate: key 0, over the queries t ≥ 1 that see it (sink_queries per window) of "
          f"{attrs['n_windows']} windows of {attrs['seq_len']} tokens; R = {attrs['repeat']}")
    print(f"Sink^ε (share of heads with sink_rate > {attrs['epsilon']} on "
          f"{attrs['sink_epsilon_seq_len']}-token windows): {100 * eps:.1f} %")
    if "sink_rate_selected" in table.columns:
        chosen = sorted(set(attrs["sink"]["positions"]))
        print(f"sink_rate_selected: the weight on each window's chosen sink ({attrs['sink']['rule']}: "
              f"positions {chosen[:8]}{' …' if len(chosen) > 8 else ''}), selected, so biased upward")
    if args.csv:
        path = Path(args.csv).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(path, index=False)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _check_context(args: argparse.Namespace) -> None:
    """Where the context length is known before the load: the repeated sequences (BOS + 2R) and
    the retrieval sequences (the window, the needle and its repeat) fit in it."""
    from ..inputs.models import context_length

    n_ctx = context_length(args.model)
    if n_ctx is None:
        return
    if 1 + 2 * args.repeat > n_ctx:
        raise cli.UsageError(f"--repeat {args.repeat} makes sequences of up to {1 + 2 * args.repeat} "
                             f"tokens (BOS + 2R), beyond {args.model}'s context length of {n_ctx}; use "
                             f"--repeat {(n_ctx - 1) // 2} or less.")
    if args.seq_len + RETRIEVAL_EXTRA > n_ctx:
        raise cli.UsageError(f"--seq-len {args.seq_len} makes retrieval sequences of {args.seq_len} "
                             f"+ {RETRIEVAL_EXTRA} tokens (the needle and its repeat), beyond "
                             f"{args.model}'s context length of {n_ctx}; use --seq-len "
                             f"{n_ctx - RETRIEVAL_EXTRA} or less.")


def _check_window(args: argparse.Namespace, model: Any) -> None:
    """``R ≤ w − 1`` on sliding-window layers (Gemma-3: 511): the windows are known only once the
    model is loaded, from its config."""
    from ..inputs.facts import model_facts

    local = [w for w in model_facts(model).windows or () if w]
    if local and args.repeat > min(local) - 1:
        w = min(local)
        raise cli.UsageError(f"--repeat {args.repeat}: {args.model}'s sliding-window layers see the "
                             f"last {w} keys, and a query of the second copy sees its token's earlier "
                             f"occurrence only for R ≤ w − 1 = {w - 1}; use --repeat {w - 1} or less.")
