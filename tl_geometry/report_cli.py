"""The ``tl-geometry report`` command: load, cache, analyse, then :func:`~tl_geometry.report.write_report`.

Kept apart from :mod:`tl_geometry.report` so that building the command-line parser does not import
matplotlib and the views.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_OUT", "add_parser", "run"]

DEFAULT_OUT = "tl_geometry_report"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``report`` to the ``tl-geometry`` subcommands."""
    from .models import DEFAULT_MODEL, MODELS

    report = sub.add_parser("report", help="write the offline HTML report (tables, figures, views)")
    report.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    report.add_argument("--text", metavar="FILE", help="plain-text file (default: built-in sample)")
    report.add_argument("--n-seqs", type=int, default=8, help="windows of text (default 8)")
    report.add_argument("--seq-len", type=int, default=128, help="tokens per window, BOS included")
    report.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    report.add_argument("--no-bounds", action="store_true", help="skip the bounds (SPEC §6)")
    return report


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """``tl-geometry report``: load, cache, analyse, write the report, with a progress bar."""
    import torch
    from tqdm.auto import tqdm

    import tl_geometry
    from tl_geometry.data import read_text
    from tl_geometry.report import write_report

    # Check what can be checked before spending half a minute loading the model.
    problem = ("--n-seqs must be ≥ 1 and --seq-len ≥ 3" if args.n_seqs < 1 or args.seq_len < 3
               else f"--text {args.text}: no such file" if args.text and not Path(args.text).is_file()
               else None)
    if problem and parser is not None:
        parser.error(problem)  # exits with the usage line
    if problem:
        raise ValueError(problem)
    start = time.perf_counter()
    stages = ["load model", "tokenize", "forward", "analyze", "write report"]
    bar = tqdm(stages, desc="tl-geometry report", unit="stage", file=sys.stderr,
               bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {postfix} [{elapsed}]")
    bar.set_postfix_str(stages[0])
    model = tl_geometry.load_model(args.model)
    bar.update()
    bar.set_postfix_str(stages[1])
    text = read_text(args.text) if args.text else None
    tokens = tl_geometry.text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)
    bar.update()
    bar.set_postfix_str(stages[2])
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    bar.update()
    bar.set_postfix_str(stages[3])
    n_values = tuple(n for n in (1, 2, 4, 8, 16, 32, 64) if n < args.seq_len)
    result = tl_geometry.analyze_heads(cache, model=model, n_values=n_values, bounds=not args.no_bounds)
    result.metadata["text"] = args.text or "built-in sample"
    bar.update()
    bar.set_postfix_str(stages[4])
    index = write_report(result, args.out, cache=cache, tokens=tokens, model=model)
    bar.update()
    bar.set_postfix_str("done")
    bar.close()
    size = sum(p.stat().st_size for p in index.parent.rglob("*") if p.is_file())
    print(f"wrote {index} ({index.stat().st_size / 1e6:.1f} MB; folder {size / 1e6:.1f} MB) "
          f"in {time.perf_counter() - start:.0f} s — open it in a browser, no network needed.")
    return 0
