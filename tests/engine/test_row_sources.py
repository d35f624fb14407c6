"""The engine reads attention rows through a source (``engine.block.AttentionRows``): a source that
serves only the chosen queries' rows, and every query's rows in small blocks for the votes and the
validation, gives the numbers of the whole cached pattern, on both backends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from cases import make_case

from tl_geometry.engine import check_options
from tl_geometry.engine.block import AttentionRows, PatternRows
from tl_geometry.engine.layer import analyze_layer
from tl_geometry.functional.heads import sink_positions


class CompactRows:
    """Copies of the chosen queries' rows only (float64, row ``i`` for query ``i``), and every
    query's rows in blocks of ``block``: what a source that recomputes rows serves."""

    def __init__(self, pattern: torch.Tensor, block: int) -> None:
        self.pattern, self.block = pattern, block

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.pattern.shape[0], self.pattern.shape[1], self.pattern.shape[2]

    @property
    def device(self) -> torch.device:
        return self.pattern.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64

    def rows(self, b0: int, b1: int, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads, keys = self.pattern.shape[1], self.pattern.shape[3]
        index = queries.clamp_min(0)[:, None, :, None].expand(-1, heads, -1, keys)
        rows = self.pattern[b0:b1].gather(2, index).double()
        return rows, torch.arange(queries.shape[1]).expand_as(queries)

    def blocks(self, b0: int, b1: int) -> Iterator[tuple[int, torch.Tensor]]:
        for q0 in range(0, self.pattern.shape[2], self.block):
            yield q0, self.pattern[b0:b1, :, q0 : q0 + self.block].double()


def test_both_sources_satisfy_the_protocol():
    pattern = make_case(0).pattern
    assert isinstance(PatternRows(pattern), AttentionRows)
    assert isinstance(CompactRows(pattern, 3), AttentionRows)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("queries", ["last", "all"])
@pytest.mark.parametrize("case_options", [
    {"ties": True, "duplicates": True, "sink": True},
    {"padding": "left", "n_kv": 1},
    {"padding": "right", "dtype": torch.bfloat16, "n_heads": 6, "n_kv": 3},
])
def test_compact_rows_in_blocks_equal_the_pattern(backend, queries, case_options):
    case = make_case(71, batch=3, n_pos=13, **case_options)
    opts = check_options(n_values=(1, 2, 3, 5, 8), queries=queries, random_samples=5, shuffle_samples=4,
                         seed=3, distance="euclidean", space="value", rank_by="attention", bounds=True,
                         backend=backend)
    mask = case.attention_mask.bool() if case.attention_mask is not None else torch.ones(case.pattern.shape[0],
                                                                                   case.pattern.shape[2],
                                                                                   dtype=torch.bool)
    sink = sink_positions(mask)
    kwargs = dict(layer=0, mask_given=case.attention_mask is not None)
    # The compact rows are float64 copies of the same numbers: a bf16 pattern is compared as such.
    pattern = case.pattern.double() if case.pattern.dtype == torch.bfloat16 else case.pattern
    want = analyze_layer(pattern, case.v, mask, sink, opts, **kwargs)
    got = analyze_layer(CompactRows(pattern, block=4), case.v, mask, sink, opts, **kwargs)
    for name, a, b in zip(want._fields, want, got):
        torch.testing.assert_close(b, a, equal_nan=True, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("case_options", [{"ties": True, "sink": True}, {"padding": "left", "n_kv": 1}])
def test_torch_twin_checks_in_query_blocks(monkeypatch, case_options):
    """The torch twin reads a cached pattern's rows a few queries at a time (never a float64 copy of
    a whole [head, query, key]); the votes and the validation add up to those of one block."""
    from tl_geometry.engine.twins import check

    case = make_case(5, batch=2, n_pos=11, **case_options)
    opts = check_options(n_values=(1, 2, 4), queries="all", random_samples=3, shuffle_samples=2, seed=1,
                         distance="euclidean", space="value", rank_by="attention", bounds=False,
                         backend="torch")
    mask = (case.attention_mask.bool() if case.attention_mask is not None
            else torch.ones(case.pattern.shape[0], case.pattern.shape[2], dtype=torch.bool))
    kwargs = dict(layer=0, mask_given=case.attention_mask is not None)
    want = analyze_layer(case.pattern, case.v, mask, sink_positions(mask), opts, **kwargs)
    bytes_per_query = case.pattern.shape[1] * case.pattern.shape[3] * 8
    monkeypatch.setattr(check, "TORCH_CHECK_BYTES", 3 * bytes_per_query)  # blocks of 3 queries
    got = analyze_layer(case.pattern, case.v, mask, sink_positions(mask), opts, **kwargs)
    for name, a, b in zip(want._fields, want, got):
        torch.testing.assert_close(b, a, equal_nan=True, rtol=0, atol=0, msg=name)
