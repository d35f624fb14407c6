"""``tl-geometry cache``: where the user cache is and what it holds, and emptying or verifying it.

No model is loaded: ``info`` and ``clear`` only list and unlink files, ``verify`` re-hashes them
(:mod:`tl_geometry.inputs.weight_cache`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..inputs.weight_cache import Usage

DESCRIPTION = """\
The user cache holds the GGUF files assembled from split packages, the weight cache (a GGUF
model's de-quantised weights, so later loads skip the de-quantisation) and remembered file
digests. It is $TL_GEOMETRY_CACHE when set, else $XDG_CACHE_HOME/tl_geometry, else
~/.cache/tl_geometry. Everything in it is rebuilt when a load needs it. Delete its files (this
command, or rm), never edit, truncate or copy over them in place: a process that is reading or
mapping one at that moment can die (SIGBUS) or read other weights. The folder may be shared:
"clear" removes only what the cache wrote itself (entries that carry its marker or manifest,
its digests, assembled files and temporaries), never follows a symbolic link, and lists what
else it found in the cache's folders and left alone.

examples:
  tl-geometry cache info       # where the cache is, how that was chosen, entries and size
  tl-geometry cache verify     # re-hash every file; one line per bad one, exit 1 if any
  tl-geometry cache clear      # remove what the cache holds, and say how much was freed
"""

ACTIONS = {
    "info": "print where the cache is, how that was chosen, its entries and size",
    "clear": "remove what the cache wrote (only its own files; anything else is listed and left "
             "alone) and print what was freed",
    "verify": "re-hash every cached file against its recorded sha256; one line per stale or "
              "corrupt one, exit status 1 if there is any",
}


def add_parser(sub: Any, name: str) -> argparse.ArgumentParser:
    """Add ``cache`` (with its actions ``info``, ``clear``, ``verify``) to the subcommands."""
    parser = sub.add_parser(name, help="where the cache is and its size; clear or verify it",
                            description=DESCRIPTION)
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION",
                                    help="what to do: " + ", ".join(ACTIONS))
    for action, text in ACTIONS.items():
        actions.add_parser(action, help=text, description=f"{text[0].upper()}{text[1:]}.")
    return parser


def human(n_bytes: int) -> str:
    """``n_bytes`` in binary units: ``512 B``, ``1.5 KiB``, ``2.3 GiB``."""
    size = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{n_bytes} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _lines(found: Usage) -> list[str]:
    """One line per kind of thing a :class:`~tl_geometry.inputs.weight_cache.Usage` counts."""
    rows = (("weight-cache entries", found.entries), ("assembled GGUF files", found.assembled),
            ("remembered file digests", found.digests), ("temporary files", found.temporary))
    return [f"  {label + ':':<25}{tally.count:>5}  {human(tally.size):>10}" for label, tally in rows]


_SHOWN = 5  # foreign items named in full; the rest are counted


def _foreign(paths: list[Path]) -> str:
    """``N item(s) the cache did not write: PATH, PATH, ... (and K more)``; a symbolic link says so."""
    named = [f"{p} (a symbolic link, not followed)" if p.is_symlink() else str(p) for p in paths[:_SHOWN]]
    more = f" (and {len(paths) - _SHOWN} more)" if len(paths) > _SHOWN else ""
    return f"{len(paths)} item(s) the cache did not write: {', '.join(named)}{more}"


def _info() -> int:
    from ..inputs import weight_cache

    found = weight_cache.usage()
    state = "on" if weight_cache.enabled() else f"off (${weight_cache.ENV})"
    print(f"cache: {found.root}" + ("" if found.root.is_dir() else " (not created yet)"))
    print(f"  chosen: {found.origin}")
    print(f"  weight cache: {state}")
    print(*_lines(found), sep="\n")
    print(f"  {'total:':<25}{'':>5}  {human(found.total):>10}")
    if found.foreign:
        print(f"  not the cache's (left alone by clear): {_foreign(found.foreign)}")
    return 0


def _clear() -> int:
    from ..inputs import weight_cache

    done = weight_cache.clear()
    print(f"cleared {done.removed.root}: {human(done.removed.total)} freed")
    print(*_lines(done.removed), sep="\n")
    kept = done.kept.temporary
    if kept.count:
        print(f"left alone: {kept.count} temporary file(s) of loads that may still be running "
              f"({human(kept.size)}; removed by a clear once they are a day old)")
    if done.foreign:
        print(f"left alone: {_foreign(done.foreign)}")
    for error in done.errors:
        print(f"tl-geometry cache clear: could not remove {error}", file=sys.stderr)
    return 1 if done.errors else 0


def _verify() -> int:
    from ..inputs import weight_cache
    from ..inputs.model_files import cache_dir

    problems = weight_cache.verify()
    for problem in problems:
        print(problem)
    # A stale entry is whole (entries are named by their content): it only takes space, and a
    # file with the same bytes elsewhere still uses it, so it is reported but fails nothing.
    corrupt = [p for p in problems if p.kind == "corrupt"]
    if corrupt:
        print(f"tl-geometry cache verify: {len(corrupt)} corrupt; a load rebuilds a corrupt entry it "
              f"needs, and 'tl-geometry cache clear' removes every entry", file=sys.stderr)
        return 1
    stale = f" ({len(problems)} stale entr{'y' if len(problems) == 1 else 'ies'}: whole, only taking space)" \
        if problems else ""
    print(f"tl-geometry cache verify: {cache_dir()} checks out{stale}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    """``tl-geometry cache ACTION``; returns the exit status."""
    try:
        return {"info": _info, "clear": _clear, "verify": _verify}[args.action]()
    except OSError as err:  # an unreadable cache folder: one line, like every other error
        raise ValueError(f"the cache cannot be read: {err}") from err
