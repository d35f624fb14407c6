"""Checks several test files share: a result's figures equal to the loop reference's
(tests/reference.py), two analyses equal field by field, a spy on the forward passes
head_scores makes, and a saved result made to look like an earlier file format."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import numpy as np
import torch

# By module path: tl_geometry.analyze's own `head_scores` attribute is the function.
_head_scores = importlib.import_module("tl_geometry.analyze.head_scores")

#: What result file formats 6 to 9 added: fields (and their axes) and named axes. Format 9 also
#: added the window groups ``sink_in`` and ``sink_out`` (:func:`drop_format_9`).
FORMAT_9_FIELDS = ("local_sink",)
FORMAT_9_NAMES = ("local_field",)
FORMAT_9_WINDOW_GROUPS = ("sink_in", "sink_out")
FORMAT_8_FIELDS = ("baseline_se", *FORMAT_9_FIELDS)
FORMAT_8_NAMES = ("se_kind", *FORMAT_9_NAMES)
FORMAT_7_FIELDS = ("window_bounds", *FORMAT_8_FIELDS)
FORMAT_6_FIELDS = ("beyond_votes", "block_votes", "window_scores", "window_sink", *FORMAT_7_FIELDS)
FORMAT_6_NAMES = ("window_group", *FORMAT_8_NAMES)


def _drop(payload: dict, fields: tuple[str, ...], named_axes: tuple[str, ...]) -> dict:
    """``payload`` without ``fields`` (and their axes) and the labels of ``named_axes``, in place."""
    for key in fields:
        payload.pop(key, None)
        payload.get("axes", {}).pop(key, None)
    for key in named_axes:
        payload.get("names", {}).pop(key, None)
    return payload


def drop_format_9(payload: dict) -> dict:
    """``payload`` (a loaded result file) without what format 9 added, in place: the local sink
    and the per-window sink-in / sink-out groups."""
    _drop(payload, FORMAT_9_FIELDS, FORMAT_9_NAMES)
    groups = payload.get("names", {}).get("window_group")
    if groups is not None:
        keep = [i for i, g in enumerate(groups) if g not in FORMAT_9_WINDOW_GROUPS]
        payload["names"]["window_group"] = [groups[i] for i in keep]
        if payload.get("window_scores") is not None:
            payload["window_scores"] = payload["window_scores"][:, keep].clone()
    return payload


def drop_format_8(payload: dict) -> dict:
    """``payload`` (a loaded result file) without what formats 8 and 9 added, in place."""
    drop_format_9(payload)
    return _drop(payload, FORMAT_8_FIELDS, FORMAT_8_NAMES)


def drop_format_7(payload: dict) -> dict:
    """``payload`` (a loaded result file) without what formats 7 to 9 added, in place."""
    drop_format_9(payload)
    return _drop(payload, FORMAT_7_FIELDS, FORMAT_8_NAMES)


def drop_format_6(payload: dict) -> dict:
    """``payload`` (a loaded result file) without what formats 6 to 9 added, in place."""
    return _drop(payload, FORMAT_6_FIELDS, FORMAT_6_NAMES)


def as_format_2(payload: dict) -> dict:
    """``payload`` (a loaded result file) as format 2 wrote it, in place: no checksum (3),
    per-sequence votes (4), truncation figures (5) or what format 6 added."""
    payload["format"] = "tl_geometry.HeadAnalysis/2"
    del payload["checksum"], payload["sequence_votes"], payload["axes"]["sequence_votes"]
    del payload["truncation_p90"], payload["axes"]["truncation_p90"], payload["names"]["truncation_metric"]
    drop_format_6(payload)
    keep = [i for i, m in enumerate(payload["names"]["metric"]) if m not in ("tail_mass", "truncation_error")]
    payload["scores"] = payload["scores"][:, keep]
    payload["names"]["metric"] = [payload["names"]["metric"][i] for i in keep]
    return payload


def _assert_equals_reference(got, want: dict, key: str, tol: float, what: str) -> None:
    assert key in want, f"the reference (tests/reference.py) has no entry {key!r}"
    np.testing.assert_allclose(np.asarray(got), want[key], rtol=tol, atol=tol, equal_nan=True,
                               err_msg=f"{what}{key}")


def assert_metrics_equal_reference(result, want: dict, groups, metrics, *, layer: int = 0, tol: float = 1e-9,
                                   what: str = "") -> None:
    """``result.metric(m, group)[layer]`` equals the reference's ``want[f"{group}_{m}"]``
    (``[head, n]``, from ``ref_analyze``) within ``tol`` (relative and absolute; NaN exactly
    where it is NaN), for every group and metric. ``result`` is anything with the
    ``HeadAnalysis.metric`` accessor; a figure the reference lacks fails, naming it."""
    for group in groups:
        for m in metrics:
            _assert_equals_reference(result.metric(m, group)[layer].numpy(), want, f"{group}_{m}", tol, what)


def assert_sink_equals_reference(result, want: dict, fields, *, layer: int = 0, tol: float = 1e-9,
                                 what: str = "") -> None:
    """``result.sink_diagnostic(field)[layer]`` equals the reference's ``want[f"sink_{field}"]``
    (``[head]``) within ``tol``, for every sink field (SPEC §4)."""
    for field in fields:
        _assert_equals_reference(result.sink_diagnostic(field)[layer].numpy(), want, f"sink_{field}", tol, what)


def assert_bounds_equal_reference(result, want: dict, kinds, metrics, *, layer: int = 0, tol: float = 1e-9,
                                  what: str = "") -> None:
    """``result.bound(kind, m)[layer]`` equals the reference's ``want[f"{kind}_{m}"]``
    (``[head, n]``, from ``ref_bounds``) within ``tol``, for every bound kind and metric."""
    for kind in kinds:
        for m in metrics:
            _assert_equals_reference(result.bound(kind, m)[layer].numpy(), want, f"{kind}_{m}", tol, what)


#: The result fields two analyses of the same forwards must agree on.
FIELDS = ("scores", "group_counts", "sink", "vote_counts", "bounds", "regime", "sequence_votes")


def assert_same_analysis(a, b, tol: float = 1e-6) -> None:
    """Every field of :data:`FIELDS` equal within ``tol`` (NaN equal to NaN; both absent is
    equal), and the same layers and N."""
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
            continue
        torch.testing.assert_close(x, y, rtol=tol, atol=tol, equal_nan=True, msg=name)
    assert a.layers == b.layers and torch.equal(a.n_values, b.n_values)


def spy_head_score_inputs(monkeypatch) -> list[torch.Tensor]:
    """The token batches head_scores forwards, in order (each a copy), while it still runs them."""
    seen: list[torch.Tensor] = []
    real = _head_scores._forward

    def forward(model, tokens, *args):
        seen.append(tokens.clone())
        return real(model, tokens, *args)

    monkeypatch.setattr(_head_scores, "_forward", forward)
    return seen


def own_model_snippet(heading: str) -> str:
    """The first Python block under ``## heading`` in docs/own_model.md (run as written)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "own_model.md").read_text(encoding="utf-8")
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, f"docs/own_model.md: no Python block under '## {heading}'"
    return match.group(1)
