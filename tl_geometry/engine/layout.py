"""What the two backends and the orchestration agree on, defined once: where each validation
statistic sits (``ST_*``), the leak tolerance, the torch code's element budget, the groups and
metric indices of a layer's per-query rows, the partial vote counts' blocks, and the fields of
the query reduction (:class:`Reduced`).

The compiled kernels freeze the values they read (``ST_*``, :data:`LEAK_TOL`,
:data:`VOTE_QUERY_BLOCK`, the result slots of :data:`~tl_geometry.functional.figures.FIGURES`)
at compilation, and numba's disk cache is keyed on the kernel's own
source file, not this one: after changing one of those, delete the cached kernels (the
``*.nbi`` / ``*.nbc`` files of ``compiled/`` in numba's cache: ``compiled/__pycache__``, or
``$NUMBA_CACHE_DIR`` / ``~/.cache/numba`` where the package folder is read-only), or the old
value stays compiled in.
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
    """One layer's per-query rows reduced over queries, as either backend's ``reduce_rows``
    returns them: the fields of ``LayerStats`` but the votes and bounds."""

    seq_mean: Tensor
    inst_sum: Tensor
    inst_count: Tensor
    paired_hist: Tensor
    paired_halved: Tensor
    sink_mean: Tensor
