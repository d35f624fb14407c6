"""An analysis restricted to some layers, and a model's global and local layers apart (SPEC §8 (i)):
a subset is the full analysis's figures for those layers, equal to analysing those layers alone;
the summary prints both kinds apart."""

from __future__ import annotations

import pytest
import torch
from cases import make_case
from result_fakes import fake

import tl_geometry
from tl_geometry.result import layer_kinds
from tl_geometry.result.schema import AXES

WINDOWS = {0: 5, 1: None, 2: 5, 3: None}  # two local layers of window 5, two global ones


def _cache(seed: int = 90):
    """Four layers of one synthetic GQA case, each layer's pattern banded to its window."""
    cache = {}
    for layer, window in WINDOWS.items():
        case = make_case(seed + layer, batch=3, n_pos=14, window=window, sink=True)
        cache[f"blocks.{layer}.attn.hook_pattern"] = case.pattern
        cache[f"blocks.{layer}.attn.hook_v"] = case.v
    return cache


def _equal(a: torch.Tensor | None, b: torch.Tensor | None, tolerance: float = 0.0) -> None:
    assert (a is None) == (b is None)
    if a is not None:
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance, equal_nan=True)


def test_a_subset_equals_the_analysis_of_those_layers_alone():
    cache = _cache()
    opts = dict(n_values=(1, 2, 4), queries="all", random_samples=3, shuffle_samples=3, window=WINDOWS,
                per_window=True, bounds=True)
    whole = tl_geometry.analyze_heads(cache, **opts)
    for layers in ([0, 2], [3, 1], [2]):
        part = whole.layer_subset(layers)
        alone = tl_geometry.analyze_heads(cache, layers=sorted(layers), **opts)
        alone = alone.layer_subset(layers)  # in the order asked
        assert part.layers == tuple(layers) and part.labels == alone.labels
        for name in AXES:  # the engine may sum another batch of layers in another order: 1 ulp
            _equal(getattr(part, name), getattr(alone, name), 1e-12)
        assert part.metadata["window"] == [WINDOWS[x] for x in layers]
        assert part.summary()  # every helper reads a subset as an analysis


def test_by_layer_kind_splits_on_the_recorded_windows():
    whole = tl_geometry.analyze_heads(_cache(), n_values=(1, 2), queries="all", window=WINDOWS)
    parts = whole.by_layer_kind()
    assert {k: p.layers for k, p in parts.items()} == {"global": (1, 3), "local": (0, 2)}
    assert parts["local"].metadata["layer_kind"] == "local" and "layer_kind" not in whole.metadata
    for kind, part in parts.items():
        rows = [whole.layers.index(x) for x in part.layers]
        _equal(part.f_score, whole.f_score[rows])
        _equal(part.vote_counts, whole.vote_counts[rows])
        assert part.labels == [whole.labels[i] for i in rows], kind
    text = whole.summary()
    assert "By layer kind" in text and "global layers 1, 3" in text and "local layers 0, 2" in text
    one_kind = tl_geometry.analyze_heads(_cache(), n_values=(1, 2), queries="all", window=None)
    assert one_kind.by_layer_kind() == {} and "By layer kind" not in one_kind.summary()


def test_subset_of_a_fake_slices_every_layer_field_and_leaves_the_original():
    r = fake(layers=(3, 5, 7), metadata={"window": [4, None, 4], "instances": [1, 2, 3], "n_sequences": 3})
    before = r.scores.clone()
    part = layer_kinds.layer_subset(r, [7, 3])
    _equal(part.scores, r.scores[:, :, [2, 0]])
    _equal(part.truncation_p90, r.truncation_p90[:, [2, 0]])
    _equal(part.sequence_votes, r.sequence_votes[:, [2, 0]])
    assert part.metadata["instances"] == [3, 1] and part.metadata["n_sequences"] == 3
    assert torch.equal(r.scores, before) and r.metadata["instances"] == [1, 2, 3]
    with pytest.raises(ValueError, match=r"layer=4 was not analysed; valid layer values: \[3, 5, 7\]"):
        r.layer_subset([4])
    with pytest.raises(ValueError, match="repeats a layer"):
        r.layer_subset([3, 3])
    with pytest.raises(ValueError, match="at least one layer"):
        r.layer_subset([])


def test_beyond_table_lists_every_local_head_with_its_beyond_window_votes():
    """Queries whose window starts after the sink vote apart (SPEC §1, §5); the table puts their
    counts beside the label of the queries that see the sink, head by head (a loop over the
    result's own fields is the reference)."""
    whole = tl_geometry.analyze_heads(_cache(91), n_values=(1, 2), queries="all", window=WINDOWS)
    table = whole.beyond_table()
    local = [(li, layer) for li, layer in enumerate(whole.layers) if WINDOWS[layer] is not None]
    assert len(table) == len(local) * whole.n_heads
    assert int(whole.beyond_votes.sum()) > 0  # windows of 5 in 14 positions: some queries lose the sink
    for row in table.itertuples():
        li = whole.layers.index(row.layer)
        current, sink, other = whole.beyond_votes[li, row.head].tolist()
        assert sink == 0 and (row.beyond_current, row.beyond_other) == (current, other)
        assert row.label == whole.labels[li][row.head] and row.window == WINDOWS[row.layer]
        want = None if current + other == 0 else "Retriever" if current >= other else "Reset"
        assert row.beyond_label == want
    from tl_geometry.views.report import layer_kind_section

    section = "".join(layer_kind_section(whole))
    assert "Global and local layers apart" in section and "beyond the sink" in section
    one_kind = tl_geometry.analyze_heads(_cache(91), n_values=(1, 2), queries="all", window=None)
    assert one_kind.beyond_table().empty and layer_kind_section(one_kind) == []


def test_the_weak_sink_hint_never_asks_for_the_rule_already_in_use():
    from tl_geometry.result.text import sink_check_text

    record = {"positions": [0, 0], "sink_mass": [0.1, 0.2], "other_mass": [0.3, 0.4], "weak": True}
    auto = fake(metadata={"sink": {**record, "rule": "auto", "chosen_from_layers": [0, 1, 2]}})
    given = fake(metadata={"sink": {**record, "rule": "given"}})
    assert "may have no sink" in sink_check_text(auto) and "sink='auto'" not in sink_check_text(auto)
    assert "Chosen from 3 layers: 0, 1, 2." in sink_check_text(auto)
    assert "re-run with sink='auto'" in sink_check_text(given)
