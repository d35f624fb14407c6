"""Hand-built ``HeadAnalysis`` objects whose every value encodes its position, so a test can tell
a selection by coordinate from one by position."""

from __future__ import annotations

from typing import Any

import torch

from tl_geometry.result import HeadAnalysis, schema


def fake(layers=(3, 5), n_heads: int = 4, n_values=(2, 4, 8), *, bounds: bool = False,
         metadata: dict[str, Any] | None = None, per_sequence: bool = True) -> HeadAnalysis:
    """``scores[g, m, l, h, i] = g·10⁴ + m·10³ + l·100 + h·10 + i`` (and alike for the other
    fields); head ``h`` of layer position ``l`` gets label ``CLASSES[(l + h) % 3]``. Its votes
    come from 3 sequences (``per_sequence``): one vote of each kind, then 2 and ``2 + h`` more for
    the winning class, so resamples without the last two sequences tie (→ Retriever)."""
    names = schema.names()
    sizes = {"layer": len(layers), "head": n_heads, "n": len(n_values)}
    sizes.update({axis: len(labels) for axis, labels in names.items()})

    def coded(key: str) -> torch.Tensor:
        shape = [sizes[a] for a in schema.AXES[key]]
        grids = torch.meshgrid(*(torch.arange(s, dtype=torch.float64) for s in shape), indexing="ij")
        weights = [10.0 ** (len(shape) - 1 - d) for d in range(len(shape))]
        return sum(w * g for w, g in zip(weights, grids)) + 0.5  # type: ignore[return-value]

    sequence_votes = torch.zeros(3, len(layers), n_heads, 3, dtype=torch.int32)
    for li in range(len(layers)):
        for h in range(n_heads):
            sequence_votes[0, li, h] = 1
            sequence_votes[1, li, h, (li + h) % 3] = 2
            sequence_votes[2, li, h, (li + h) % 3] = 2 + h  # distinct fractions per head
    votes = sequence_votes.sum(0).double()
    return HeadAnalysis(
        layers=tuple(layers), n_values=torch.tensor(n_values), scores=coded("scores"),
        group_counts=coded("group_counts").floor(), sink=coded("sink"), vote_counts=votes,
        metadata=dict(metadata or {}),
        bounds=coded("bounds") / 1e5 if bounds else None, regime=coded("regime") if bounds else None,
        paired=coded("paired"), sequence_votes=sequence_votes if per_sequence else None,
        truncation_p90=coded("truncation_p90") / 1e5,
    )
