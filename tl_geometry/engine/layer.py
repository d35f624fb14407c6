"""Per-layer work: one layer's pattern and values → per-sequence statistics (:class:`LayerStats`).

The layer is processed in chunks of sequences (and, for long contexts, of value groups) so that
no more than a fraction of the pattern's size is held at once (:func:`_chunk_plan`). Per chunk:

1. value vectors of each *value group* — the KV heads in value space (query head ``h`` reads
   group ``h // (n_heads // n_kv)``), the query heads in output space (``v·W_O[h]``);
2. validation and the source-winner votes in one read of the rows (:mod:`.checks`), or from
   the queries and keys that recomputed rows come from (:mod:`.key_votes`);
3. the Gram matrices ``G = V Vᵀ`` of the chunk's groups, rows and columns of bit-identical
   value vectors made identical (exact ties stay exact, SPEC §3), and the sink geometry (κ,
   cosines, SPEC §4) from running sums along the keys;
4. every selection of every chosen query (SPEC §2–3, §10);

then the per-query rows are reduced over queries (:func:`_reduce`); the top-N set's truncation
figures (SPEC §10) are also handed on per query, for their exact percentiles.

Everything stays on the cache's device. The work of 2–4 and the reduction is done by the
layer's :class:`~.backend.Backend`, chosen once per layer (:func:`.backend.choose_backend`):
the compiled kernels of :mod:`.compiled` for CPU tensors, their torch twins of :mod:`.twins` on
other devices. The tests hold each pair to 1e-9; a kernel that numba cannot compile sends the
layer, and the rest of the run, to the twins (:func:`.backend.run_layer`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from einops import rearrange, reduce
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..functional.dtypes import COMPUTE_DTYPE
from ..functional.heads import last_positions
from ..functional.separability import METRIC_NAMES
from . import checks, key_votes
from .backend import Backend, choose_backend, run_layer
from .block import AttentionRows, KeyedRows, LayerBlock, PatternRows, group_values
from .bounds import layer_bounds
from .layout import INVERSIONS, SEQUENCE_GROUPS, TOP_GROUP, TRUNCATION
from .options import SHUFFLE_KINDS, AnalysisOptions
from .rng import sequence_keys

#: Bytes of chunk tensors (Gram blocks, values, upcast pattern rows) per byte of pattern.
CHUNK_FRACTION = 0.25
#: … but never less than this, so small layers are one chunk.
MIN_CHUNK_BYTES = 1 << 24
#: Bytes of recomputed attention rows (float64) scored at once.
ROW_BLOCK_BYTES = 1 << 26


class LayerStats(NamedTuple):
    """One layer of one batch, reduced over queries; every field adds across batches."""

    seq_mean: Float[Tensor, "batch head group n metric"]
    """Per-sequence means over the chosen queries (NaN where none was defined), groups
    :data:`.layout.SEQUENCE_GROUPS`."""
    inst_sum: Float[Tensor, "head inout n metric"]
    """Σ of top-N metrics over instances with the sink inside / outside the set."""
    inst_count: Float[Tensor, "head inout n"]
    paired_hist: Float[Tensor, "head n bin"]
    """Histogram of F_N(with sink) / F_N(sink removed) where the sink is in S_N (:mod:`.paired`)."""
    paired_halved: Float[Tensor, "head n"]
    sink_mean: Float[Tensor, "batch head field"]
    votes: Float[Tensor, "head 3"]
    sequence_votes: Int[Tensor, "batch head 3"]
    """Per-sequence vote counts (SPEC §5): the bootstrap of label stability resamples them."""
    bound_mean: Float[Tensor, "batch head kind n bmetric"] | None
    regime: Float[Tensor, "batch head rfield"] | None
    truncation_rows: Float[Tensor, "batch q head n tmetric"]
    """The top-N set's truncation figures (SPEC §10) at every chosen query, NaN where
    undefined: kept per instance, so that their percentiles over all batches are exact."""
    sink_visible: Float[Tensor, " seen_all"] | None = None
    """Chosen (sequence, query) instances whose window holds the sink, and all of them (SPEC §1)."""


def _chunk_plan(layer: LayerBlock, d_values: int) -> list[tuple[int, int, int, int]]:
    """``(b0, b1, g0, g1)`` chunks whose Gram blocks, values and rows fit the budget."""
    batch, n_heads, n_pos = layer.source.shape
    itemsize = torch.empty((), dtype=layer.source.dtype).element_size()
    # The budget is a fraction of what the layer's whole pattern takes (or would take).
    budget = max(MIN_CHUNK_BYTES, int(CHUNK_FRACTION * batch * n_heads * n_pos * n_pos * itemsize))
    gram_bytes = n_pos * n_pos * 8
    per_seq = layer.n_groups * (gram_bytes + n_pos * d_values * 8)
    if layer.source.dtype not in (torch.float32, torch.float64):
        per_seq += n_heads * n_pos * n_pos * 4  # the float32 copy of the rows
    if per_seq <= budget:
        step = max(1, budget // per_seq)
        return [(b, min(batch, b + step), 0, layer.n_groups) for b in range(0, batch, step)]
    g_step = max(1, budget // gram_bytes)
    return [(b, b + 1, g, min(layer.n_groups, g + g_step))
            for b in range(batch) for g in range(0, layer.n_groups, g_step)]


def analyze_layer(
    pattern: Float[Tensor, "batch head query key"] | AttentionRows,
    v: Float[Tensor, "batch pos kv d"],
    is_token: Bool[Tensor, "batch pos"],
    sink: Int[Tensor, " batch"],
    opts: AnalysisOptions,
    *,
    layer: int,
    W_O: Tensor | None = None,
    sequence_offset: int = 0,
    mask_given: bool,
    window: int | None = None,
) -> LayerStats:
    """Validate one layer of one batch and reduce it to :class:`LayerStats` (SPEC §2–6).

    ``pattern`` (a cached ``hook_pattern``, or any :class:`AttentionRows` source) and ``v`` are
    read, never written; ``W_O`` (``[head, d_head, d_model]``) selects output space. Sequence
    ``i`` of the batch is global sequence ``sequence_offset + i`` (the random baseline's stream).
    ``window`` is the layer's sliding window (SPEC §1, ours): query ``t``'s candidate keys are
    the real keys ``t − window < i ≤ t``, and a row with weight outside them is an error.
    """
    backend = choose_backend(pattern.device, opts.backend)
    return run_layer(backend, opts.backend, lambda chosen: _analyze_layer(
        chosen, pattern, v, is_token, sink, opts, layer, W_O, sequence_offset, mask_given, window))


def _analyze_layer(backend: Backend, pattern: Tensor | AttentionRows, v: Tensor, is_token: Tensor, sink: Tensor,
                   opts: AnalysisOptions, layer: int, W_O: Tensor | None, sequence_offset: int, mask_given: bool,
                   window: int | None) -> LayerStats:
    """:func:`analyze_layer` on ``backend``; writes only what it creates (:func:`.backend.run_layer`
    may start it over on the torch twins)."""
    source = PatternRows(pattern, upcast=backend.upcast_rows) if isinstance(pattern, Tensor) else pattern
    data = _layer_block(source, v, is_token.to(source.device), sink.to(source.device), opts, layer, W_O,
                        window)
    rows_out = _RowOutputs.empty(data, len(opts.n_values))
    seq_ids = range(sequence_offset, sequence_offset + source.shape[0])
    keys = torch.from_numpy(sequence_keys(opts.seed, layer, seq_ids).view("int64")).to(source.device)
    d_values = v.shape[-1] if W_O is None else W_O.shape[-1]
    for b0, b1, g0, g1 in _chunk_plan(data, d_values):
        if g0 == 0:  # the first chunk of these sequences: validate and vote, one read of the rows
            values = _check_and_vote(data, b0, b1, rows_out, layer, backend, mask_given=mask_given)
        _score_chunk(data, opts, values, keys, rows_out, b0, b1, g0, g1, backend)
    return _reduce(data, opts, *rows_out, layer, backend)


def _layer_block(source: AttentionRows, v: Tensor, is_token: Tensor, sink: Tensor, opts: AnalysisOptions,
                 layer: int, W_O: Tensor | None, window: int | None = None) -> LayerBlock:
    """The checked :class:`LayerBlock` of one layer: values checked, ``W_O`` matched to the
    cache, the chosen queries (each sequence's last real one, or every position)."""
    checks.check_values(v, is_token, layer)
    batch, n_heads, n_pos = source.shape
    n_groups = n_heads if W_O is not None else v.shape[2]
    if W_O is not None and W_O.shape[:2] != (n_heads, v.shape[-1]):
        raise ValueError(f"W_O of layer {layer} is {tuple(W_O.shape)}; expected [{n_heads}, "
                         f"{v.shape[-1]}, d_model] ([head, d_head, d_model]) to match the cache.")
    if opts.queries == "last":
        queries = last_positions(is_token)[:, None]
    else:
        queries = torch.arange(n_pos, device=source.device).repeat(batch, 1)
    return LayerBlock(source, v, is_token, sink, queries, W_O, n_heads // n_groups, n_groups, window)


class _RowOutputs(NamedTuple):
    """Per-query results of one layer, filled chunk by chunk (NaN where undefined)."""

    metrics: Float[Tensor, "batch head q group n metric"]
    sink_in_top: Bool[Tensor, "batch head q n"]
    sink_fields: Float[Tensor, "batch head q field"]
    votes: Int[Tensor, "batch head 3"]

    @classmethod
    def empty(cls, data: LayerBlock, n_sizes: int) -> _RowOutputs:
        batch, n_heads, _ = data.source.shape
        n_q, device = data.queries.shape[1], data.source.device
        return cls(
            torch.full((batch, n_heads, n_q, len(SEQUENCE_GROUPS), n_sizes, len(METRIC_NAMES)), torch.nan,
                       dtype=COMPUTE_DTYPE, device=device),
            torch.zeros(batch, n_heads, n_q, n_sizes, dtype=torch.bool, device=device),
            torch.full((batch, n_heads, n_q, 5), torch.nan, dtype=COMPUTE_DTYPE, device=device),
            torch.zeros(batch, n_heads, 3, dtype=torch.int64, device=device),
        )


def _check_and_vote(data: LayerBlock, b0: int, b1: int, out: _RowOutputs, layer: int, backend: Backend, *,
                    mask_given: bool) -> Tensor:
    """Validate sequences ``b0:b1`` and count their votes (SPEC §5) in one read of every query's
    rows, or of the queries and keys that recomputed rows come from (:mod:`.key_votes`); returns
    the value groups' vectors ``[b, g, k, d]``."""
    values = group_values(data, b0, b1, data.source.shape[2])
    is_token, sink, norms = data.is_token[b0:b1], data.sink[b0:b1], torch.linalg.vector_norm(values, dim=-1)
    found = None
    if isinstance(data.source, KeyedRows):  # recomputed rows: votes from the logits
        found = key_votes.check_and_vote(data.source.query_keys(b0, b1), is_token, sink, norms,
                                         data.group_size, data.window, backend)
    if found is None:
        found = checks.check_and_vote(data.source.blocks(b0, b1), is_token, sink, norms, data.group_size,
                                      backend, window=data.kernel_window)
    stats, out.votes[b0:b1] = found
    checks.raise_for_stats(stats, layer, b0, mask_given=mask_given, window=data.window)
    return values


def _score_chunk(data: LayerBlock, opts: AnalysisOptions, values: Tensor, keys: Tensor, out: _RowOutputs,
                 b0: int, b1: int, g0: int, g1: int, backend: Backend) -> None:
    """Gram matrices, the sink geometry (SPEC §4) and every selection's scores (SPEC §2–3) of
    sequences ``b0:b1`` and value groups ``g0:g1``, written into ``out``."""
    queries, is_token, sink = data.queries[b0:b1], data.is_token[b0:b1], data.sink[b0:b1]
    n_keys = int(queries.max()) + 1  # keys after the last chosen query are unused
    chunk = values[:, g0:g1, :n_keys]
    h0 = g0 * data.group_size
    gram = backend.gram_and_sink_geometry(chunk, is_token[:, :n_keys], sink, queries, h0, data.group_size,
                                          data.kernel_window, out.sink_fields[b0:b1])
    real_index = is_token.long().cumsum(-1) - 1
    # The scoring reads the vectors too (SPEC §10's output errors): laid out once for every block.
    vectors = backend.score_vectors(data, chunk)
    for q0, q1 in _query_blocks(data.source, queries, n_keys):
        rows, row_of = data.source.rows(b0, b1, queries[:, q0:q1])
        backend.score_rows(
            rows, row_of, h0, data.group_size, g0, queries[:, q0:q1], is_token, sink, data.kernel_window,
            real_index, keys[b0:b1], gram, vectors, opts.n_values.to(gram.device), opts.random_samples,
            opts.shuffle_samples, SHUFFLE_KINDS.index(opts.shuffle), opts.rank_by == "contribution",
            opts.distance == "cosine",
            out.metrics[b0:b1, :, q0:q1], out.sink_in_top[b0:b1, :, q0:q1], out.sink_fields[b0:b1, :, q0:q1])
        del rows
    del gram  # this chunk's Gram matrices go before the next chunk's are made


def _query_blocks(source: AttentionRows, queries: Tensor, n_keys: int) -> list[tuple[int, int]]:
    """Blocks of the chosen queries scored at once: all of them from a cached pattern (its rows
    are read in place), else as many as keep the recomputed rows within :data:`ROW_BLOCK_BYTES`."""
    n_q = queries.shape[1]
    if isinstance(source, PatternRows):
        return [(0, n_q)]
    per_query = queries.shape[0] * source.shape[1] * n_keys * 8
    step = max(1, ROW_BLOCK_BYTES // per_query)
    return [(q0, min(n_q, q0 + step)) for q0 in range(0, n_q, step)]


def _reduce(
    data: LayerBlock, opts: AnalysisOptions, metrics: Tensor, sink_in_top: Tensor, sink_fields: Tensor,
    votes: Tensor, layer: int, backend: Backend,
) -> LayerStats:
    """Per-query rows → per-sequence means, sink-in/out instance sums, paired-sink counts, votes."""
    queries = data.queries
    instances = (queries >= 0) & data.is_token.gather(1, queries.clamp_min(0))  # [b, q]
    sees_sink = data.sees_sink(queries, data.sink) & instances
    reduced = backend.reduce_rows(metrics, sink_in_top, sink_fields, sees_sink)
    bound_mean = regime = None
    if opts.bounds:
        bound_mean, regime = layer_bounds(data, opts, metrics[:, :, :, TOP_GROUP, :, INVERSIONS], layer)
    return LayerStats(
        **reduced._asdict(),
        votes=reduce(votes.to(COMPUTE_DTYPE), "b h vote -> h vote", "sum"),
        sequence_votes=votes,
        bound_mean=bound_mean,
        regime=regime,
        sink_visible=torch.stack([sees_sink.sum(), instances.sum()]).to(COMPUTE_DTYPE),
        truncation_rows=rearrange(metrics[:, :, :, TOP_GROUP, :, TRUNCATION], "b h q n m -> b q h n m"),
    )
