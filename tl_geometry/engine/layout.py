"""What the two backends and the orchestration agree on, defined once: statistic slots, tolerances,
group and metric indices, and the records of the scoring and of the query reduction.

The compiled kernels freeze the values they read (``ST_*``, :data:`LEAK_TOL`,
:data:`VOTE_QUERY_BLOCK`, the result slots of :data:`~tl_geometry.functional.figures.FIGURES`)
at compilation, and numba's disk cache is keyed on the kernel's own source file, not this one:
after changing one of those, delete the cached kernels (``*.nbi`` / ``*.nbc`` of ``compiled/``
in ``compiled/__pycache__``, ``$NUMBA_CACHE_DIR`` or ``~/.cache/numba``), or the old value stays
compiled in.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from ..functional.figures import slot
from ..functional.separability import METRIC_NAMES, TRUNCATION_NAMES

#: Validation statistics per (sequence, head), in this order on their last axis: the count of
#: non-finite entries where keys exist and the (query, key) of the first, the largest mass on
#: future keys, on padding and (ST_WINDOW) on real keys before the sliding window, the smallest
#: entry, the largest row sum, the count of real rows without mass and the first one's query.
N_STATS = 10
(ST_NONFINITE, ST_NONFINITE_Q, ST_NONFINITE_K, ST_FUTURE, ST_PADDING, ST_MIN, ST_ROW_SUM,
 ST_DEAD, ST_DEAD_Q, ST_WINDOW) = range(N_STATS)
#: Largest weight on a key a query cannot see that is taken for round-off, not a leak.
LEAK_TOL = 1e-4

#: Elements of one float64 temporary that the torch code holds at once (selection weights in
#: the twin's scoring, attention rows ``[head, query, key]`` in the bounds).
BLOCK_ELEMENTS = 1 << 22

#: Queries of one (sequence, head) per parallel task of the compiled vote from queries and keys;
#: its partial counts have one row per task.
VOTE_QUERY_BLOCK = 32

#: Groups scored per query, in the order of ``LayerStats.seq_mean`` (SPEC §3).
SEQUENCE_GROUPS = ("top", "random", "shuffled", "sink_removed")
TOP_GROUP, SINK_REMOVED = SEQUENCE_GROUPS.index("top"), SEQUENCE_GROUPS.index("sink_removed")
RANDOM_GROUP = SEQUENCE_GROUPS.index("random")
F_SCORE, INVERSIONS = slot("metric", "f_score"), slot("metric", "inversions")
#: The sink fields both backends' scoring writes, and those their sink geometry writes.
SINK_MASS, SINK_SHARE = slot("sink_field", "mass"), slot("sink_field", "share")
SINK_NORM_RATIO, SINK_COSINE, SINK_MEAN_COSINE = (slot("sink_field", name) for name in ("norm_ratio", "cosine",
                                                                                        "mean_cosine"))
#: The truncation metrics (SPEC §10), contiguous at the end of the metric axis.
TRUNCATION = slice(METRIC_NAMES.index(TRUNCATION_NAMES[0]), METRIC_NAMES.index(TRUNCATION_NAMES[-1]) + 1)


class Reduced(NamedTuple):
    """One layer's per-query rows reduced over queries by either backend's ``reduce_rows``."""

    seq_mean: Tensor
    inst_sum: Tensor
    inst_count: Tensor
    paired_hist: Tensor
    paired_halved: Tensor
    sink_mean: Tensor


# The records ``score_rows`` takes, on both backends: tensors, or for the kernel NumPy views that
# numba types field by field (:mod:`.compiled.signatures`). The annotations are the orchestration's.


class ScoreChunk(NamedTuple):
    """What ``score_rows`` scores: the chosen queries ``[b, Q]`` (−1: none) of a chunk of
    sequences, for heads ``h0 …`` of value groups ``g0 …``. ``rows [b, H, r, k]`` holds query
    ``queries[b, i]``'s row at ``row_of[b, i]``; ``real_index [b, k]`` is each key's index among
    real tokens, ``sequence_keys [b]`` the random streams' keys; ``values [b, g, k, d]`` the value
    vectors and ``gram [b, g, k, k]`` their tied Gram matrices (``[0, 0, 0, 0]``: from the vectors).
    """

    rows: Tensor
    row_of: Tensor
    h0: int
    group_size: int
    g0: int
    queries: Tensor
    is_token: Tensor
    start: Tensor
    sink: Tensor
    window: int
    real_index: Tensor
    sequence_keys: Tensor
    gram: Tensor
    values: Tensor


class ScoreSettings(NamedTuple):
    """How ``score_rows`` scores (SPEC §2–3): the ascending grid of N, the random subsets and the
    permutations of the null ``shuffle_kind`` (:data:`.options.NULL_VALUES` …) per row, keys
    ranked by ``α‖v‖`` or by weight, cosine or Euclidean distances."""

    n_values: Tensor
    samples: int
    shuffles: int
    shuffle_kind: int
    by_contribution: bool
    cosine: bool


class ScoreOutputs(NamedTuple):
    """What ``score_rows`` writes in place per head and query: ``metrics [b, H, Q, group, n,
    metric]`` (:data:`SEQUENCE_GROUPS`; NaN where N does not fit), ``sink_in_top``, the fields
    :data:`SINK_MASS` and :data:`SINK_SHARE` of ``sink_fields`` (SPEC §4) and ``random_var``, the
    Monte Carlo variance ``s²/R`` of the random group's mean (SPEC §3; NaN where ``R < 2``)."""

    metrics: Tensor
    sink_in_top: Tensor
    sink_fields: Tensor
    random_var: Tensor
