"""What every ``tl-geometry`` subcommand shares: the parser class, common options, and the checks
that run before a model is loaded (half a minute or more), so a typo costs nothing.

A bad argument ends the command with one line on standard error that names the problem and the
fix, and exit status 2: argparse's errors go through :meth:`Parser.error`, our checks raise
:class:`UsageError`, which :func:`tl_geometry.cli.main` prints.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import NoReturn, TextIO

__all__ = ["Parser", "UsageError", "add_bos_option", "add_model_options", "add_progress_option",
           "add_sink_option", "check_distinct_paths", "check_labels_file", "check_model",
           "check_model_and_windows", "check_n_below", "check_output_dir", "check_output_file", "int_list",
           "load_cli_model", "positive_int", "query_option", "read_input_text", "seed",
           "show_progress", "sink_option", "whole_number"]


class UsageError(ValueError):
    """A command-line argument that cannot work; the message names the problem and the fix."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, and keeps the examples in descriptions as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # Flags (True / False) and unset options (None) have no default worth printing.
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block) and exit with status 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        if hasattr(self, "_negative_number_matcher"):
            # Read "-2,2" and "-0.5" as values (to be refused with a reason), not as unknown flags:
            # argparse otherwise only knows plain negative numbers.
            self._negative_number_matcher = re.compile(r"^-\.?\d[\d.,\s-]*$")

    def error(self, message: str) -> NoReturn:
        if message.startswith("argument") and "expected one argument" in message:
            message += "; a value that starts with '-' is written --option=VALUE"
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


# --- argument types: argparse turns their ArgumentTypeError into Parser.error's one line -------
#: The largest int a tensor (int64) holds: larger values would overflow only after the model load.
MAX_INT = 2**63 - 1


def whole_number(text: str, expected: str) -> int:
    """``int(text)``; argparse's ``expected {expected}, got {text!r}`` where it is not one."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An int ≥ 1."""
    value = whole_number(text, "a whole number ≥ 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, got {value}")
    if value > MAX_INT:
        raise argparse.ArgumentTypeError(f"must be at most 2**63 - 1, got {value}")
    return value


def _bounded(text: str, expected: str, high: int, refusal: str, low: int = 0) -> int:
    """:func:`whole_number` in ``[low, high]``; outside, ``refusal`` with the value."""
    value = whole_number(text, expected)
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{refusal}, got {value}")
    return value


def seed(text: str) -> int:
    """A seed: a whole number in ``[0, 2**63)`` (a 64-bit generator's range)."""
    return _bounded(text, "a whole number ≥ 0", MAX_INT,
                    "must be in [0, 2**63 - 1] (a 64-bit generator seed)")


def sink_option(text: str) -> str | int:
    """``--sink``: ``auto`` or a position ≥ 0 counted from the window's first token (SPEC §1)."""
    if text == "auto":
        return text
    return _bounded(text, "'auto' or a position ≥ 0", MAX_INT, "a position must be ≥ 0")


def query_option(text: str) -> str | int:
    """``--queries``: ``last``, ``all`` or a sample size ``K ≥ 1``."""
    if text in ("last", "all"):
        return text
    return _bounded(text, "last, all or a number of positions ≥ 1", 1 << 20,
                    "a number of positions must be in [1, 2**20]", low=1)


def add_sink_option(parser: argparse.ArgumentParser) -> None:
    """``--sink`` (SPEC §1): which key of each window is the sink."""
    parser.add_argument("--sink", type=sink_option, default=None, metavar="auto|P",
                        help="the sink: P (the P-th token of every window, 0 = the first) or auto (each "
                             "window's most attended of its first 32 tokens); default: 0 where the "
                             "windows start with BOS, auto where the model was trained without it")


def int_list(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` → ``(1, 2, 4)``: distinct positive ints, separated by commas."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"expected positive whole numbers separated by commas, "
                                         f"e.g. 1,2,4,8; got {text!r}")
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every N must be ≥ 1 (a selection holds at least one "
                                         f"key); got {text!r}")
    if any(v > MAX_INT for v in values):  # refused here, not as an int64 overflow after the load
        raise argparse.ArgumentTypeError(f"every N must be at most 2**63 - 1 (and an N at least "
                                         f"the window length keeps every key); got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"lists an N twice; give each once, e.g. "
                                         f"{','.join(map(str, sorted(set(values))))}")
    return values


# --- options shared by the subcommands -----------------------------------------------------------
def add_model_options(parser: argparse.ArgumentParser, *, n_seqs: int, seq_len: int) -> None:
    """``--model``, ``--text``, ``--n-seqs``, ``--seq-len``."""
    from ..inputs.models import DEFAULT_MODEL, MODELS

    parser.add_argument(
        "--model", default=DEFAULT_MODEL, metavar="NAME|PATH",
        help=f"a built-in model ({', '.join(sorted(MODELS))}), a local Hugging Face folder "
             "(save_pretrained: config, weights, tokenizer) or a .gguf file; read offline")
    parser.add_argument("--text", metavar="FILE",
                        help="UTF-8 plain-text file to cut into windows (default: the built-in sample)")
    parser.add_argument("--n-seqs", type=positive_int, default=n_seqs, metavar="K",
                        help="windows of text, one sequence each")
    parser.add_argument("--seq-len", type=positive_int, default=seq_len, metavar="T",
                        help="tokens per window, BOS included")
    add_bos_option(parser)


def add_bos_option(parser: argparse.ArgumentParser) -> None:
    """``--bos yes|no``: ``load_model``'s ``bos=``."""
    parser.add_argument("--bos", choices=("yes", "no"), default=None,
                        help="whether --model was trained with BOS at the start of a sequence; needed "
                             "for your own model where its files do not say (save_pretrained leaves "
                             "add_bos_token out), and given, it wins over the files")


def add_progress_option(parser: argparse.ArgumentParser) -> None:
    """``--no-progress``."""
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress (by default a bar on a terminal, and a plain line on standard "
                             "error every 10%% of the work or 30 s where it is a file or a pipe)")


def show_progress(args: argparse.Namespace) -> bool:
    """Progress on unless ``--no-progress`` (:mod:`tl_geometry.progress`)."""
    return bool(getattr(args, "progress", True))


# --- checks before the model load ----------------------------------------------------------------
def check_model(name: str, seq_len: int | None = None) -> None:
    """A built-in name whose package is installed, or a whole local folder / GGUF file; and a
    ``--seq-len`` within its context length where that can be read without loading it."""
    from ..inputs.models import ModelNotInstalledError, context_length, model_source

    try:
        model_source(name)
    except (ValueError, ModelNotInstalledError) as err:
        raise UsageError(f"--model: {err}") from None
    if seq_len is not None:
        _check_context(name, seq_len, context_length(name))


def _check_context(name: str, seq_len: int, n_ctx: int | None) -> None:
    if n_ctx is not None and seq_len > n_ctx:
        raise UsageError(f"--seq-len {seq_len} is longer than {name}'s context length of {n_ctx} "
                         f"tokens; use --seq-len {n_ctx} or less.")


def load_cli_model(args: argparse.Namespace, log: TextIO | None = None):
    """``load_model(args.model)``, announced on ``log`` where given, its file errors as
    :class:`UsageError`; then ``--seq-len`` against the loaded model's context length."""
    from ..inputs import models

    if log is not None:
        print(f"Loading {args.model} (offline)...", file=log)
    try:
        model = models.load_model(args.model, bos=_bos_option(args))  # None: the model's files say
    except models.ModelLoadError as err:
        raise UsageError(f"--model: {err}") from None
    n_ctx = getattr(getattr(model, "cfg", None), "n_ctx", None)
    if isinstance(n_ctx, int) and getattr(args, "seq_len", None) is not None:
        _check_context(args.model, args.seq_len, n_ctx)
    return model


def check_model_and_windows(args: argparse.Namespace, min_seq_len: int) -> None:
    """:func:`check_model`, then a ``--seq-len`` of at least ``min_seq_len``."""
    check_model(args.model, args.seq_len)
    if args.seq_len < min_seq_len:
        raise UsageError(f"--seq-len {args.seq_len} is too short: a window needs BOS and at least "
                         f"{min_seq_len - 1} text token(s); use --seq-len {min_seq_len} or more.")


def check_n_below(args: argparse.Namespace, consequence: str) -> None:
    """Some ``--n-values`` N below ``--seq-len``, else a :class:`UsageError` with ``consequence``."""
    if not [n for n in args.n_values if n < args.seq_len]:
        raise UsageError(f"--n-values {','.join(map(str, args.n_values))}: every N is ≥ --seq-len "
                         f"{args.seq_len}, {consequence}; give an N < --seq-len or longer windows.")


def _bos_option(args: argparse.Namespace) -> bool | None:
    """``--bos yes|no`` as ``load_model``'s ``bos=``; ``None`` where not given."""
    given = getattr(args, "bos", None)
    return None if given is None else given == "yes"


def read_input_text(args: argparse.Namespace) -> str | None:
    """The ``--text`` file's contents (``None``: the built-in sample), refused when it cannot work.

    A token spans at least one byte of UTF-8, so a text (a file or the built-in sample) of fewer
    bytes than the windows need tokens (``--seq-len`` − 1 each after BOS, ``--seq-len`` without
    BOS) is too short whatever the tokenizer; a longer one that tokenizes short is caught after
    the load.
    """
    from ..inputs.models import stated_bos
    from ..inputs.text import read_text, sample_text

    # Whether --model's windows start with BOS: --bos, else its table entry or files; True (the
    # smaller need) where they do not say, since the load then refuses it, naming the fix.
    bos, model = _bos_option(args), getattr(args, "model", None)
    with_bos = bos if bos is not None else model is None or stated_bos(model) is not False
    body = args.seq_len - 1 if with_bos else args.seq_len
    layout = f"BOS + {body}" if with_bos else f"{body} text tokens, no BOS"
    need = args.n_seqs * body
    if args.text is None:
        size = len(sample_text().encode("utf-8"))
        if size + 1 < need:
            raise UsageError(
                f"--n-seqs {args.n_seqs}: the built-in sample text has {size:,} bytes and cannot make "
                f"the {need:,} tokens of {args.n_seqs} windows of {args.seq_len} ({layout}); use "
                "fewer --n-seqs or a shorter --seq-len, or pass a longer --text FILE.")
        return None
    if not str(args.text).strip():
        raise UsageError("--text is empty; give the path of a UTF-8 plain-text file, or leave "
                         "--text out for the built-in sample.")
    try:
        text = read_text(args.text)
    except ValueError as err:
        raise UsageError(f"--text: {err}") from None
    if len(text.encode("utf-8")) + 1 < need:
        raise UsageError(
            f"--text {args.text} is too short: {len(text.encode('utf-8'))} bytes cannot make the "
            f"{need} tokens of {args.n_seqs} windows of {args.seq_len} ({layout}); "
            "use fewer --n-seqs or a shorter --seq-len, or a longer text.")
    return text


def _writable_folder(folder: Path, flag: str, target: Path) -> None:
    """The nearest existing ancestor of ``folder`` must be a folder we can create files in."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {target}: {existing} is a file, not a folder; choose another path.")
    try:  # a real probe: os.access says yes to root even on a read-only file system
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise UsageError(f"{flag} {target}: cannot write in {existing} ({err.strerror}); "
                         "choose a folder you can write to.") from None


def _check_not_empty(path: str, flag: str, example: str) -> None:
    """An empty path (``--csv ''``) would name the current folder; say so, with an example."""
    if not str(path).strip():
        raise UsageError(f"{flag} is empty: give a path, e.g. {flag} {example}.")


def check_output_file(path: str | None, flag: str) -> None:
    """An output file (``--save``, ``--csv``): not empty, not a folder, its folder writable."""
    if path is None:
        return
    _check_not_empty(path, flag, "result.csv" if flag == "--csv" else "result.pt")
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file name, e.g. {target / 'result'}.")
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{flag} {path} exists and is read-only; choose another file name.")
    _writable_folder(target.parent, flag, target)


def check_labels_file(path: str | None, flag: str = "--labels") -> None:
    """A label file (``--labels``): a writable ``.csv`` or ``.json`` file (the suffix picks the format)."""
    if path is None:
        return
    _check_not_empty(path, flag, "labels.csv")
    if Path(path).suffix.lower() not in (".csv", ".json"):
        try:
            example = str(Path(path).with_suffix(".csv"))
        except ValueError:  # a path without a file name ("/", ".."): nothing to put a suffix on
            example = "labels.csv"
        raise UsageError(f"{flag} {path}: the file name must end in .csv or .json (the suffix picks "
                         f"the format), e.g. {example}.")
    check_output_file(path, flag)


def check_distinct_paths(args: argparse.Namespace, outputs: tuple[str, ...],
                         inputs: tuple[str, ...] = ("--text",)) -> None:
    """The output files of one command (``outputs``: ``--save``, ``--csv``, ...) name different
    files, none of them an input (``--text``), compared as resolved paths."""
    seen: dict[Path, tuple[str, str]] = {}
    for flag in (*inputs, *outputs):
        value = getattr(args, flag.removeprefix("--").replace("-", "_"), None)
        if value is None or not str(value).strip():
            continue
        path = Path(os.path.realpath(Path(value).expanduser()))
        if path in seen:
            other, given = seen[path]
            if other in inputs:
                raise UsageError(f"{flag} {value} is the {other} file the command reads; writing it "
                                 "would overwrite the input. Choose another file name.")
            same = "" if given == value else f" ({given} and {value})"
            raise UsageError(f"{other} and {flag} name the same file{same}: one would overwrite the "
                             f"other. Give each output its own file name, e.g. {flag} "
                             f"{_other_name(value, flag)}.")
        seen[path] = (flag, value)


def _other_name(value: str, flag: str) -> str:
    path = Path(value)
    suffix = {"--save": ".pt", "--csv": ".csv"}.get(flag, path.suffix)
    try:
        return str(path.with_name(f"{path.stem}-{flag.removeprefix('--')}{suffix}"))
    except ValueError:
        return f"{flag.removeprefix('--')}{suffix}"


def check_output_dir(path: str, flag: str) -> None:
    """An output folder (``--out``): an existing folder or a new one, never an existing file."""
    _check_not_empty(path, flag, "results")
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise UsageError(f"{flag} {path} is an existing file; the command writes a folder there. "
                         "Choose a new or existing folder name.")
    _writable_folder(target, flag, target)
