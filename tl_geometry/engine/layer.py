"""Per-layer work: one layer's pattern and values → per-sequence statistics (:class:`LayerStats`).

The layer is processed in chunks of sequences (and, for long contexts, of value groups) so that
no more than a fraction of the pattern's size is held at once (:func:`_chunk_plan`). Per chunk:

1. value vectors of each *value group* — the KV heads in value space (query head ``h`` reads
   group ``h // (n_heads // n_kv)``), the query heads in output space (``v·W_O[h]``);
2. :func:`check_and_vote`: validation and the source-winner votes in one read of the rows;
3. the Gram matrices ``G = V Vᵀ`` of the chunk's groups, rows and columns of bit-identical
   value vectors made identical (exact ties stay exact, SPEC §3);
4. :func:`score_rows`: every selection of every chosen query (SPEC §2–3, §10);
5. the sink geometry (κ, cosines, SPEC §4) from running sums along the keys;

then the per-query rows are reduced over queries (:func:`_reduce`); the top-N set's truncation
figures (SPEC §10) are also handed on per query, for their exact percentiles.

Everything stays on the cache's device. CPU tensors take numba kernels: :mod:`.check_kernel`
(2), :mod:`.gram_kernel` (the ties of 3, and 5), :mod:`.score_kernel` (4), :mod:`.reduce_kernel`
(the reduction). Other devices take their torch twins: :func:`_gram`, :func:`sink_geometry`,
:mod:`.torch_kernels` and :func:`_reduce_torch`. The tests hold each pair to 1e-9.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from einops import einsum, rearrange, reduce
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..functional._types import COMPUTE_DTYPE, COSINE_EPS
from ..functional.heads import first_duplicate, last_positions
from ..functional.separability import METRIC_NAMES, TRUNCATION_NAMES
from . import checks, key_votes, torch_kernels
from .block import AttentionRows, KeyedRows, LayerBlock, PatternRows, group_values
from .bounds import layer_bounds
from .options import SHUFFLE_KINDS, AnalysisOptions
from .paired import N_BINS, paired_counts
from .rng import sequence_keys

#: Groups scored per query, in the order of ``LayerStats.seq_mean`` (SPEC §3).
SEQUENCE_GROUPS = ("top", "random", "shuffled", "sink_removed")
_TOP_GROUP, _SINK_REMOVED = SEQUENCE_GROUPS.index("top"), SEQUENCE_GROUPS.index("sink_removed")
_F_SCORE, _INVERSIONS = METRIC_NAMES.index("f_score"), METRIC_NAMES.index("inversions")
#: The truncation metrics (SPEC §10), contiguous on the metric axis.
_TRUNCATION = slice(METRIC_NAMES.index(TRUNCATION_NAMES[0]), METRIC_NAMES.index(TRUNCATION_NAMES[-1]) + 1)

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
    :data:`SEQUENCE_GROUPS`."""
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


def _use_numba(device: torch.device, backend: str) -> bool:
    if backend == "torch":
        return False
    if device.type != "cpu":
        if backend == "numba":
            raise ValueError(f"backend='numba' runs on CPU tensors; this cache is on {device}. "
                             "Use backend='auto' (torch on this device) or move the cache.")
        return False
    try:
        import numba  # noqa: F401
    except ImportError:  # pragma: no cover - numba is a dependency
        if backend == "numba":
            raise
        return False
    return True


def _gram(values: Float[Tensor, "b g k d"]) -> Float[Tensor, "b g k j"]:
    """``G = V Vᵀ`` with duplicate rows made bit-identical (BLAS may round them apart)."""
    gram = values @ values.transpose(-1, -2)  # b g k j; matmul is markedly faster than einsum here
    dup = first_duplicate(values)
    if not torch.equal(dup, torch.arange(dup.shape[-1], device=dup.device).expand_as(dup)):
        gram = gram.gather(-2, dup[..., :, None].expand(gram.shape))
        gram = gram.gather(-1, dup[..., None, :].expand(gram.shape))
    return gram


def sink_geometry(
    values: Float[Tensor, "b g k d"], is_token: Bool[Tensor, "b k"], sink: Int[Tensor, " b"],
    queries: Int[Tensor, "b q"], sees_sink: Bool[Tensor, "b q"] | None = None,
) -> Float[Tensor, "b g q 3"]:
    """κ, mean cosine to the sink and cosine to the mean, at each query (SPEC §4).

    Over ``J_t`` = real keys ``≤ t`` except the sink: sums over ``J_t`` are prefix sums along the
    keys when most queries are chosen (``O(d)`` per query), and masked sums at the few chosen
    queries otherwise (the last-query protocol reads no other position). NaN where ``J_t`` is
    empty, and where ``sees_sink`` is False: a query whose sliding window starts after the sink
    has no sink (SPEC §1, ours). A query that sees the sink sees every real key up to itself
    (the sink is the first), so ``J_t`` needs no window.
    """
    n_key = values.shape[2]
    keys = torch.arange(n_key, device=values.device)
    others = (is_token & (keys != sink[:, None])).to(COMPUTE_DTYPE)  # [b, k]
    norms = torch.linalg.vector_norm(values, dim=-1)  # [b, g, k]
    index = sink[:, None, None, None].expand(-1, values.shape[1], 1, values.shape[-1])
    v_sink = values.gather(2, index)  # [b, g, 1, d]
    sink_norm = norms.gather(-1, sink[:, None, None].expand(-1, values.shape[1], 1))
    sink_dots = (values @ v_sink.transpose(-1, -2)).squeeze(-1)  # [b, g, k]
    cos = sink_dots / (sink_norm * norms + COSINE_EPS)
    if 4 * queries.shape[1] >= n_key:  # prefix sums, read at the queries
        at = queries.clamp_min(0)[:, None, :].expand(-1, values.shape[1], -1)
        prefix = others[:, None, :]

        def upto(x: Tensor) -> Tensor:  # Σ_{j∈J_t} x_j at every query t, [b, g, q]
            return (x * prefix).cumsum(-1).gather(-1, at)

        total = (values * prefix[..., None]).cumsum(2)
        total = total.gather(2, at[..., None].expand(-1, -1, -1, values.shape[-1]))  # [b, g, q, d]
    else:  # masked sums at the chosen queries only
        weight = ((keys <= queries[..., None]) * others[:, None, :]).to(COMPUTE_DTYPE)  # [b, q, k]

        def upto(x: Tensor) -> Tensor:
            return einsum(x, weight, "b g k, b q k -> b g q")

        total = einsum(weight, values, "b q k, b g k d -> b g q d")
    count = upto(torch.ones_like(norms))
    if sees_sink is not None:
        count = torch.where(sees_sink[:, None, :], count, 0.0)
    fields = torch.stack([
        sink_norm / (upto(norms) / count),
        upto(cos) / count,
        (upto(sink_dots) / count) / (sink_norm * (torch.linalg.vector_norm(total, dim=-1) / count) + COSINE_EPS),
    ], dim=-1)
    return torch.where((count > 0)[..., None], fields, torch.nan)


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
    numba = _use_numba(pattern.device, opts.backend)
    # The kernels read float32 or float64 rows: a half-precision pattern is upcast chunk by chunk.
    source = PatternRows(pattern, upcast=numba) if isinstance(pattern, Tensor) else pattern
    data = _layer_block(source, v, is_token.to(source.device), sink.to(source.device), opts, layer, W_O,
                        window)
    rows_out = _RowOutputs.empty(data, len(opts.n_values))
    seq_ids = range(sequence_offset, sequence_offset + source.shape[0])
    keys = torch.from_numpy(sequence_keys(opts.seed, layer, seq_ids).view("int64")).to(source.device)
    d_values = v.shape[-1] if W_O is None else W_O.shape[-1]
    for b0, b1, g0, g1 in _chunk_plan(data, d_values):
        if g0 == 0:  # the first chunk of these sequences: validate and vote, one read of the rows
            values = _check_and_vote(data, b0, b1, rows_out, layer, numba=numba, mask_given=mask_given)
        _score_chunk(data, opts, values, keys, rows_out, b0, b1, g0, g1, numba=numba)
    return _reduce(data, opts, *rows_out, layer, numba=numba)


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


def _check_and_vote(data: LayerBlock, b0: int, b1: int, out: _RowOutputs, layer: int, *, numba: bool,
                    mask_given: bool) -> Tensor:
    """Validate sequences ``b0:b1`` and count their votes (SPEC §5) in one read of every query's
    rows, or of the queries and keys that recomputed rows come from (:mod:`.key_votes`); returns
    the value groups' vectors ``[b, g, k, d]``."""
    values = group_values(data, b0, b1, data.source.shape[2])
    is_token, sink, norms = data.is_token[b0:b1], data.sink[b0:b1], torch.linalg.vector_norm(values, dim=-1)
    found = None
    if numba and isinstance(data.source, KeyedRows):  # recomputed rows: votes from the logits
        found = key_votes.check_and_vote(data.source.query_keys(b0, b1), is_token, sink, norms,
                                         data.group_size, data.window)
    if found is None:
        found = checks.check_and_vote(data.source.blocks(b0, b1), is_token, sink, norms, data.group_size,
                                      numba=numba, window=data.kernel_window)
    stats, out.votes[b0:b1] = found
    checks.raise_for_stats(stats, layer, b0, mask_given=mask_given, window=data.window)
    return values


def _kernel_vectors(data: LayerBlock, chunk: Float[Tensor, "b g k d"]) -> Float[Tensor, "b g k d"]:
    """The value vectors as the compiled kernel reads them: float32 where every entry is a
    float32 number (values read from a float32 or narrower cache, not mapped by ``W_O``),
    float64 otherwise. The kernel widens each entry exactly before any arithmetic, so its sums
    are the same bit for bit; float32 halves what the outputs and ``s_N`` read per order."""
    if data.W_O is None and data.v.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return chunk.to(torch.float32).contiguous()
    return chunk.contiguous()


def _score_chunk(data: LayerBlock, opts: AnalysisOptions, values: Tensor, keys: Tensor, out: _RowOutputs,
                 b0: int, b1: int, g0: int, g1: int, *, numba: bool) -> None:
    """Gram matrices, every selection's scores (SPEC §2–3) and the sink geometry (SPEC §4) of
    sequences ``b0:b1`` and value groups ``g0:g1``, written into ``out``."""
    queries, is_token, sink = data.queries[b0:b1], data.is_token[b0:b1], data.sink[b0:b1]
    n_keys = int(queries.max()) + 1  # keys after the last chosen query are unused
    chunk = values[:, g0:g1, :n_keys]
    h0, h1 = g0 * data.group_size, g1 * data.group_size
    if numba:
        from .gram_kernel import tie_duplicates_and_sink_geometry
        from .score_kernel import score_rows

        # Our own contiguous tensor: the kernel ties it in place, writing through its view.
        gram = (chunk @ chunk.transpose(-1, -2)).detach().contiguous()
        tie_duplicates_and_sink_geometry(  # type: ignore[call-arg]
            *(_numpy(x) for x in (chunk, is_token[:, :n_keys], sink, queries)),
            gram.numpy(), h0, data.group_size, out.sink_fields[b0:b1].numpy(), data.kernel_window)
    else:
        gram = _gram(chunk)
    real_index = is_token.long().cumsum(-1) - 1
    # The kernel reads the vectors too (SPEC §10's output errors): laid out once for every block.
    vectors = _kernel_vectors(data, chunk) if numba else chunk
    for q0, q1 in _query_blocks(data.source, queries, n_keys):
        rows, row_of = data.source.rows(b0, b1, queries[:, q0:q1])
        args = (rows, row_of, h0, data.group_size, g0, queries[:, q0:q1], is_token, sink, data.kernel_window,
                real_index, keys[b0:b1], gram, vectors, opts.n_values.to(gram.device), opts.random_samples,
                opts.shuffle_samples, SHUFFLE_KINDS.index(opts.shuffle), opts.rank_by == "contribution",
                opts.distance == "cosine")
        outputs = (out.metrics[b0:b1, :, q0:q1], out.sink_in_top[b0:b1, :, q0:q1], out.sink_fields[b0:b1, :, q0:q1])
        if numba:
            score_rows(*(_numpy(x) for x in args), *(x.numpy() for x in outputs))
        else:
            torch_kernels.score_rows(*args, *outputs)
        del rows, args
    if not numba:
        geometry = sink_geometry(chunk, is_token[:, :n_keys], sink, queries, data.sees_sink(queries, sink))
        ok = ((queries >= 0) & is_token.gather(1, queries.clamp_min(0)))[:, None, :, None]
        geometry = torch.where(ok, geometry.repeat_interleave(data.group_size, dim=1), torch.nan)
        out.sink_fields[b0:b1, h0:h1, :, 1:4] = geometry
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


def _numpy(x: Any) -> Any:
    """NumPy view of a CPU tensor, contiguous so that each kernel compiles for one layout."""
    return x.detach().contiguous().numpy() if isinstance(x, Tensor) else x


class _Reduced(NamedTuple):
    """The query-reduced fields of :class:`LayerStats` (every one but the votes and bounds)."""

    seq_mean: Tensor
    inst_sum: Tensor
    inst_count: Tensor
    paired_hist: Tensor
    paired_halved: Tensor
    sink_mean: Tensor


def _reduce_torch(metrics: Tensor, sink_in_top: Tensor, sink_fields: Tensor, sees_sink: Tensor) -> _Reduced:
    """:class:`_Reduced` with torch operations (any device; the twin of :mod:`.reduce_kernel`).
    Instances whose query does not see the sink (``sees_sink [b, q]`` False) are in neither
    sink group."""
    top = metrics[:, :, :, _TOP_GROUP]  # [b, h, q, n, metric]
    defined = torch.isfinite(top[..., 0]) & sees_sink[:, None, :, None]
    groups = torch.stack([sink_in_top & defined, ~sink_in_top & defined], dim=2)  # [b, h, 2, q, n]
    inst_count = reduce(groups.to(COMPUTE_DTYPE), "b h io q n -> h io n", "sum")
    # SPEC §3's metrics and the truncation figures are summed apart, each part laid out as a
    # tensor of its own: torch's reductions may order their sums by the layout, and the first
    # part's sums stay what they were before the truncation figures joined it.
    parts = [metrics[..., : _TRUNCATION.start].contiguous(), metrics[..., _TRUNCATION].contiguous()]
    inst_sum = torch.cat([reduce(torch.where(groups[..., None], part[:, :, None, :, _TOP_GROUP], 0.0),
                                 "b h io q n m -> h io n m", "sum") for part in parts], dim=-1)
    removed = metrics[:, :, :, _SINK_REMOVED, :, _F_SCORE]
    paired_hist, paired_halved = paired_counts(top[..., _F_SCORE], removed, sink_in_top)
    # nanmean: ±inf kept (κ = ∞ is a value), NaN where no query is defined.
    seq_mean = torch.cat([torch.nanmean(part, dim=2) for part in parts], dim=-1)
    return _Reduced(seq_mean, inst_sum, inst_count, paired_hist, paired_halved, torch.nanmean(sink_fields, dim=2))


def _reduce_numba(metrics: Tensor, sink_in_top: Tensor, sink_fields: Tensor, sees_sink: Tensor) -> _Reduced:
    """:class:`_Reduced` from one compiled pass over the rows (CPU)."""
    from .reduce_kernel import reduce_rows

    batch, n_heads, _, n_groups, n_sizes, n_metrics = metrics.shape
    out = _Reduced(
        seq_mean=torch.zeros(batch, n_heads, n_groups, n_sizes, n_metrics, dtype=COMPUTE_DTYPE),
        inst_sum=torch.zeros(n_heads, 2, n_sizes, n_metrics, dtype=COMPUTE_DTYPE),
        inst_count=torch.zeros(n_heads, 2, n_sizes, dtype=COMPUTE_DTYPE),
        paired_hist=torch.zeros(n_heads, n_sizes, N_BINS, dtype=COMPUTE_DTYPE),
        paired_halved=torch.zeros(n_heads, n_sizes, dtype=COMPUTE_DTYPE),
        sink_mean=torch.zeros(batch, n_heads, sink_fields.shape[-1], dtype=COMPUTE_DTYPE),
    )
    reduce_rows(metrics.numpy(), sink_in_top.numpy(), sink_fields.numpy(), sees_sink.contiguous().numpy(),
                _TOP_GROUP, _SINK_REMOVED, _F_SCORE, *(x.numpy() for x in out))
    return out


def _reduce(
    data: LayerBlock, opts: AnalysisOptions, metrics: Tensor, sink_in_top: Tensor, sink_fields: Tensor,
    votes: Tensor, layer: int, *, numba: bool,
) -> LayerStats:
    """Per-query rows → per-sequence means, sink-in/out instance sums, paired-sink counts, votes."""
    queries = data.queries
    instances = (queries >= 0) & data.is_token.gather(1, queries.clamp_min(0))  # [b, q]
    sees_sink = data.sees_sink(queries, data.sink) & instances
    reduced = (_reduce_numba if numba else _reduce_torch)(metrics, sink_in_top, sink_fields, sees_sink)
    bound_mean = regime = None
    if opts.bounds:
        bound_mean, regime = layer_bounds(data, opts, metrics[:, :, :, _TOP_GROUP, :, _INVERSIONS], layer)
    return LayerStats(
        **reduced._asdict(),
        votes=reduce(votes.to(COMPUTE_DTYPE), "b h vote -> h vote", "sum"),
        sequence_votes=votes,
        bound_mean=bound_mean,
        regime=regime,
        sink_visible=torch.stack([sees_sink.sum(), instances.sum()]).to(COMPUTE_DTYPE),
        truncation_rows=rearrange(metrics[:, :, :, _TOP_GROUP, :, _TRUNCATION], "b h q n m -> b q h n m"),
    )
