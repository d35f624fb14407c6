"""`import tl_geometry` stays light: no transformers, TransformerLens, matplotlib or pandas."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import warnings

import pytest

import tl_geometry

HEAVY = ("transformers", "transformer_lens", "matplotlib", "pandas", "circuitsvis", "gguf")


def _modules_after(code: str) -> set[str]:
    """Top-level heavy modules loaded by ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_does_not_load_heavy_dependencies():
    assert _modules_after("import tl_geometry") == set()


def test_lazy_exports_resolve_on_first_use():
    assert "matplotlib" in _modules_after("import tl_geometry; tl_geometry.views")
    assert "transformers" not in _modules_after("from tl_geometry import load_model")
    for name in ("load_model", "views", "write_report"):
        assert name in tl_geometry.__all__ and name in dir(tl_geometry)
        assert getattr(tl_geometry, name) is not None
    assert tl_geometry.load_model is tl_geometry.inputs.models.load_model


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_thing"):
        tl_geometry.no_such_thing  # noqa: B018
    assert not hasattr(tl_geometry, "no_such_thing")


def test_every_public_name_resolves():
    for name in tl_geometry.__all__:
        assert getattr(tl_geometry, name) is not None, name


def test_the_front_door_is_small_and_ablation_and_capacity_names_live_in_their_subpackages():
    """At most 20 names in ``tl_geometry.__all__``; the ablation and capacity names are read from
    ``tl_geometry.ablation`` / ``tl_geometry.capacity`` only, with no alias at the top level or of
    a capacity name in ``tl_geometry.ablation``."""
    from tl_geometry import ablation, capacity

    assert len(tl_geometry.__all__) <= 20 and {"ablation", "capacity"} <= set(tl_geometry.__all__)
    assert not set(ablation.__all__) & set(capacity.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in (*ablation.__all__, *capacity.__all__):
            assert not hasattr(tl_geometry, name) and name not in dir(tl_geometry), name
        for name in capacity.__all__:
            assert not hasattr(ablation, name), name


@pytest.mark.parametrize(("module", "name"), [
    ("tl_geometry", "ablate_heads"),
    ("tl_geometry", "top_n_attention"),
    ("tl_geometry", "TopNPolicy"),
    ("tl_geometry.ablation", "top_n_attention"),
    ("tl_geometry.ablation", "TopNPolicy"),
])
def test_removed_aliases_are_attribute_errors(module, name):
    home = importlib.import_module(module)
    with pytest.raises(AttributeError, match=rf"module '{re.escape(module)}' has no attribute '{name}'"):
        getattr(home, name)
    with pytest.raises(ImportError, match=name):
        exec(f"from {module} import {name}", {})
