"""Mergeable sums and counts of one analysis, and the finish step that makes a HeadAnalysis.

Averaging (SPEC §8; the grouping is ours): the top-N, random, shuffled and sink-removed groups
are averaged over each sequence's chosen queries, then over sequences (the baselines over their
permutations first); the sink-in / sink-out groups pool every (sequence, query) instance by
whether the sink is in the top-N set, and the paired effect pools their ratios (:mod:`.paired`).
Votes are pooled counts, also kept per sequence for the label stability (SPEC §5). The 90th
percentiles of SPEC §10 cannot be merged from sums, so the per-instance values are kept per
sequence and the exact nearest-rank percentile is taken in :meth:`Accumulator.finish` (ours).
Every field adds, so batches, streams and processes merge by addition (determinism:
docs/scale.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor

from ..functional.dtypes import COMPUTE_DTYPE
from ..functional.regime import REGIME_FIELDS
from ..functional.separability import METRIC_NAMES, TRUNCATION_NAMES
from ..functional.sink import SINK_FIELDS
from ..functional.stats import nearest_rank_percentile
from ..result import BOUND_KINDS, BOUND_METRICS, PERCENTILE, HeadAnalysis
from ..result.schema import WINDOW_GROUPS
from .layer import LayerStats
from .layout import RANDOM_GROUP, SEQUENCE_GROUPS
from .options import AnalysisOptions
from .paired import N_BINS, paired_figures

#: Where the groups of a layer's per-sequence means (``SEQUENCE_GROUPS``) and of its sink-in /
#: sink-out means sit on the per-window arrays' group axis (``WINDOW_GROUPS``).
_SEQUENCE_SLOTS = slice(0, len(SEQUENCE_GROUPS))
_INOUT_SLOTS = slice(len(SEQUENCE_GROUPS), len(SEQUENCE_GROUPS) + 2)
if (*SEQUENCE_GROUPS, "sink_in", "sink_out") != WINDOW_GROUPS:  # pragma: no cover - a layout error
    raise ImportError(f"WINDOW_GROUPS {WINDOW_GROUPS} must be SEQUENCE_GROUPS {SEQUENCE_GROUPS} "
                      "followed by sink_in, sink_out.")


@dataclass
class Accumulator:
    """Sums and counts ``[layer, head, ...]`` of one analysis; ``merge`` adds two."""

    seq_sum: Float[Tensor, "layer head group n metric"]
    seq_count: Float[Tensor, "layer head group n metric"]
    inst_sum: Float[Tensor, "layer head inout n metric"]
    inst_count: Float[Tensor, "layer head inout n"]
    paired_hist: Float[Tensor, "layer head n bin"]
    paired_halved: Float[Tensor, "layer head n"]
    sink_sum: Float[Tensor, "layer head field"]
    sink_count: Float[Tensor, "layer head field"]
    votes: Float[Tensor, "layer head vote"]
    bound_sum: Float[Tensor, "layer head kind n bmetric"]
    bound_count: Float[Tensor, "layer head kind n bmetric"]
    regime_sum: Float[Tensor, "layer head rfield"]
    regime_count: Float[Tensor, "layer head rfield"]
    sequence_votes: Int[Tensor, "sequence layer head vote"]
    """Vote counts of every sequence, row = the sequence's index in the inputs."""
    sink_visible: Float[Tensor, "layer 3"]
    """Chosen (sequence, query) instances whose sliding window holds the sink, all of them, and
    those whose sink figures were read at the last query that sees the sink instead (SPEC §1):
    the first two are equal on a layer without a window."""
    truncation_rows: Float[Tensor, "sequence q layer head n tmetric"]
    """The top-N set's τ_N and relative truncation error at each chosen query of every sequence
    (row = the sequence's index; NaN where undefined), for the exact percentiles (SPEC §10)."""
    beyond_votes: Int[Tensor, "layer head vote"]
    """Votes of sliding-window queries that cannot see the sink, apart (SPEC §5)."""
    block_votes: Int[Tensor, "sequence block layer head vote"]
    """Deciding votes per block of 128 queries of every sequence (:mod:`.votes`)."""
    window_scores: Float[Tensor, "sequence layer head group n metric"]
    """With ``per_window``: each sequence's means over its chosen queries, groups
    ``WINDOW_GROUPS`` (SPEC §8's per-window arrays; NaN where undefined); without, a tensor with
    no layer (nothing is kept)."""
    window_sink: Float[Tensor, "sequence layer head field"]
    """With ``per_window``: each sequence's sink diagnostics (SPEC §4), as ``window_scores``."""
    window_bounds: Float[Tensor, "sequence layer head kind n bmetric"]
    """With ``per_window`` and bounds: each sequence's mean bounds, as ``window_scores``."""
    votes_rechecked: Int[Tensor, " layer"]
    """Rows whose vote was read from their float64 row (the logits could not settle it)."""
    random_sq: Float[Tensor, "layer head n metric"]
    """Σ over sequences of the square of each sequence's random-baseline mean (for its
    standard error over sequences, SPEC §3)."""
    random_mc: Float[Tensor, "layer head n metric"]
    """Σ over sequences of the Monte Carlo variance of each sequence's random-baseline mean
    (:attr:`.layer.LayerStats.random_mc`)."""

    @classmethod
    def zeros(cls, n_layers: int, n_heads: int, n_sizes: int, device: Any = "cpu",
              n_sequences: int = 0, n_queries: int = 0, n_blocks: int = 0, per_window: bool = False) -> Accumulator:
        """Empty sums for ``n_sequences`` sequences (grown as batches need), ``n_queries`` chosen
        queries and ``n_blocks`` vote blocks each (0: set by the first batch; processes that
        all-reduce must pass all three); ``per_window`` keeps each sequence's own means."""

        def zeros(*shape: int, dtype: torch.dtype = COMPUTE_DTYPE) -> Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        metric, sink = (n_sizes, len(METRIC_NAMES)), (len(SINK_FIELDS),)
        regime, group = (len(REGIME_FIELDS),), (len(SEQUENCE_GROUPS), *metric)
        bound = (len(BOUND_KINDS), n_sizes, len(BOUND_METRICS))
        shapes = {"seq_sum": group, "seq_count": group, "inst_sum": (2, *metric),
                  "inst_count": (2, n_sizes), "paired_hist": (n_sizes, N_BINS),
                  "paired_halved": (n_sizes,), "sink_sum": sink, "sink_count": sink, "votes": (3,),
                  "bound_sum": bound, "bound_count": bound, "regime_sum": regime,
                  "regime_count": regime, "random_sq": metric, "random_mc": metric}
        sums = {name: zeros(n_layers, n_heads, *shape) for name, shape in shapes.items()}
        kept = n_layers if per_window else 0  # no layer: nothing is kept, whatever the rows

        def window(*shape: int) -> Tensor:
            return zeros(n_sequences, kept, n_heads, *shape, dtype=torch.float32)

        counts = torch.int64  # exact counts that all_reduce can add like the sums
        rows = (n_sequences, n_queries, n_layers, n_heads, n_sizes, len(TRUNCATION_NAMES))
        return cls(**sums, sequence_votes=zeros(n_sequences, n_layers, n_heads, 3, dtype=counts),
                   sink_visible=zeros(n_layers, 3), truncation_rows=zeros(*rows),
                   beyond_votes=zeros(n_layers, n_heads, 3, dtype=counts),
                   block_votes=zeros(n_sequences, n_blocks, n_layers, n_heads, 3, dtype=counts),
                   window_scores=window(len(WINDOW_GROUPS), *metric), window_sink=window(*sink),
                   window_bounds=window(*bound),
                   votes_rechecked=zeros(n_layers, dtype=counts))

    def tensors(self) -> Iterator[Tensor]:
        """Every sum and count, in field order (for all-reduce across processes)."""
        return (getattr(self, f.name) for f in fields(self))

    def all_reduce(self, group: Any = None) -> Accumulator:
        """Sum this accumulator over the processes of ``group`` (``torch.distributed``) in
        place, so that each rank holds the whole run's state; returns ``self``."""
        import torch.distributed as dist

        for tensor in self.tensors():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return self

    def merge(self, other: Accumulator) -> Accumulator:
        """Sum of two accumulators (their per-sequence rows padded to the same number)."""
        n = max(len(self.sequence_votes), len(other.sequence_votes))
        q = max(self.truncation_rows.shape[1], other.truncation_rows.shape[1]) or None
        k = max(self.block_votes.shape[1], other.block_votes.shape[1]) or None
        return Accumulator(*(a + b for a, b in zip(self._rows(n, q, k).tensors(), other._rows(n, q, k).tensors())))

    def _rows(self, n: int, n_queries: int | None = None, n_blocks: int | None = None) -> Accumulator:
        """This accumulator with at least ``n`` per-sequence rows (new rows hold no votes), and
        ``n_queries`` chosen queries and ``n_blocks`` vote blocks per row where it had none yet."""
        grown = {name: getattr(self, name) for name in _PER_SEQUENCE}
        if (min(len(x) for x in grown.values()) >= n
                and n_queries in (None, self.truncation_rows.shape[1])
                and n_blocks in (None, self.block_votes.shape[1])):
            return self  # every layer after a batch's first: nothing to grow
        for name, size, what in (
                ("truncation_rows", n_queries, "chosen queries per sequence, the earlier ones {}: "
                 "one analysis chooses its queries one way."),
                ("block_votes", n_blocks, "vote blocks per sequence, the earlier ones {}: the "
                 "batches of one analysis have one length.")):
            x = grown[name]
            if size is not None and x.shape[1] != size:
                if x.shape[1]:
                    raise ValueError(f"a batch has {size} " + what.format(x.shape[1]))
                grown[name] = x.new_zeros(x.shape[0], size, *x.shape[2:])
        for name, x in grown.items():
            if len(x) < n:
                grown[name] = torch.cat([x, x.new_zeros(n - len(x), *x.shape[1:])])
        return replace(self, **grown)

    def add(self, li: int, stats: LayerStats, sequence_offset: int = 0) -> None:
        """Add one layer (row ``li``) of one batch whose first sequence is number ``sequence_offset``."""
        self.add_layers(range(li, li + 1), [stats], sequence_offset)

    def add_layers(self, rows: range, stats: Sequence[LayerStats], sequence_offset: int = 0) -> None:
        """Add consecutive layers (rows ``rows``) of one batch, one operation per statistic: bit
        for bit the sums of adding them one by one (each layer's sum over sequences is its own)."""
        if not stats:
            return
        li = slice(rows.start, rows.stop)
        seq_mean = _stack([s.seq_mean for s in stats]).to(self.seq_sum.device)  # [layer, b, h, g, n, m]
        sink_mean = _stack([s.sink_mean for s in stats]).to(self.sink_sum.device)
        bound_mean, regime = _stack_field(stats, "bound_mean"), _stack_field(stats, "regime")
        _add_means(self.seq_sum[li], self.seq_count[li], seq_mean)
        for name in _ADDED:  # statistics that add as they are into their layers' rows
            value = _stack_field(stats, name)
            if value is not None:
                total = getattr(self, name)[li]
                total.add_(value.to(total.device, total.dtype))
        _add_means(self.sink_sum[li], self.sink_count[li], sink_mean)
        first = stats[0]
        stop = sequence_offset + first.sequence_votes.shape[0]
        grown = self._rows(stop, first.truncation_rows.shape[1], first.block_votes.shape[1])
        if grown is not self:
            for name in _PER_SEQUENCE:
                setattr(self, name, getattr(grown, name))
        sequences = slice(sequence_offset, stop)
        if self.window_scores.shape[1]:  # per_window: one batch writes each sequence's rows
            scores = self.window_scores[sequences, li]  # [b, layer, h, group, n, m]
            scores[:, :, :, _SEQUENCE_SLOTS] = seq_mean.transpose(0, 1).to(scores)
            inout = _stack_field(stats, "window_inout")
            scores[:, :, :, _INOUT_SLOTS] = inout.transpose(0, 1).to(scores) if inout is not None else torch.nan
            self.window_sink[sequences, li] = sink_mean.transpose(0, 1).to(self.window_sink)
            if bound_mean is not None:
                self.window_bounds[sequences, li] = bound_mean.transpose(0, 1).to(self.window_bounds)
        for total, name, axes in ((self.sequence_votes[sequences, li], "sequence_votes", "l b h v -> b l h v"),
                                  (self.block_votes[sequences, :, li], "block_votes", "l b k h v -> b k l h v"),
                                  (self.truncation_rows[sequences, :, li], "truncation_rows",
                                   "l b q h n m -> b q l h n m")):
            total.add_(rearrange(_stack([getattr(s, name) for s in stats]), axes).to(total.device))
        if bound_mean is not None:
            _add_means(self.bound_sum[li], self.bound_count[li], bound_mean.to(self.bound_sum.device))
        if regime is not None:
            _add_means(self.regime_sum[li], self.regime_count[li], regime.to(self.regime_sum.device))
        random = seq_mean[:, :, :, RANDOM_GROUP]  # [layer, b, h, n, m]
        defined = ~torch.isnan(random)
        self.random_sq[li].add_(torch.where(defined, random.square(), 0.0).sum(1))
        random_mc = _stack_field(stats, "random_mc")
        if random_mc is not None:
            self.random_mc[li].add_(torch.where(defined, random_mc.to(random.device), 0.0).sum(1))

    def finish(
        self, layers: Sequence[int], opts: AnalysisOptions, n_pos: int, metadata: dict[str, Any],
        windows: Sequence[int | None] | None = None,
    ) -> HeadAnalysis:
        """Means from sums (0/0 → NaN where nothing was defined) as a :class:`HeadAnalysis`;
        ``windows`` (``None``: global layers) and the per-layer counts of :attr:`sink_visible` and
        :attr:`votes_rechecked` go into the metadata (SPEC §1)."""
        too_big = [int(n) for n in opts.n_values if n >= n_pos]
        if too_big:
            warnings.warn(f"N = {too_big} cannot be evaluated on {n_pos}-position sequences (N "
                          "must be below the number of keys); their metrics are NaN.", stacklevel=3)
        windows = tuple(windows) if windows is not None else (None,) * len(layers)
        narrow = [w for w in windows if w is not None and w < n_pos]
        beyond = [int(n) for n in opts.n_values if narrow and min(narrow) <= n < n_pos]
        if beyond:
            warnings.warn(f"N = {beyond} do not fit the sliding window of {min(narrow)} keys (N "
                          "must be below the number of keys a query sees); their metrics are NaN "
                          "on the windowed layers.", stacklevel=3)
        visible = zip(("sink_visible", "instances", "sink_read_earlier"), self.sink_visible.cpu().T)
        metadata = {**metadata, "window": list(windows), **{name: _ints(x) for name, x in visible},
                    "votes_rechecked": _ints(self.votes_rechecked.cpu())}
        seq_mean = self.seq_sum / self.seq_count
        inst_mean = self.inst_sum / self.inst_count[..., None]
        instances = rearrange(self.truncation_rows, "s q l h n m -> (s q) m l h n")
        scores = torch.cat([seq_mean, inst_mean], dim=2)  # groups: SEQUENCE_GROUPS + (in, out)
        counts = torch.cat([self.seq_count[..., 0], self.inst_count], dim=2)
        kept = bool(self.window_scores.shape[1])  # per_window
        return HeadAnalysis(
            layers=tuple(layers),
            n_values=opts.n_values.clone(),
            scores=_cpu(scores, "l h g n m -> g m l h n"),
            group_counts=_cpu(counts, "l h g n -> g l h n"),
            sink=_cpu(self.sink_sum / self.sink_count, "l h f -> f l h"),
            vote_counts=self.votes.cpu().clone(),
            # int32 halves the file; a sequence holds far fewer than 2^31 queries
            sequence_votes=self.sequence_votes.cpu().to(torch.int32),
            paired=paired_figures(self.paired_hist, self.paired_halved).cpu().contiguous(),
            metadata=metadata,
            bounds=_cpu(self.bound_sum / self.bound_count, "l h k n b -> k b l h n")
            if opts.bounds else None,
            regime=_cpu(self.regime_sum / self.regime_count, "l h f -> f l h")
            if opts.bounds else None,
            truncation_p90=nearest_rank_percentile(instances, PERCENTILE).cpu().contiguous(),
            beyond_votes=self.beyond_votes.cpu().to(torch.int32),
            block_votes=self.block_votes.cpu().to(torch.int32),
            window_scores=_cpu(self.window_scores, "s l h g n m -> s g m l h n") if kept else None,
            window_sink=_cpu(self.window_sink, "s l h f -> s f l h") if kept else None,
            window_bounds=_cpu(self.window_bounds, "s l h k n b -> s k b l h n")
            if kept and opts.bounds else None,
            baseline_se=_cpu(self._baseline_se(), "k l h n m -> k m l h n"),
        )

    def _baseline_se(self) -> Float[Tensor, "se_kind layer head n metric"]:
        """The random baseline's standard errors (SPEC §3): over its ``S`` sequences,
        ``√(Σ(x_s − x̄)² / ((S − 1) S))`` (NaN below 2), and Monte Carlo, ``√(Σ_s Var_s) / S``
        with ``Var_s`` each sequence's Monte Carlo variance (NaN where ``R < 2``)."""
        total, count = self.seq_sum[:, :, RANDOM_GROUP], self.seq_count[:, :, RANDOM_GROUP]
        spread = (self.random_sq - total.square() / count).clamp_min(0.0)
        sequences = (spread / ((count - 1) * count)).sqrt()
        sequences = torch.where(count >= 2, sequences, torch.nan)
        monte_carlo = self.random_mc.clamp_min(0.0).sqrt() / count
        return torch.stack([sequences, monte_carlo])


#: The fields with a row per sequence, grown as batches need (:meth:`Accumulator._rows`).
_PER_SEQUENCE = ("sequence_votes", "truncation_rows", "block_votes", "window_scores", "window_sink",
                 "window_bounds")
#: :class:`LayerStats` fields added as they are into the accumulator's row of their layer.
_ADDED = ("inst_sum", "inst_count", "paired_hist", "paired_halved", "votes", "beyond_votes", "sink_visible",
          "votes_rechecked")


def _cpu(x: Tensor, axes: str) -> Tensor:
    """``x`` rearranged as a result stores it: contiguous, on the CPU."""
    return rearrange(x, axes).cpu().contiguous()


def _ints(x: Tensor) -> list[int]:
    return [int(v) for v in x.tolist()]


def _add_means(total: Tensor, count: Tensor, per_sequence: Tensor) -> None:
    """Add per-sequence means ``[layer, batch, ...]`` (NaN where undefined) to the layers' sums
    and counts."""
    defined = ~torch.isnan(per_sequence)
    total += torch.where(defined, per_sequence, 0).sum(1)
    count += defined.sum(1)


def _stack(values: Sequence[Tensor]) -> Tensor:
    """One statistic of consecutive layers stacked on a new first axis (a view for one layer)."""
    return values[0][None] if len(values) == 1 else torch.stack(list(values))


def _stack_field(stats: Sequence[LayerStats], name: str) -> Tensor | None:
    """:func:`_stack` of the field ``name``, ``None`` where the layers have none."""
    values = [getattr(s, name) for s in stats]
    return None if values[0] is None else _stack(values)
