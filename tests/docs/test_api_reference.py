"""docs/api.md documents every public name: ``tl_geometry.__all__`` and the ``__all__`` of each
public subpackage that defines one.

A name counts as documented only where mkdocstrings renders it on the page: an explicit
``::: path.to.name`` block, or a member of a ``::: module`` block, chosen the way the Python
handler chooses them (the page's ``members:`` list when it has one; otherwise the handler's
filters, members with a docstring, imported members only when the module exports them, no
submodule unless ``show_submodules``). The module tree is read by griffe, as the handler reads
it, so that a re-exported function shadowed by its own submodule of the same name
(``functional.separability``) counts as missing, as it is missing from the built page.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from typing import Any

import pytest
from repo_paths import REPO

import tl_geometry

ROOT = REPO
API = ROOT / "docs" / "api.md"
BLOCK = re.compile(r"^::: *(?P<path>[\w.]+)[ \t]*\n(?P<yaml>(?:[ \t]+\S.*\n?)*)", re.MULTILINE)


def public_names() -> list[tuple[str, str, Any]]:
    """``(package, name, object)`` for every name in the ``__all__`` of ``tl_geometry`` and of
    its public subpackages."""
    packages = [tl_geometry]
    for info in pkgutil.iter_modules(tl_geometry.__path__, "tl_geometry."):
        if info.ispkg and not info.name.rsplit(".", 1)[1].startswith("_"):
            packages.append(importlib.import_module(info.name))
    return [(p.__name__, name, getattr(p, name)) for p in packages for name in getattr(p, "__all__", ())]


def handler_options() -> dict:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            return dict(plugin["mkdocstrings"]["handlers"]["python"].get("options", {}))
    raise AssertionError("mkdocs.yml configures no mkdocstrings Python handler")


def blocks(text: str) -> list[tuple[str, dict]]:
    """Each ``::: identifier`` block of a page with its ``options``."""
    yaml = pytest.importorskip("yaml")
    found = []
    for match in BLOCK.finditer(text):
        body = yaml.safe_load(match["yaml"]) if match["yaml"].strip() else None
        found.append((match["path"], (body or {}).get("options", {}) or {}))
    return found


def _runtime(path: str) -> Any:
    """The object that a dotted path names, importing modules as needed."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _keep(name: str, filters: list[str]) -> bool:
    # The handler's filters (its _keep_object): the last pattern that matches decides; with no
    # match, a name is kept unless every pattern is an inclusion.
    keep, rules = None, set()
    for pattern in filters:
        exclude = pattern.startswith("!")
        rules.add(exclude)
        if re.search(pattern.removeprefix("!"), name):
            keep = not exclude
    return rules != {False} if keep is None else keep


def rendered(text: str, options: dict) -> list[tuple[str, Any]]:
    """``(name, object)`` of every module-level object that the page renders."""
    griffe = pytest.importorskip("griffe")
    package = griffe.load("tl_geometry", search_paths=[str(ROOT)],
                          extensions=griffe.load_extensions(*[str(ROOT / e) for e in options.get("extensions", [])]),
                          resolve_aliases=True, resolve_external=False)
    shown = []
    for path, local in blocks(text):
        opts = {**options, **local}
        shown.append((path.rsplit(".", 1)[-1], _runtime(path)))
        obj = package[path.removeprefix("tl_geometry.")] if path != "tl_geometry" else package
        if not obj.is_module:
            continue
        members = opts.get("members")
        chosen = []
        for name, member in obj.members.items():
            if member.kind is griffe.Kind.MODULE and not opts.get("show_submodules", False):
                continue  # a submodule, even one that an exported function of its name shadows
            if members is not None:
                if members is True or (members and name in members):
                    chosen.append(name)
            elif (_keep(name, opts.get("filters", [])) and (not member.is_imported or member.is_public)
                  and (opts.get("show_if_no_docstring") or member.has_docstrings)):
                chosen.append(name)
        module = _runtime(path)
        shown += [(name, getattr(module, name, None)) for name in chosen]
    return shown


def missing(text: str, options: dict) -> list[str]:
    shown = rendered(text, options)
    return [f"{package}.{name}" for package, name, obj in public_names()
            if not any(n == name and o is obj for n, o in shown)]


def test_every_public_name_is_in_the_api_reference():
    absent = missing(API.read_text(encoding="utf-8"), handler_options())
    assert not absent, "docs/api.md does not document:\n  " + "\n  ".join(absent)


def test_the_check_sees_what_mkdocstrings_leaves_out():
    """A whole-module block renders neither a function shadowed by its submodule nor a member
    without a docstring; a members list or an explicit block does."""
    options = handler_options()
    whole = missing("::: tl_geometry.functional\n    options:\n      show_submodules: false\n", options)
    assert "tl_geometry.functional.separability" in whole and "tl_geometry.functional.spearman" not in whole
    listed = missing("::: tl_geometry.functional\n    options:\n      members:\n        - separability\n", options)
    assert "tl_geometry.functional.separability" in listed  # the member of that name is the module
    explicit = missing("::: tl_geometry.functional.separability.separability\n", options)
    assert "tl_geometry.functional.separability" not in explicit
    assert "tl_geometry.ablation.heads_kept" in missing(
        "::: tl_geometry.ablation\n    options:\n      members:\n        - ablate_heads\n", options)
