"""Per-layer work: one layer's pattern and values → per-sequence statistics (:class:`LayerStats`).

The layer is processed in chunks of sequences and value groups (:func:`_chunk_plan`): validation
and votes in one read of the rows (:mod:`.checks`, :mod:`.key_votes`), the sink geometry
(SPEC §4) and every selection's scores (SPEC §2–3, §10), ``⟨v_k, s_N⟩`` from the vectors or a
tied Gram matrix where cheaper (:func:`_uses_gram`); then the rows are reduced over queries
(:func:`_reduce`), all on the layer's :class:`~.backend.Backend`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..functional.dtypes import COMPUTE_DTYPE
from ..functional.heads import last_positions, sink_positions
from ..functional.separability import METRIC_NAMES
from ..functional.sink import SINK_FIELDS
from . import checks, key_votes
from .backend import Backend, choose_backend, run_layer
from .block import AttentionRows, KeyedRows, LayerBlock, PatternRows, group_values
from .bounds import layer_bounds
from .layout import (
    INVERSIONS,
    RANDOM_GROUP,
    SEQUENCE_GROUPS,
    SINK_REMOVED,
    TOP_GROUP,
    TRUNCATION,
    ScoreChunk,
    ScoreOutputs,
    ScoreSettings,
)
from .options import SHUFFLE_KINDS, AnalysisOptions, n_chosen
from .rng import sampled_positions, sequence_keys
from .sink_choice import CANDIDATES, check_reading

#: Bytes of chunk tensors (value vectors, Gram matrices, upcast pattern rows) per byte of pattern.
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
    """Per-sequence counts of the votes that decide the label (SPEC §5; :mod:`.votes`): the
    bootstrap of label stability resamples them."""
    beyond_votes: Int[Tensor, "head 3"]
    """Votes of the queries of a sliding-window layer that cannot see the sink, apart."""
    block_votes: Int[Tensor, "batch block head 3"]
    """The deciding votes per block of 128 consecutive queries (:mod:`.votes`), zero for a
    partial block: the block bootstrap's units."""
    bound_mean: Float[Tensor, "batch head kind n bmetric"] | None
    regime: Float[Tensor, "batch head rfield"] | None
    truncation_rows: Float[Tensor, "batch q head n tmetric"]
    """The top-N set's truncation figures (SPEC §10) at every chosen query, NaN where
    undefined: kept per instance, so that their percentiles over all batches are exact."""
    sink_visible: Float[Tensor, " seen_all_earlier"] | None = None
    """Chosen (sequence, query) instances whose window holds the sink, all of them, and those
    whose sink figures were read at an earlier query, ``t_sink`` (SPEC §1)."""
    votes_rechecked: Int[Tensor, ""] | None = None
    """(query, head) rows whose vote was read from their float64 row because the logits could
    not settle it (:mod:`.key_votes`; 0 where the votes are read from the rows)."""
    random_mc: Float[Tensor, "batch head n metric"] | None = None
    """The Monte Carlo variance of each sequence's random-baseline mean (SPEC §3):
    ``Σ_q s_q²/R / Q²`` over its ``Q`` chosen queries where the baseline is defined, ``s_q²``
    the sample variance of query ``q``'s ``R`` subsets; NaN where undefined or ``R < 2``."""
    window_inout: Float[Tensor, "batch head inout n metric"] | None = None
    """With ``per_window``: each sequence's plain mean of the top-N metrics over its instances
    with the sink inside / outside the set (the pooled ``inst_sum`` split by sequence; NaN where
    it has none); ``None`` without."""
    first_keys: Float[Tensor, "batch head key33"] | None = None
    """The sink check's reading of the given sink (SPEC §1, ours): the mean weight of each of the
    first 32 real keys and of the sink over the queries :func:`.sink_choice.check_reading` names,
    as :func:`.sink_choice.first_keys_mass` gives it, added as the validation read the rows;
    ``None`` where it did not read them (votes from queries and keys)."""


def chosen_queries(opts: AnalysisOptions, is_token: Bool[Tensor, "batch pos"],
                   sequence_offset: int = 0) -> Int[Tensor, "batch q"]:
    """The query positions each sequence is scored at (−1: none), ascending: ``"last"``, every
    position (``"all"``), ``k`` drawn by :func:`.rng.sampled_positions`, or the given positions
    counted from its first real token."""
    batch, n_pos = is_token.shape
    device = is_token.device
    if opts.queries == "last":
        return last_positions(is_token)[:, None]
    if opts.queries == "all":
        return torch.arange(n_pos, device=device).repeat(batch, 1)
    start, n_real = sink_positions(is_token), is_token.sum(-1)
    width = n_chosen(opts.queries, n_pos)
    out = torch.full((batch, width), -1, dtype=torch.long)
    for b in range(batch):
        real = int(n_real[b])
        if isinstance(opts.queries, int):
            picked = torch.from_numpy(sampled_positions(opts.seed, sequence_offset + b, real, opts.queries))
        else:
            picked = torch.tensor([p for p in opts.queries if p < real], dtype=torch.long)
        out[b, :len(picked)] = picked + int(start[b])
    return out.to(device)


#: The largest Gram matrix a value group may get (float64 bytes): beyond it (about 11,600
#: positions) the inner products come from the vectors, whatever the queries.
GRAM_MAX_BYTES = 1 << 30


def _uses_gram(layer: LayerBlock, opts: AnalysisOptions, d_values: int) -> bool:
    """Whether the inner products ``⟨v_k, s_N⟩`` come from Gram matrices (ours): where the matrix
    fits :data:`GRAM_MAX_BYTES` and costs fewer multiply-adds: ``T²·d`` to build (``3·T·w·d`` for
    a window's band) plus ``r·max N·k`` to read, against ``r·|grid|·k·d`` from the vectors, with
    ``r`` scored rows (heads × queries × orders) and ``k`` the keys a query sees."""
    n_pos = layer.source.shape[2]
    fits = [n for n in opts.n_values.tolist() if n < n_pos]  # a list: called twice per layer
    if not fits or n_pos * n_pos * 8 > GRAM_MAX_BYTES:
        return False
    rows = layer.group_size * layer.queries.shape[1] * (2 + opts.random_samples + opts.shuffle_samples)
    keys = n_pos if layer.window is None else min(n_pos, layer.window)  # keys a query sees
    # A sliding window's matrix is built on its band alone (twins.geometry.band_gram).
    built = n_pos if layer.window is None or layer.window >= n_pos else min(n_pos, 3 * layer.window)
    from_gram = n_pos * built * d_values + rows * max(fits) * keys
    from_vectors = rows * len(fits) * keys * d_values
    return from_gram < from_vectors


def _chunk_plan(layer: LayerBlock, opts: AnalysisOptions, d_values: int) -> list[tuple[int, int, int, int]]:
    """``(b0, b1, g0, g1)`` chunks whose value vectors, Gram matrices (where read) and rows fit
    the budget."""
    batch, n_heads, n_pos = layer.source.shape
    itemsize = torch.empty((), dtype=layer.source.dtype).element_size()
    # The budget is a fraction of what the layer's whole pattern takes (or would take).
    budget = max(MIN_CHUNK_BYTES, int(CHUNK_FRACTION * batch * n_heads * n_pos * n_pos * itemsize))
    group_bytes = n_pos * d_values * 8 + (n_pos * n_pos * 8 if _uses_gram(layer, opts, d_values) else 0)
    per_seq = layer.n_groups * group_bytes
    if layer.source.dtype not in (torch.float32, torch.float64):
        per_seq += n_heads * n_pos * n_pos * 4  # the float32 copy of the rows
    if per_seq <= budget:
        step = max(1, budget // per_seq)
        return [(b, min(batch, b + step), 0, layer.n_groups) for b in range(0, batch, step)]
    g_step = max(1, budget // group_bytes)
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

    ``pattern`` (a cached ``hook_pattern`` or any :class:`AttentionRows`) and ``v`` are never
    written; ``sink`` is each sequence's sink (SPEC §1); ``W_O`` (``[head, d_head, d_model]``)
    selects output space; sequence ``i`` is global sequence ``sequence_offset + i`` (the random
    stream); ``window`` is the layer's sliding window (SPEC §1, ours). Runs under
    ``torch.inference_mode``.
    """
    backend = choose_backend(pattern.device, opts.backend)
    # Nothing here is differentiated: inference mode spares every op autograd's bookkeeping.
    with torch.inference_mode():
        return run_layer(backend, opts.backend, lambda chosen: _analyze_layer(
            chosen, pattern, v, is_token, sink, opts, layer, W_O, sequence_offset, mask_given, window))


def _analyze_layer(backend: Backend, pattern: Tensor | AttentionRows, v: Tensor, is_token: Tensor, sink: Tensor,
                   opts: AnalysisOptions, layer: int, W_O: Tensor | None, sequence_offset: int, mask_given: bool,
                   window: int | None) -> LayerStats:
    """:func:`analyze_layer` on ``backend``; writes only what it creates (it may start over)."""
    source = PatternRows(pattern, upcast=backend.upcast_rows) if isinstance(pattern, Tensor) else pattern
    data = _layer_block(source, v, is_token.to(source.device), sink.to(source.device), opts, layer, W_O,
                        window, sequence_offset)
    rows_out = _RowOutputs.empty(data, len(opts.n_values))
    seq_ids = range(sequence_offset, sequence_offset + source.shape[0])
    keys = torch.from_numpy(sequence_keys(opts.seed, layer, seq_ids).view("int64")).to(source.device)
    d_values = v.shape[-1] if W_O is None else W_O.shape[-1]
    first_keys: Tensor | None = torch.full((*source.shape[:2], CANDIDATES + 1), torch.nan, dtype=COMPUTE_DTYPE,
                                           device=source.device)
    for b0, b1, g0, g1 in _chunk_plan(data, opts, d_values):
        if g0 == 0:  # the first chunk of these sequences: validate and vote, one read of the rows
            values, checked = _check_and_vote(data, b0, b1, rows_out, layer, backend, mask_given=mask_given)
            if first_keys is not None and checked is not None:
                first_keys[b0:b1] = checked
            else:
                first_keys = None
        _score_chunk(data, opts, values, keys, rows_out, b0, b1, g0, g1, backend)
    stats = _reduce(data, opts, *rows_out, layer, backend)._replace(first_keys=first_keys)
    at_sink = _sink_reading(data, opts)
    if at_sink is None:
        return stats
    # Only the sink-dependent figures are read there: no baseline, null or bound is needed.
    plain = replace(opts, random_samples=0, shuffle_samples=0, bounds=False)
    sink_out = _RowOutputs.empty(at_sink, len(opts.n_values))
    for b0, b1, g0, g1 in _chunk_plan(at_sink, plain, d_values):
        if g0 == 0:
            values = group_values(at_sink, b0, b1, at_sink.source.shape[2])
        _score_chunk(at_sink, plain, values, keys, sink_out, b0, b1, g0, g1, backend)
    instances = at_sink.queries >= 0
    sees = at_sink.sees_sink(at_sink.queries, at_sink.sink) & instances
    read = backend.reduce_rows(sink_out.metrics, sink_out.sink_in_top, sink_out.sink_fields, sees)
    inout = _window_inout(sink_out.metrics, sink_out.sink_in_top, sees) if opts.per_window else None
    return _with_sink_reading(stats, read, int(instances.sum()), inout)


def _sink_reading(data: LayerBlock, opts: AnalysisOptions) -> LayerBlock | None:
    """SPEC §1's sink-visible reading (ours): ``data`` with the queries ``t_sink = p + w − 1``
    where the last query cannot see the sink (−1 elsewhere), or ``None`` where none needs it."""
    if opts.queries != "last" or data.window is None:
        return None
    last = data.queries[:, 0]
    t_sink = torch.minimum(last, data.sink + data.window - 1)
    earlier = (t_sink < last) & (last >= 0)
    if not bool(earlier.any()):
        return None
    return data._replace(queries=torch.where(earlier, t_sink, -1)[:, None])


def _with_sink_reading(stats: LayerStats, read: Any, n_read: int, inout: Tensor | None = None) -> LayerStats:
    """``stats`` with the sink-dependent figures taken from ``read`` (the :class:`.layout.Reduced`
    at ``t_sink``) and ``inout`` where ``stats`` has none: per sequence one of them defines them."""
    def either(main: Tensor, other: Tensor) -> Tensor:
        return torch.where(torch.isnan(main), other.to(main.device), main)

    seq_mean = stats.seq_mean.clone()
    seq_mean[:, :, SINK_REMOVED] = either(stats.seq_mean[:, :, SINK_REMOVED], read.seq_mean[:, :, SINK_REMOVED])
    visible = stats.sink_visible.clone() if stats.sink_visible is not None else None
    if visible is not None:
        visible[2] += n_read
    return stats._replace(
        seq_mean=seq_mean,
        inst_sum=stats.inst_sum + read.inst_sum, inst_count=stats.inst_count + read.inst_count,
        paired_hist=stats.paired_hist + read.paired_hist, paired_halved=stats.paired_halved + read.paired_halved,
        sink_mean=either(stats.sink_mean, read.sink_mean), sink_visible=visible,
        window_inout=either(stats.window_inout, inout) if stats.window_inout is not None and inout is not None
        else stats.window_inout)


def _layer_block(source: AttentionRows, v: Tensor, is_token: Tensor, sink: Tensor, opts: AnalysisOptions,
                 layer: int, W_O: Tensor | None, window: int | None = None, sequence_offset: int = 0) -> LayerBlock:
    """The checked :class:`LayerBlock` of one layer, with its chosen queries."""
    checks.check_values(v, is_token, layer)
    n_heads = source.shape[1]
    n_groups = n_heads if W_O is not None else v.shape[2]
    if W_O is not None and W_O.shape[:2] != (n_heads, v.shape[-1]):
        raise ValueError(f"W_O of layer {layer} is {tuple(W_O.shape)}; expected [{n_heads}, "
                         f"{v.shape[-1]}, d_model] ([head, d_head, d_model]) to match the cache.")
    queries = chosen_queries(opts, is_token, sequence_offset)
    start = sink_positions(is_token)
    if bool((sink < start).any()) or bool((sink > last_positions(is_token)).any()):
        raise ValueError(f"Layer {layer}: the sink must be a real position of its sequence (from its first "
                         "to its last real token), one per sequence.")
    return LayerBlock(source, v, is_token, sink, queries, W_O, n_heads // n_groups, n_groups, window, start)


class _RowOutputs(NamedTuple):
    """Per-query results of one layer, filled chunk by chunk (NaN where undefined)."""

    metrics: Float[Tensor, "batch head q group n metric"]
    sink_in_top: Bool[Tensor, "batch head q n"]
    sink_fields: Float[Tensor, "batch head q field"]
    vote_of: Int[Tensor, "batch head pos"]
    rechecked: Int[Tensor, ""]
    random_var: Float[Tensor, "batch head q n metric"]
    """The Monte Carlo variance of each row's random-baseline mean, ``s²/R``."""

    @classmethod
    def empty(cls, data: LayerBlock, n_sizes: int) -> _RowOutputs:
        batch, n_heads, n_pos = data.source.shape
        rows, device = (batch, n_heads, data.queries.shape[1]), data.source.device
        metrics = (n_sizes, len(METRIC_NAMES))

        def nan(*shape: int) -> Tensor:
            return torch.full(shape, torch.nan, dtype=COMPUTE_DTYPE, device=device)

        return cls(nan(*rows, len(SEQUENCE_GROUPS), *metrics),
                   torch.zeros(*rows, n_sizes, dtype=torch.bool, device=device),
                   nan(*rows, len(SINK_FIELDS)),
                   torch.full((batch, n_heads, n_pos), -1, dtype=torch.int8, device=device),
                   torch.zeros((), dtype=torch.int64), nan(*rows, *metrics))


def _check_and_vote(data: LayerBlock, b0: int, b1: int, out: _RowOutputs, layer: int, backend: Backend, *,
                    mask_given: bool) -> tuple[Tensor, Tensor | None]:
    """Validate sequences ``b0:b1`` and write their votes (SPEC §5); returns the value groups'
    vectors ``[b, g, k, d]`` and, where the rows were read, :attr:`LayerStats.first_keys`."""
    values = group_values(data, b0, b1, data.source.shape[2])
    is_token, sink, norms = data.is_token[b0:b1], data.sink[b0:b1], torch.linalg.vector_norm(values, dim=-1)
    found = None
    # Recomputed rows: votes from the logits (a cached pattern is never keyed: no Protocol check).
    if not isinstance(data.source, PatternRows) and isinstance(data.source, KeyedRows):
        found = key_votes.check_and_vote(data.source.query_keys(b0, b1), is_token, sink, norms,
                                         data.group_size, data.window, backend)
    read = None
    if found is None:
        start, first, stop = check_reading(is_token, data.window, sink)
        stats, vote_of, sums = checks.check_and_vote(data.source.blocks(b0, b1), is_token, sink, norms,
                                                     data.group_size, backend, window=data.kernel_window,
                                                     reading=(start, first, stop))
        found = stats, vote_of, 0
        read = sums / (stop - first).clamp_min(0)[:, None, None]  # 0/0 = NaN: no query to read
    stats, out.vote_of[b0:b1], rechecked = found
    out.rechecked.add_(rechecked)
    checks.raise_for_stats(stats, layer, b0, mask_given=mask_given, window=data.window)
    return values, read


def _score_chunk(data: LayerBlock, opts: AnalysisOptions, values: Tensor, keys: Tensor, out: _RowOutputs,
                 b0: int, b1: int, g0: int, g1: int, backend: Backend) -> None:
    """The sink geometry (SPEC §4) and every selection's scores (SPEC §2–3) of sequences
    ``b0:b1`` and value groups ``g0:g1``, written into ``out``."""
    queries, is_token, sink, start = data.queries[b0:b1], data.is_token[b0:b1], data.sink[b0:b1], data.start[b0:b1]
    if int(queries.max()) < 0:  # no chosen query in these sequences (e.g. the t_sink pass): nothing to score
        return
    # Keys after the last chosen query are unused, but the sink's geometry reads the sink's
    # value wherever it is (a given sink may come after every chosen query).
    n_keys = max(int(queries.max()), int(sink.max())) + 1
    chunk = values[:, g0:g1, :n_keys]
    h0 = g0 * data.group_size
    backend.sink_geometry(chunk, is_token[:, :n_keys], sink, queries, h0, data.group_size, data.kernel_window,
                          out.sink_fields[b0:b1])
    gram = (backend.gram(chunk, data.kernel_window) if _uses_gram(data, opts, chunk.shape[-1])
            else chunk.new_empty(0, 0, 0, 0))
    real_index = is_token.long().cumsum(-1) - 1
    vectors = backend.score_vectors(data, chunk)  # laid out once for every block of queries
    settings = ScoreSettings(opts.n_values.to(vectors.device), opts.random_samples, opts.shuffle_samples,
                             SHUFFLE_KINDS.index(opts.shuffle), opts.rank_by == "contribution",
                             opts.distance == "cosine")
    for q0, q1 in _query_blocks(data.source, queries, n_keys):
        rows, row_of = data.source.rows(b0, b1, queries[:, q0:q1])
        backend.score_rows(
            ScoreChunk(rows, row_of, h0, data.group_size, g0, queries[:, q0:q1], is_token, start, sink,
                       data.kernel_window, real_index, keys[b0:b1], gram, vectors),
            settings,
            ScoreOutputs(out.metrics[b0:b1, :, q0:q1], out.sink_in_top[b0:b1, :, q0:q1],
                         out.sink_fields[b0:b1, :, q0:q1], out.random_var[b0:b1, :, q0:q1]))
        del rows
    del gram  # this chunk's Gram matrices go before the next chunk's are made


def _query_blocks(source: AttentionRows, queries: Tensor, n_keys: int) -> list[tuple[int, int]]:
    """Blocks of chosen queries scored at once: all from a pattern, else :data:`ROW_BLOCK_BYTES`."""
    n_q = queries.shape[1]
    if isinstance(source, PatternRows):
        return [(0, n_q)]
    per_query = queries.shape[0] * source.shape[1] * n_keys * 8
    step = max(1, ROW_BLOCK_BYTES // per_query)
    return [(q0, min(n_q, q0 + step)) for q0 in range(0, n_q, step)]


def _reduce(
    data: LayerBlock, opts: AnalysisOptions, metrics: Tensor, sink_in_top: Tensor, sink_fields: Tensor,
    vote_of: Tensor, rechecked: Tensor, random_var: Tensor, layer: int, backend: Backend,
) -> LayerStats:
    """Per-query rows → per-sequence means, sink-in/out instance sums, paired-sink counts, votes."""
    queries = data.queries
    instances = (queries >= 0) & data.is_token.gather(1, queries.clamp_min(0))  # [b, q]
    sees_sink = data.sees_sink(queries, data.sink) & instances
    reduced = backend.reduce_rows(metrics, sink_in_top, sink_fields, sees_sink)
    bound_mean = regime = None
    if opts.bounds:
        bound_mean, regime = layer_bounds(data, opts, metrics[:, :, :, TOP_GROUP, :, INVERSIONS], layer)
    counted = backend.tally(vote_of, data.is_token, data.start, data.sink, data.kernel_window)
    # Each sequence's Monte Carlo variance of its random-baseline mean: Σ_q Var(row mean) / Q².
    defined = ~torch.isnan(metrics[:, :, :, RANDOM_GROUP])
    n_rows = defined.sum(2).to(random_var.dtype)
    random_mc = torch.where(defined, random_var, 0.0).sum(2) / n_rows.square()
    return LayerStats(
        **reduced._asdict(), votes=counted.deciding.to(COMPUTE_DTYPE).sum(0),  # b h vote -> h vote
        sequence_votes=counted.deciding, beyond_votes=counted.beyond.sum(0),
        block_votes=counted.blocks, bound_mean=bound_mean, regime=regime,
        sink_visible=torch.stack([sees_sink.sum(), instances.sum(), torch.zeros_like(instances.sum())]
                                 ).to(COMPUTE_DTYPE),
        # A copy: a view would keep every per-query row of the layer alive while the stats are held.
        truncation_rows=rearrange(metrics[:, :, :, TOP_GROUP, :, TRUNCATION], "b h q n m -> b q h n m").contiguous(),
        votes_rechecked=rechecked,
        random_mc=random_mc,
        window_inout=_window_inout(metrics, sink_in_top, sees_sink) if opts.per_window else None,
    )


def _window_inout(metrics: Float[Tensor, "batch head q group n metric"], sink_in_top: Bool[Tensor, "batch head q n"],
                  sees_sink: Bool[Tensor, "batch q"]) -> Float[Tensor, "batch head inout n metric"]:
    """Each sequence's mean top-N metrics over its instances with the sink inside / outside the
    set (N defined, sink visible); NaN where it has none."""
    top = metrics[:, :, :, TOP_GROUP]  # [b, h, q, n, metric]
    defined = torch.isfinite(top[..., 0]) & sees_sink[:, None, :, None]
    means = []
    for inside in (sink_in_top & defined, ~sink_in_top & defined):  # one group at a time: less memory
        total = torch.where(inside[..., None], top, 0.0).sum(2)
        means.append(total / inside.sum(2).to(total.dtype)[..., None])  # 0 / 0 = NaN: no instance
    return torch.stack(means, dim=2)
