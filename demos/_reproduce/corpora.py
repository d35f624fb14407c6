"""The study's two corpora, both readable offline on any machine.

* ``wikitext-2``: WikiText-2's raw test split (the same articles as WikiText-103's test split),
  read from ``../shared/data/wikitext-2-test.txt`` relative to the repository root or a given path.
* ``python-stdlib`` (ours): source code, another domain than encyclopedic prose. It is derived
  from the running interpreter's standard library: a fixed, sorted list of pure-Python modules,
  each cut to its first :data:`CHARS_PER_MODULE` characters (at a line end) so that the windows
  sample many modules, not only the first one. The text depends only on the Python version,
  which the results page records.
"""

from __future__ import annotations

import importlib.util
import platform
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WIKITEXT_PATH = ROOT / ".." / "shared" / "data" / "wikitext-2-test.txt"

#: Pure-Python standard-library modules present in CPython 3.10–3.13, sorted.
STDLIB_MODULES = (
    "argparse", "ast", "calendar", "collections", "configparser", "csv", "dataclasses",
    "difflib", "enum", "fractions", "functools", "heapq", "inspect", "ipaddress", "json.decoder",
    "json.encoder", "logging", "pathlib", "pprint", "random", "shutil", "statistics", "string",
    "textwrap", "threading", "tokenize", "typing", "uuid", "zipfile",
)
#: Characters taken from the start of each module (ours): ~29 × 16k characters ≈ 120k tokens,
#: enough for 64 windows of 1024 tokens with either tokenizer.
CHARS_PER_MODULE = 16_000


@dataclass(frozen=True)
class Corpus:
    """A named text and a sentence on where it comes from."""

    name: str
    text: str
    source: str


def wikitext(path: str | Path | None = None) -> Corpus:
    """WikiText-2 test (raw), from ``path`` or ``../shared/data/wikitext-2-test.txt``."""
    path = Path(path) if path is not None else WIKITEXT_PATH
    if not path.is_file():
        raise FileNotFoundError(
            f"WikiText-2 test not found at {path}. Pass its path with --wikitext PATH "
            "(the raw test split, e.g. wiki.test.raw renamed)."
        )
    return Corpus(
        "wikitext-2",
        path.read_text(encoding="utf-8"),
        f"WikiText-2 raw test split ({path.name}; the articles of WikiText-103's test split), "
        "windows taken consecutively from its start",
    )


def python_stdlib() -> Corpus:
    """Python source of :data:`STDLIB_MODULES` from this interpreter, each cut at a line end."""
    parts = []
    for name in STDLIB_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            raise RuntimeError(f"Standard-library module {name} has no Python source here.")
        source = Path(spec.origin).read_text(encoding="utf-8")
        cut = source.rfind("\n", 0, CHARS_PER_MODULE) + 1 if len(source) > CHARS_PER_MODULE else len(source)
        parts.append(f"# ---- {name} ----\n{source[:cut]}")
    return Corpus(
        "python-stdlib",
        "\n".join(parts),
        f"Python {platform.python_version()} standard-library source: the first "
        f"{CHARS_PER_MODULE:,} characters of each of {len(STDLIB_MODULES)} modules "
        f"({', '.join(STDLIB_MODULES)}), in that order",
    )


def sample() -> Corpus:
    """The package's built-in prose (used only when WikiText-2 is absent in quick mode)."""
    import tl_geometry

    return Corpus("sample-text", tl_geometry.sample_text(),
                  "tl_geometry's built-in sample text (WikiText-2 was not available)")
