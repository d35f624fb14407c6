"""A griffe extension for the API reference: the ``#:`` comment block right above an attribute
becomes its docstring.

The package documents its constants with ``#:`` comments (the Sphinx convention); griffe reads
only string literals, so without this the reference would show a constant's value and nothing
of what it means. An attribute that has a docstring keeps it. Loaded by mkdocs.yml's
mkdocstrings options, and by tests/docs/test_api_reference.py so that the test sees the same page.
"""

from __future__ import annotations

from typing import Any

import griffe


class CommentDocstrings(griffe.Extension):
    """Attach the ``#:`` comment lines right above an attribute's first line as its docstring."""

    def on_attribute(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is not None or attr.lineno is None or attr.filepath is None:
            return
        try:
            lines = attr.lines_collection[attr.filepath]
        except KeyError:
            return
        comment: list[str] = []
        row = attr.lineno - 2  # the line above, 0-based
        while row >= 0 and lines[row].strip().startswith("#:"):
            comment.insert(0, lines[row].strip()[2:].removeprefix(" "))
            row -= 1
        if not comment:
            return
        parent = attr.parent.docstring if attr.parent is not None else None
        attr.docstring = griffe.Docstring("\n".join(comment), lineno=row + 2, endlineno=attr.lineno - 1,
                                          parent=attr, parser=parent.parser if parent else None,
                                          parser_options=parent.parser_options if parent else None)
