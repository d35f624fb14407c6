"""``analyze_heads``: cache → per-head tensors → selections → metrics, sink, taxonomy → result.

The layer loop reads one layer's pattern and values at a time. Within a layer, work is split
into chunks of sequences × query blocks small enough to bound memory, and every chunk is
reduced at once into mergeable sums and counts (:class:`_Accumulator`), so batches, streams and
processes combine by addition.

Averaging protocol (SPEC §8; the grouping is ours): for the top-N, random and sink-removed
groups, a metric is averaged over the chosen queries of each sequence first, then over
sequences. The random baseline is first averaged over its ``random_samples`` permutations. The
sink-in / sink-out groups pool every (sequence, query) instance of the top-N set by whether the
sink is inside it. Sink diagnostics are averaged per sequence, then over sequences. Taxonomy
votes are pooled counts over every query after the sink.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from . import cache as _cache
from .functional._types import COMPUTE_DTYPE
from .functional.bounds import (
    REGIME_FIELDS,
    RegimeParams,
    diagnostics_from_pairs,
    inversion_bounds,
    pair_stats,
    params_from_pairs,
    regime_bounds,
)
from .functional.heads import first_duplicate, last_positions, sink_positions, value_norms
from .functional.selection import _inverse_permutation, top_n_ranks
from .functional.separability import METRIC_NAMES, distances, scores_from_distances
from .functional.sink import SINK_FIELDS, sink_diagnostics
from .functional.taxonomy import source_votes
from .result import HeadAnalysis

DEFAULT_N_VALUES = (1, 2, 4, 8, 16, 32, 64)
#: Queries per block of the ``"all"`` mode. Random draws are seeded per (layer, sequence,
#: block), so results do not depend on how many sequences are processed together.
QUERY_BLOCK = 16
#: Target size of one chunk's [sequence, head, query, selection, N, key] tensors. Chunks split
#: over sequences and, for long contexts, over the queries of a block; the smallest chunk (one
#: query of one sequence, every head) holds head × (2 + random_samples) × n × key elements.
CHUNK_ELEMENTS = 1 << 22


@dataclass
class _Accumulator:
    """Mergeable sums and counts of one analysis (``a + b`` merges two)."""

    seq_sum: Tensor  # [layer, head, 3 groups, n, metric]: Σ over sequences of per-sequence means
    seq_count: Tensor  # same shape: sequences with a finite per-sequence mean
    inst_sum: Tensor  # [layer, head, 2 (sink in, out), n, metric]: Σ over instances
    inst_count: Tensor  # [layer, head, 2, n]
    sink_sum: Tensor  # [layer, head, field]: Σ over sequences of per-sequence means
    sink_count: Tensor  # [layer, head, field]
    votes: Tensor  # [layer, head, 3]
    bound_sum: Tensor  # [layer, head, 3 kinds, n, 3 (P, R, F)]: Σ over sequences of means
    bound_count: Tensor  # same shape
    regime_sum: Tensor  # [layer, head, field]: Σ over sequences of regime diagnostics
    regime_count: Tensor  # same shape

    @classmethod
    def zeros(cls, n_layers: int, n_heads: int, n_n: int) -> _Accumulator:
        z = lambda *s: torch.zeros(*s, dtype=COMPUTE_DTYPE)  # noqa: E731
        m, f = len(METRIC_NAMES), len(SINK_FIELDS)
        return cls(
            z(n_layers, n_heads, 3, n_n, m), z(n_layers, n_heads, 3, n_n, m),
            z(n_layers, n_heads, 2, n_n, m), z(n_layers, n_heads, 2, n_n),
            z(n_layers, n_heads, f), z(n_layers, n_heads, f), z(n_layers, n_heads, 3),
            z(n_layers, n_heads, 3, n_n, 3), z(n_layers, n_heads, 3, n_n, 3),
            z(n_layers, n_heads, len(REGIME_FIELDS)), z(n_layers, n_heads, len(REGIME_FIELDS)),
        )

    def __add__(self, other: _Accumulator) -> _Accumulator:
        return _Accumulator(*(a + b for a, b in zip(self._tensors(), other._tensors())))

    def _tensors(self) -> tuple[Tensor, ...]:
        return (self.seq_sum, self.seq_count, self.inst_sum, self.inst_count,
                self.sink_sum, self.sink_count, self.votes, self.bound_sum, self.bound_count,
                self.regime_sum, self.regime_count)

    def result(
        self, layers: Sequence[int], n_values: Tensor, metadata: dict[str, Any], bounds: bool = False
    ) -> HeadAnalysis:
        seq_mean = self.seq_sum / self.seq_count  # 0/0 → NaN where nothing was defined
        inst_mean = self.inst_sum / self.inst_count.unsqueeze(-1)
        # [layer, head, group, n, metric] → [group, metric, layer, head, n]
        scores = torch.cat([seq_mean, inst_mean], dim=2).permute(2, 4, 0, 1, 3).contiguous()
        counts = torch.cat([self.seq_count[..., 0], self.inst_count], dim=2).permute(2, 0, 1, 3)
        return HeadAnalysis(
            layers=tuple(layers),
            n_values=n_values,
            scores=scores,
            group_counts=counts.contiguous(),
            sink=(self.sink_sum / self.sink_count).permute(2, 0, 1).contiguous(),
            vote_counts=self.votes.clone(),
            metadata=metadata,
            bounds=(self.bound_sum / self.bound_count).permute(2, 4, 0, 1, 3).contiguous()
            if bounds else None,
            regime=(self.regime_sum / self.regime_count).permute(2, 0, 1).contiguous()
            if bounds else None,
        )


def _check_options(n_values, queries, random_samples, seed, distance, space, rank_by, bounds) -> Tensor:
    if queries not in ("last", "all"):
        raise ValueError(f"queries must be 'last' (paper protocol) or 'all', got {queries!r}.")
    if distance not in ("euclidean", "cosine"):
        raise ValueError(f"distance must be 'euclidean' or 'cosine', got {distance!r}.")
    if space not in ("value", "output"):
        raise ValueError(f"space must be 'value' (α·v) or 'output' (α·v·W_O), got {space!r}.")
    if bounds and distance != "euclidean":
        raise ValueError("bounds=True needs distance='euclidean': the regime bounds are Euclidean (SPEC §6b).")
    if rank_by not in ("attention", "contribution"):
        raise ValueError(f"rank_by must be 'attention' or 'contribution', got {rank_by!r}.")
    if isinstance(random_samples, bool) or not isinstance(random_samples, int) or random_samples < 1:
        raise ValueError(f"random_samples must be a positive int, got {random_samples!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}.")
    if isinstance(n_values, (Tensor, np.ndarray)):
        n_values = n_values.tolist()
    try:
        values = [n_values] if isinstance(n_values, int) else list(n_values)
    except TypeError:
        raise ValueError(f"n_values must be a sequence of positive ints, got {n_values!r}.") from None
    if not values or any(
        isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in values
    ):
        raise ValueError(f"n_values must be positive ints (selection sizes N ≥ 1), got {n_values!r}.")
    values = [int(n) for n in values]
    if len(set(values)) != len(values):
        raise ValueError(f"n_values has duplicates: {values}.")
    return torch.tensor(sorted(values))


def _output_weights(model: Any, W_O: Tensor | None, layers: Sequence[int]) -> Tensor:
    if W_O is None:
        W_O = getattr(model, "W_O", None) if model is not None else None
    if W_O is None:
        raise ValueError(
            "space='output' needs the output projections: pass model=... (with .W_O) or "
            "W_O=model.W_O, a [layer, head, d_head, d_model] tensor."
        )
    if not isinstance(W_O, Tensor):
        raise ValueError(f"W_O must be a torch tensor [layer, head, d_head, d_model], got {type(W_O).__name__}.")
    if W_O.ndim != 4 or max(layers) >= W_O.shape[0]:
        raise ValueError(f"W_O must be [layer, head, d_head, d_model] covering layer {max(layers)}.")
    W_O = W_O.detach()
    if not torch.isfinite(W_O[list(layers)]).all():
        raise ValueError("W_O has NaN or inf entries in the analysed layers.")
    return W_O


def _layer_values(v: Tensor, n_heads: int, W_O: Tensor | None) -> Tensor:
    """Per-KV-head values ``[batch, kv_head, pos, d]`` or, in output space, ``v·W_O[h]`` per query
    head ``[batch, head, pos, d_model]`` (each head's group is then of size one)."""
    values = v.to(COMPUTE_DTYPE).permute(0, 2, 1, 3)
    if W_O is None:
        return values
    batch, n_kv, n_pos, d_head = values.shape
    if W_O.shape[:2] != (n_heads, d_head):
        raise ValueError(f"W_O of this layer is {tuple(W_O.shape)}; expected [{n_heads}, {d_head}, d_model].")
    w = W_O.to(COMPUTE_DTYPE).reshape(n_kv, n_heads // n_kv, d_head, -1)
    return torch.einsum("bvkd,vgdm->bvgkm", values, w).reshape(batch, n_heads, n_pos, -1)


def _seed(seed: int, layer: int, sequence: int, block: int) -> int:
    mixed = seed
    for part in (layer, sequence, block):
        mixed = (mixed * 1_000_003 + part + 1) % (1 << 62)
    return mixed


def _split_heads(x: Tensor, n_kv: int, dim: int = 1) -> Tensor:
    """``[..., head, ...]`` → ``[..., kv_head, group, ...]`` (a view: no value is copied)."""
    shape = x.shape
    return x.reshape(*shape[:dim], n_kv, shape[dim] // n_kv, *shape[dim + 1 :])


def _votes(pattern: Tensor, values: Tensor, mask: Tensor, sink: Tensor) -> Tensor:
    """Source-winner vote counts ``[head, 3]`` over every real query after the sink (SPEC §5)."""
    batch, n_heads, n_pos, _ = pattern.shape
    n_kv = values.shape[1]
    positions = torch.arange(n_pos)
    key_mask = (positions[None, :, None] >= positions[None, None, :]) & mask[:, None, :]
    votes = source_votes(
        _split_heads(pattern, n_kv),  # [b, kv, g, q, k]
        values[:, :, None, None],  # [b, kv, 1, 1, k, d]
        key_mask[:, None, None],  # [b, 1, 1, q, k]
        positions[None, None, None, :],
        sink[:, None, None, None],
    ).reshape(batch, n_heads, n_pos)
    counted = (mask & (positions[None, :] > sink[:, None]))[:, None, :]
    one_hot = torch.nn.functional.one_hot(votes, 3) * counted[..., None]
    return one_hot.sum(dim=(0, 2)).to(COMPUTE_DTYPE)


def _chunk(
    pattern: Tensor, values: Tensor, duplicates: Tensor, mask: Tensor, sink: Tensor,
    query_pos: Tensor, query_ok: Tensor, n_values: Tensor, *, seeds: list[int],
    random_samples: int, distance: str, rank_by: str, regimes: tuple[RegimeParams, ...] = (),
    draw_rows: tuple[int, int] = (0, 1),
) -> tuple[Tensor, ...]:
    """Metrics of one chunk of sequences × chosen queries, reduced over queries.

    ``pattern`` [b, head, pos, key]; ``values`` [b, kv, key, d]; ``query_pos``/``query_ok``
    [b, q]. Returns per-sequence means ``[b, head, 3, n, metric]`` (top, random, sink removed),
    sink-in/out instance sums and counts, and per-sequence sink diagnostic means.
    """
    batch, n_heads, _, n_pos = pattern.shape
    n_kv = values.shape[1]
    n_q = query_pos.shape[1]
    keys = torch.arange(n_pos)
    alpha = pattern.gather(2, query_pos[:, None, :, None].expand(batch, n_heads, n_q, n_pos))
    alpha = alpha.to(COMPUTE_DTYPE)  # [b, h, q, k]
    key_mask = (keys <= query_pos[..., None]) & mask[:, None, :]  # [b, q, k]
    is_sink = keys == sink[:, None, None]  # [b, 1, k]
    scores = alpha
    if rank_by == "contribution":
        scores = (_split_heads(alpha, n_kv) * value_norms(values)[:, :, None, None]).flatten(1, 2)

    # Ranks encode nested selections for every N (SPEC §2–3): top-N, sink removed, random.
    top = top_n_ranks(scores, key_mask[:, None])
    no_sink_mask = key_mask & ~is_sink
    top_no_sink = top_n_ranks(scores, no_sink_mask[:, None])
    rand = torch.stack([
        _sequence_random_ranks(key_mask[i], mask[i], n_heads, random_samples, seeds[i], *draw_rows)
        for i in range(batch)
    ])  # [b, h, q, R, k]
    ranks = torch.cat([top[:, :, :, None], top_no_sink[:, :, :, None], rand], dim=3)
    selected = ranks[:, :, :, :, None, :] < n_values[:, None]  # [b, h, q, sel, n, k]
    group_mask = torch.stack([key_mask, no_sink_mask] + [key_mask] * random_samples, dim=2)
    group_mask = group_mask[:, None, :, :, None, :]  # [b, 1, q, sel, 1, k]

    def split(x: Tensor) -> Tensor:
        return _split_heads(x, n_kv) if x.shape[1] == n_heads else x.unsqueeze(2)

    dist = distances(
        split(alpha[:, :, :, None, None, :]),
        values[:, :, None, None, None, None],
        split(selected),
        distance,  # type: ignore[arg-type]
        duplicates[:, :, None, None, None, None],
    )
    fields = scores_from_distances(
        dist, split(selected), split(group_mask), n_values.to(COMPUTE_DTYPE)
    )
    metrics = torch.stack(fields, dim=-1).flatten(1, 2)  # [b, h, q, sel, n, metric]
    per_query = torch.stack(
        [metrics[:, :, :, 0], metrics[:, :, :, 2:].mean(3), metrics[:, :, :, 1]], dim=3
    )  # [b, h, q, 3, n, metric]
    per_query = torch.where(query_ok[:, None, :, None, None, None], per_query, torch.nan)
    seq_sum, seq_count = _nansum_count(per_query, dim=2)  # [b, h, 3, n, metric]

    # Sink inside / outside the top-N set, pooled over instances.
    top_metrics = per_query[:, :, :, 0]  # [b, h, q, n, metric]
    sink_rank = top.gather(-1, sink[:, None, None, None].expand(batch, n_heads, n_q, 1))
    inside = sink_rank < n_values  # [b, h, q, n]
    defined = torch.isfinite(top_metrics[..., 0])
    groups = torch.stack([inside & defined, ~inside & defined], dim=2)  # [b, h, 2, q, n]
    inst_sum = torch.where(groups[..., None], top_metrics[:, :, None], 0).sum(dim=(0, 3))
    inst_count = groups.sum(dim=(0, 3)).to(COMPUTE_DTYPE)

    sink_fields = sink_diagnostics(
        _split_heads(alpha, n_kv), values[:, :, None, None], key_mask[:, None, None],
        sink[:, None, None, None],
    )
    diag = torch.stack(sink_fields, dim=-1).flatten(1, 2)  # [b, h, q, field]
    diag = torch.where(query_ok[:, None, :, None], diag, torch.nan)
    out = (seq_sum, seq_count, inst_sum, inst_count, *_nansum_count(diag, dim=2))
    if not regimes:
        return out
    # Bounds of the top-N sets (SPEC §6): inversion certificates, then the regime bounds.
    kinds = [torch.stack(inversion_bounds(n_values, top_metrics[..., 4]), dim=-1)]  # [b,h,q,n,3]
    top_split = split(top)
    for params in regimes:
        per_n = []
        for n in n_values.tolist():
            bound = regime_bounds(
                _split_heads(alpha, n_kv), RegimeParams(*(x[:, :, None, None] for x in params)), n,
                sink=sink[:, None, None, None], key_mask=key_mask[:, None, None],
                selected=(top_split < n) & key_mask[:, None, None],
            )
            per_n.append(torch.stack(bound, dim=-1).flatten(1, 2))  # [b, h, q, 3]
        kinds.append(torch.stack(per_n, dim=3))
    bounds = torch.stack(kinds, dim=3)  # [b, h, q, kind, n, 3]
    bounds = torch.where(query_ok[:, None, :, None, None, None], bounds, torch.nan)
    return (*out, *_nansum_count(bounds, dim=2))


def _sequence_random_ranks(
    key_mask: Tensor, real: Tensor, n_heads: int, samples: int, seed: int, first: int = 0,
    block_queries: int = 1,
) -> Tensor:
    """Random ranks ``[head, q, R, key]`` of one sequence, drawn over its real keys only.

    The draws are indexed by real-key order, not by position, so a sequence gets the same
    permutations whether it is analysed alone or in a padded batch of any width. ``first`` is
    the first query's row in its block of ``block_queries`` queries.
    """
    n_q, n_key = key_mask.shape
    real_keys = real[:n_key].nonzero().flatten()
    g = torch.Generator().manual_seed(seed)
    # A fixed draw shape (a full query block) keeps each query's draws independent of how many
    # queries the block holds in this batch, and of how the block is sliced into chunks.
    block = QUERY_BLOCK if block_queries > 1 else 1
    draws = torch.rand(block, n_heads, samples, int(real.sum()), generator=g, dtype=torch.float64)
    keys = torch.full((n_heads, n_q, samples, n_key), 2.0, dtype=torch.float64)
    rows = draws[first : first + n_q, ..., : real_keys.numel()]
    keys[..., real_keys] = rows.transpose(0, 1)
    keys = torch.where(key_mask[None, :, None, :], keys, 2.0)  # invalid keys sort last
    return _inverse_permutation(keys.argsort(dim=-1))


def _nansum_count(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    finite = torch.isfinite(x)
    return torch.where(finite, x, 0).sum(dim), finite.sum(dim).to(COMPUTE_DTYPE)


def analyze_heads(
    cache: Any,
    *,
    n_values: Sequence[int] = DEFAULT_N_VALUES,
    queries: Literal["last", "all"] = "last",
    random_samples: int = 16,
    seed: int = 0,
    attention_mask: Tensor | None = None,
    layers: Sequence[int] | None = None,
    distance: Literal["euclidean", "cosine"] = "euclidean",
    space: Literal["value", "output"] = "value",
    rank_by: Literal["attention", "contribution"] = "attention",
    model: Any = None,
    W_O: Tensor | None = None,
    bounds: bool = False,
    progress: bool = False,
) -> HeadAnalysis:
    """Geometric separability, sink diagnostics and taxonomy of every head in a cache.

    Reads ``blocks.{l}.attn.hook_pattern`` ``[batch, head, query, key]`` and
    ``blocks.{l}.attn.hook_v`` ``[batch, pos, kv_head, d_head]`` by exact name from a
    TransformerLens ``ActivationCache`` (2.x, 3.x or 4.x) or a plain dict, layer by layer.

    Per (layer, head, N) it averages precision, recall, F, margin and inversions (SPEC §3) of
    the top-N set, of ``random_samples`` nested random subsets (seeded by ``seed``), of the
    top-N re-selected with the sink removed from the keys, and of the top-N instances with the
    sink inside and outside the set. Per (layer, head) it gives the sink diagnostics of SPEC §4
    and the source-winner taxonomy of SPEC §5 (always over every query after the sink).

    Args:
        cache: ``ActivationCache`` or ``dict`` with the two hooks of every analysed layer; make
            it with ``names_filter=tl_geometry.CACHE_NAMES_FILTER``.
        n_values: selection sizes N. A size that a query cannot hold (``N ≥ t + 1``) gives NaN
            for that query, never a smaller N.
        queries: ``"last"`` — each sequence's last real query (the paper's protocol); ``"all"``
            — every real query.
        random_samples: random permutations per (query, head) for the baseline.
        seed: seed of the random baseline; the same seed gives the same numbers.
        attention_mask: ``[batch, pos]``, 1 for real tokens: required for padded batches (left
            or right). The sink is each sequence's first real token.
        layers: layer indices to analyse (default: every layer in the cache).
        distance: ``"euclidean"`` (default) or ``"cosine"``.
        space: ``"value"`` (``y = α·v``, default) or ``"output"`` (``y = α·v·W_O[h]``; needs
            ``model`` or ``W_O``).
        rank_by: rank keys for the top-N set by ``"attention"`` (α) or ``"contribution"``
            (α‖v‖), SPEC §2's variant.
        model: optional model, read for ``W_O`` and for the run's metadata (name, weight
            processing: folded value biases change ``v``).
        W_O: ``[layer, head, d_head, d_model]`` output projections for ``space="output"``.
        bounds: also compute, per (layer, head, N), the inversion certificates, the certified
            regime bounds and the predicted envelope of the top-N sets, and the regime
            diagnostics per head (SPEC §6; Euclidean regime).
        progress: show a progress bar over layers.

    Returns:
        :class:`HeadAnalysis`.

    Examples:
        >>> _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
        >>> result = tl_geometry.analyze_heads(cache, n_values=(1, 2, 4, 8))  # doctest: +SKIP
        >>> print(result.summary())  # doctest: +SKIP
    """
    n_tensor = _check_options(n_values, queries, random_samples, seed, distance, space, rank_by, bounds)
    layer_ids = _cache.resolve_layers(cache, layers)
    W = _output_weights(model, W_O, layer_ids) if space == "output" else None

    opts = _Options(n_tensor, queries, random_samples, seed, distance, rank_by, bounds)
    acc: _Accumulator | None = None
    shape: tuple[int, ...] | None = None
    mask = sink = None
    iterator: Any = enumerate(layer_ids)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, total=len(layer_ids), desc="analyze_heads", unit="layer")
    for li, layer in iterator:
        pattern, v = _cache.read_layer(cache, layer)
        batch, n_heads, n_pos, _ = pattern.shape
        if shape is None:
            shape = (batch, n_heads, n_pos)
            mask = _cache.check_attention_mask(attention_mask, batch, n_pos)
            sink = sink_positions(mask)
            acc = _Accumulator.zeros(len(layer_ids), n_heads, len(n_tensor))
        elif (batch, n_heads, n_pos) != shape:
            raise _cache.CacheError(
                f"Layer {layer}'s pattern is {tuple(pattern.shape)} but an earlier layer's was "
                f"[{shape[0]}, {shape[1]}, {shape[2]}, {shape[2]}]: the layers of one cache must agree."
            )
        assert acc is not None and mask is not None and sink is not None
        _add_layer(acc, li, layer, pattern, v, mask, sink, opts, None if W is None else W[layer],
                   mask_given=attention_mask is not None)

    assert acc is not None and shape is not None
    metadata = _metadata(model, cache, shape, opts, space, attention_mask is not None)
    return _finish(acc, layer_ids, opts, shape[2], metadata)


@dataclass(frozen=True)
class _Options:
    """The analysis options that every layer needs (validated by ``_check_options``)."""

    n_values: Tensor
    queries: str
    random_samples: int
    seed: int
    distance: str
    rank_by: str
    bounds: bool


def _add_layer(
    acc: _Accumulator, li: int, layer: int, pattern: Tensor, v: Tensor, mask: Tensor,
    sink: Tensor, opts: _Options, W_layer: Tensor | None, *, mask_given: bool,
    sequence_offset: int = 0,
) -> None:
    """Validate one layer's pattern and values (new tensors) and add its statistics to ``acc``."""
    name = _cache.PATTERN_HOOK.format(layer=layer)
    pattern = _cache.clean_pattern(pattern.detach().cpu(), mask, name)
    if not mask_given:
        _cache.warn_padding_suspected(pattern, name)
    v = v.detach().cpu()
    _cache.check_values(v, mask, _cache.VALUE_HOOK.format(layer=layer))
    # Padding's values take part in no metric, but a NaN there would poison the products.
    v = torch.where(mask[:, :, None, None], v, 0.0)
    values = _layer_values(v, pattern.shape[1], None if W_layer is None else W_layer.cpu())
    _analyze_layer(acc, li, layer, pattern, values, mask, sink, opts.n_values, queries=opts.queries,
                   random_samples=opts.random_samples, seed=opts.seed, distance=opts.distance,
                   rank_by=opts.rank_by, bounds=opts.bounds, sequence_offset=sequence_offset)


def _finish(
    acc: _Accumulator, layer_ids: Sequence[int], opts: _Options, n_pos: int, metadata: dict[str, Any]
) -> HeadAnalysis:
    too_big = [int(n) for n in opts.n_values if n >= n_pos]
    if too_big:
        import warnings

        warnings.warn(
            f"N = {too_big} cannot be evaluated on {n_pos}-position sequences (N must be below "
            "the number of keys); their metrics are NaN.",
            stacklevel=3,
        )
    return acc.result(layer_ids, opts.n_values, metadata, bounds=opts.bounds)


def _analyze_layer(
    acc: _Accumulator, li: int, layer: int, pattern: Tensor, values: Tensor, mask: Tensor,
    sink: Tensor, n_values: Tensor, *, queries: str, random_samples: int, seed: int,
    distance: str, rank_by: str, bounds: bool = False, sequence_offset: int = 0,
) -> None:
    """Add one layer of one batch to ``acc`` (row ``li``)."""
    batch, n_heads, n_pos, _ = pattern.shape
    acc.votes[li] += _votes(pattern, values, mask, sink)
    if queries == "last":
        blocks = [(last_positions(mask)[:, None], torch.ones(batch, 1, dtype=torch.bool))]
    else:
        blocks = []
        for start in range(0, n_pos, QUERY_BLOCK):
            pos = torch.arange(start, min(start + QUERY_BLOCK, n_pos))
            blocks.append((pos.expand(batch, -1), mask[:, pos]))
    n_sel = 2 + random_samples
    # Per-sequence sums and counts over chosen queries, gathered across query blocks.
    seq_sum = torch.zeros(batch, n_heads, 3, len(n_values), len(METRIC_NAMES), dtype=COMPUTE_DTYPE)
    seq_count = torch.zeros_like(seq_sum)
    sink_sum = torch.zeros(batch, n_heads, len(SINK_FIELDS), dtype=COMPUTE_DTYPE)
    sink_count = torch.zeros_like(sink_sum)
    # A key's first duplicate never comes after it, so truncating keys keeps this valid.
    duplicates = first_duplicate(values)
    regimes: tuple[RegimeParams, ...] = ()
    bound_sum = bound_count = None
    if bounds:
        # Per (sequence, KV head) over the sequence's real keys: extremes are certificates for
        # every query of the sequence; quantiles give the predicted envelope (SPEC §6b).
        pairs = pair_stats(values, sink[:, None], mask[:, None])
        regimes = (params_from_pairs(pairs, "certificate"), params_from_pairs(pairs, "predict"))
        group = n_heads // values.shape[1]
        diag = torch.stack(diagnostics_from_pairs(pairs), dim=-1)  # [b, kv, field]
        _add_per_sequence(acc.regime_sum, acc.regime_count, li, diag.repeat_interleave(group, dim=1))
        bound_sum = torch.zeros(batch, n_heads, 3, len(n_values), 3, dtype=COMPUTE_DTYPE)
        bound_count = torch.zeros_like(bound_sum)
    for bi, (query_pos, query_ok) in enumerate(blocks):
        # Keys after a block's last query exist for none of its queries: leave them out.
        n_keys = int(query_pos.max()) + 1
        n_q = query_pos.shape[1]
        per_query = n_heads * n_sel * len(n_values) * n_keys
        # Chunks: several sequences of whole blocks, or, for long contexts, one sequence and a
        # slice of a block's queries, so one chunk holds about CHUNK_ELEMENTS (SPEC §1 memory).
        q_step = min(n_q, max(1, CHUNK_ELEMENTS // per_query))
        step = max(1, CHUNK_ELEMENTS // (per_query * n_q)) if q_step == n_q else 1
        pieces = [(lo, min(batch, lo + step), qa, min(n_q, qa + q_step))
                  for lo in range(0, batch, step) for qa in range(0, n_q, q_step)]
        for lo, hi, qa, qb in pieces:
            seeds = [_seed(seed, layer, sequence_offset + i, bi) for i in range(lo, hi)]
            out = _chunk(
                pattern[lo:hi, :, :, :n_keys], values[lo:hi, :, :n_keys],
                duplicates[lo:hi, :, :n_keys], mask[lo:hi, :n_keys],
                sink[lo:hi], query_pos[lo:hi, qa:qb], query_ok[lo:hi, qa:qb], n_values, seeds=seeds,
                random_samples=random_samples, distance=distance, rank_by=rank_by,
                regimes=tuple(RegimeParams(*(x[lo:hi] for x in r)) for r in regimes),
                draw_rows=(qa, n_q),
            )
            seq_sum[lo:hi] += out[0]
            seq_count[lo:hi] += out[1]
            acc.inst_sum[li] += out[2]
            acc.inst_count[li] += out[3]
            sink_sum[lo:hi] += out[4]
            sink_count[lo:hi] += out[5]
            if bound_sum is not None and bound_count is not None:
                bound_sum[lo:hi] += out[6]
                bound_count[lo:hi] += out[7]
    _add_per_sequence(acc.seq_sum, acc.seq_count, li, seq_sum / seq_count)
    _add_per_sequence(acc.sink_sum, acc.sink_count, li, sink_sum / sink_count)
    if bound_sum is not None and bound_count is not None:
        _add_per_sequence(acc.bound_sum, acc.bound_count, li, bound_sum / bound_count)


def _add_per_sequence(total: Tensor, count: Tensor, li: int, per_sequence: Tensor) -> None:
    """Add per-sequence means (NaN where nothing was defined) to layer ``li``'s sums and counts."""
    finite = torch.isfinite(per_sequence)
    total[li] += torch.where(finite, per_sequence, 0).sum(0)
    count[li] += finite.sum(0)


def _metadata(model: Any, source: Any, shape: tuple[int, ...], opts: _Options, space: str,
              masked: bool) -> dict[str, Any]:
    import tl_geometry

    meta: dict[str, Any] = {
        "tl_geometry_version": tl_geometry.__version__,
        "n_sequences": shape[0],
        "n_heads": shape[1],
        "n_positions": shape[2],
        "n_values": opts.n_values.tolist(),
        "queries": opts.queries,
        "random_samples": opts.random_samples,
        "seed": opts.seed,
        "distance": opts.distance,
        "space": space,
        "rank_by": opts.rank_by,
        "bounds": opts.bounds,
        "attention_mask": masked,
        "cache_type": type(source).__name__,
        "model_name": None,
        "model_class": None,
        "loading": {},
    }
    if model is not None:
        cfg = getattr(model, "cfg", None)
        meta["model_class"] = type(model).__name__
        meta["model_name"] = getattr(cfg, "model_name", None)
        meta["loading"] = _loading_info(model)
    return meta


def _loading_info(model: Any) -> dict[str, Any]:
    """How the weights were processed: folded value biases and centring change ``v`` and ``W_O``."""
    info: dict[str, Any] = dict(getattr(model, "tl_geometry_loading", {}) or {})
    cfg = getattr(model, "cfg", None)
    for key in ("fold_ln", "layer_norm_folding", "center_writing_weights", "center_unembed", "fold_value_biases",
                "default_prepend_bos", "dtype", "device"):
        value = getattr(cfg, key, None)
        if value is not None:
            info.setdefault(key, value if isinstance(value, (bool, int, float, str)) else str(value))
    for attr in ("compatibility_mode", "_compatibility_mode", "weights_processed", "_weights_processed"):
        value = getattr(model, attr, None)
        if isinstance(value, bool):
            info.setdefault(attr.lstrip("_"), value)
    return info
