"""The ``tl-geometry report`` command: load, cache, analyse, then :func:`~tl_geometry.views.report.write_report`.

Kept apart from :mod:`tl_geometry.views.report` so that building the command-line parser does not import
matplotlib and the views.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..progress import progress_counter
from . import args as cli

__all__ = ["DEFAULT_OUT", "add_parser", "run"]

#: write_report's default too (a test checks it), repeated so that the parser needs no matplotlib.
DEFAULT_OUT = "tl_geometry_report"

DESCRIPTION = """\
Write the offline HTML report of a model on real text: one self-contained index.html (taxonomy
grid, sink heatmaps, F_N-against-N curves, example heads with their attention and contribution
patterns), heads.csv, metrics.csv, class_counts.csv, figures/ and analysis.pt. An existing folder
is reused; tl-geometry prune's tables there add an Ablation section. Definitions: docs/math.md.

examples:
  tl-geometry report
  tl-geometry report --model gemma3-270m --text corpus.txt --out gemma-report
  tl-geometry prune --out runs/smol && tl-geometry report --out runs/smol   # with ablation
"""


def add_parser(sub: Any, name: str = "report") -> argparse.ArgumentParser:
    """Add ``report`` to the ``tl-geometry`` subcommands."""
    report = sub.add_parser(name, help="write the offline HTML report (tables, figures, views)",
                            description=DESCRIPTION)
    cli.add_model_options(report, n_seqs=8, seq_len=128)
    report.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help="output folder (created if needed; must not be a file)")
    report.add_argument("--no-bounds", action="store_true",
                        help="skip the theoretical bounds (docs/math.md, section 6)")
    report.add_argument("--scores", action="store_true",
                        help="also compute the head scores others use (induction, previous token, "
                             "sink rate, ...; docs/labels.md) and compare them with the labels")
    cli.add_progress_option(report)
    return report


def run(args: argparse.Namespace) -> int:
    """``tl-geometry report``: load, cache, analyse, write the report, with a progress bar;
    every argument is checked first (``UsageError``)."""
    cli.check_model_and_windows(args, min_seq_len=3)
    cli.check_output_dir(args.out, "--out")
    text = cli.read_input_text(args)
    import torch
    from tqdm.auto import tqdm

    from ..analyze.from_cache import analyze_heads
    from ..inputs.cache import CACHE_NAMES_FILTER
    from ..inputs.text import text_windows
    from ..views.report import write_report

    start = time.perf_counter()
    stages = ["load model", "tokenize", "forward", "analyze", "write report"]
    # The postfix names the stage under way: set before each update, so that a plain line (where
    # standard error is a file) names the stage that starts.
    bar = (progress_counter(len(stages), "tl-geometry report", "stage", postfix=stages[0],
                            bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {postfix} [{elapsed}]")
           if cli.show_progress(args) else tqdm(total=len(stages), disable=True))

    def advance(stage: str) -> None:
        bar.set_postfix_str(stage)
        bar.update()

    model = cli.load_cli_model(args)
    advance(stages[1])
    tokens = text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)
    advance(stages[2])
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=CACHE_NAMES_FILTER)
    advance(stages[3])
    n_values = tuple(n for n in (1, 2, 4, 8, 16, 32, 64) if n < args.seq_len)
    result = analyze_heads(cache, model=model, n_values=n_values, bounds=not args.no_bounds,
                           progress=cli.show_progress(args))
    result.metadata["text"] = args.text or "built-in sample"
    advance(stages[4])
    scores = None
    if args.scores:
        from ..analyze.head_scores import head_scores

        # The report's own windows (SPEC §9: scores and labels from the same context); Sink^ε on
        # 64-token windows of the same text where the windows are shorter.
        sink_windows = None if args.seq_len >= 64 else text_windows(model, text, n_seqs=args.n_seqs, seq_len=64)
        scores = head_scores(model, windows=tokens, sink_windows=sink_windows)
    index = write_report(result, args.out, cache=cache, tokens=tokens, model=model, scores=scores)
    advance("done")
    bar.close()
    size = sum(p.stat().st_size for p in index.parent.rglob("*") if p.is_file())
    print(f"wrote {index} ({index.stat().st_size / 1e6:.1f} MB; folder {size / 1e6:.1f} MB) "
          f"in {time.perf_counter() - start:.0f} s — open it in a browser, no network needed.")
    return 0
