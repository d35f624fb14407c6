"""The ``tl-geometry`` command: one subcommand per module, registered in :data:`COMMANDS`.

Each subcommand module defines ``add_parser(subparsers, name) -> ArgumentParser`` and
``run(args) -> int``, which checks every argument before it loads a model (:mod:`.args`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType

from .. import progress
from . import ablation, analyze, cache, capacity, report, scores
from .args import Parser, show_progress

#: Subcommand → the module of :mod:`tl_geometry.cli` that defines its ``add_parser`` and ``run``.
#: Adding a subcommand is one line here. The modules must import only light things at the top
#: (no transformers, no matplotlib): building the parser imports all of them.
COMMANDS: dict[str, ModuleType] = {
    "analyze": analyze,
    "report": report,
    "ablate": ablation,
    "prune": ablation,
    "capacity": capacity,
    "scores": scores,
    "cache": cache,
}

DESCRIPTION = """\
Geometric analysis of token selection in attention heads, on top of TransformerLens: which keys
does each head really select (precision / recall / F of the top-N attended contributions against
random subsets), its attention sink, its Retriever / Mixer / Reset class, and what removing heads
does to the loss. Models load offline: the built-in smollm2-135m and gemma3-270m, or your own
Hugging Face folder or GGUF file (--model PATH). The mathematics: docs/math.md.

examples:
  tl-geometry analyze                                # summary table, SmolLM2-135M, built-in text
  tl-geometry report --out tl_geometry_report        # offline HTML report with figures
  tl-geometry analyze --model ./my-model --text corpus.txt
  tl-geometry ablate --heads 3.4,5.0
  tl-geometry prune --out prune-results
  tl-geometry scores --sort induction --top 10      # head scores others use, Sink^ε

Run "tl-geometry COMMAND --help" for a command's options and examples.
"""


def build_parser() -> Parser:
    """The ``tl-geometry`` parser with every subcommand of :data:`COMMANDS`."""
    parser = Parser(prog="tl-geometry", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        COMMANDS[command].add_parser(sub, command)
    return parser


@contextmanager
def _bars(show: bool) -> Iterator[None]:
    """Without a visible progress bar, also silence the bars of libraries we call (transformers
    draws one while it de-quantises a GGUF file); restored on exit."""
    previous = os.environ.get("TQDM_DISABLE")
    if not show:
        os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = previous


class _Args(argparse.Namespace):
    """The parsed arguments. argparse gives an option its default only where the namespace has
    no attribute of its name, and nnsight, once imported, gives every object a ``save`` method:
    without this class attribute, ``args.save`` would be that method, not ``--save``'s default."""

    save = None


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tl-geometry``; returns 0, or raises ``SystemExit(2)`` after one line for bad input."""
    args = build_parser().parse_args(argv, _Args())  # a syntax error: one line and SystemExit(2)
    try:
        with _bars(show_progress(args) and progress.auto_progress()):
            return int(COMMANDS[args.command].run(args))
    except (ValueError, ImportError) as err:
        # UsageError (a ValueError) before the load; after it, the library's own errors (a text
        # that tokenizes too short, a head out of range, an architecture TransformerLens cannot
        # wrap, a missing weights package with its pip line) already name the problem and the fix.
        problem = str(err)
    except KeyboardInterrupt:
        print(f"tl-geometry {args.command}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    print(f"tl-geometry {args.command}: error: {' '.join(problem.split())}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    raise SystemExit(main())
