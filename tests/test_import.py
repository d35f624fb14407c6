"""`import tl_geometry` stays light: no transformers, TransformerLens, matplotlib or pandas."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_capacity_names_moved_from_ablation_still_resolve_there_with_a_warning():
    """Top-N attention and retrieval capacity moved from ``tl_geometry.ablation`` to
    ``tl_geometry.capacity``; for one release the old home still gives the same objects, with a
    ``DeprecationWarning`` that names the new one."""
    import tl_geometry.ablation as ablation
    import tl_geometry.capacity as capacity

    with pytest.warns(DeprecationWarning, match=r"tl_geometry\.capacity\.top_n_attention"):
        old = ablation.top_n_attention
    assert old is capacity.top_n_attention is tl_geometry.capacity.top_n_attention
    with pytest.warns(DeprecationWarning, match=r"tl_geometry\.capacity"):
        from tl_geometry.ablation import TopNPolicy
    assert TopNPolicy is capacity.TopNPolicy
    for name in capacity.__all__:
        with pytest.warns(DeprecationWarning, match=rf"tl_geometry\.capacity\.{name}\b"):
            assert getattr(ablation, name) is getattr(capacity, name), name
    assert not set(ablation.__all__) & set(capacity.__all__)
    with pytest.raises(AttributeError, match="no_such_thing"):
        ablation.no_such_thing  # noqa: B018


def test_the_front_door_is_small_and_moved_names_still_resolve_with_a_warning():
    """At most 20 names in ``tl_geometry.__all__``; the ablation and capacity names live in
    their subpackages, and the old top-level spelling works for one release, with a warning
    that names the new home."""
    from tl_geometry import ablation, capacity

    assert len(tl_geometry.__all__) <= 20 and {"ablation", "capacity"} <= set(tl_geometry.__all__)
    moved = tl_geometry._MOVED
    assert len(moved) == 20 and not set(moved) & set(tl_geometry.__all__)
    for name, home in moved.items():
        assert name not in dir(tl_geometry)
        with pytest.warns(DeprecationWarning, match=rf"tl_geometry.{name} has moved to tl_geometry.{home}.{name}"):
            old = getattr(tl_geometry, name)
        assert old is getattr({"ablation": ablation, "capacity": capacity}[home], name)
