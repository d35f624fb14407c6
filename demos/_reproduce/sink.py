"""Claims 2 and 3: the sink's value geometry (SPEC §4) and the sink's effect on F_N (SPEC §3).

Claim 3 reads the **paired** per-head figures (SPEC §3, comparison 3): only the instances whose
top-N set holds the sink, each compared with itself re-selected without the sink; per head the
median ratio ``F_N(with sink) / F_N(sink removed)`` and the share of instances where it is ≤ 1/2,
then their median over heads. Pooling instances across heads (comparison 1) mixes heads and can
show an effect no head has: it is shown beside the verdict, not used by it. At the last query a
window is one instance, so the per-window sink-in and sink-removed F_N give every window's paired
ratio, and the median head's ratio and halved share are decided on their 95 % intervals over a
bootstrap of the windows (SPEC §8); an analysis saved without them is printed, not decided.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import plots
from .document import HELD, NOT_HELD, PARTLY, Claim, fmt, pct, table
from .intervals import (
    NO_INTERVAL,
    NO_SINK,
    TOO_FEW,
    UNDECIDED,
    Interval,
    WindowMeans,
    bootstraps,
    combine,
    decide,
    every,
    head_means,
    median_of,
    per_run,
    some,
    weak_sink,
    window_sink_values,
    window_values,
    with_units,
)
from .rules import HEADLINE, headline, runs, small_n
from .stats import fraction, median

KAPPA_RANGE = (0.1, 1 / 3)  # "3–10× smaller"
SINK_HEAD_MASS = 0.5  # (ours) a "sink head" puts at least half its attention on the sink


def sink_units(r: Any) -> tuple[Tensor, Tensor]:
    """``(sink_heads [layer, head], sink_kv [layer, kv])``: the query heads with α_sink ≥
    :data:`SINK_HEAD_MASS` (α is per query head), and the KV heads that at least one of them
    reads — the unit of the value-only figures κ and c_sink (SPEC §4)."""
    sink_heads = r.sink_mass >= SINK_HEAD_MASS
    group = r.kv_group_size
    return sink_heads, sink_heads.reshape(r.n_layers, r.n_heads // group, group).any(-1)


@per_run
def sink_spread(r: Any) -> dict[str, Interval] | None:
    """Claim 2's medians over KV heads with their 95 % intervals over windows (SPEC §4, §8): κ and
    c_sink over all KV heads, and over the KV heads of the sink heads (query heads with α_sink ≥
    :data:`SINK_HEAD_MASS`, chosen again in every resample from the drawn windows' masses). Each
    resample draws windows, recomputes each head's mean over them and the medians over the same
    KV heads; a median over fewer than 8 defined KV heads is too few. None without per-window
    sink figures."""
    kappa, cos, mass = (window_sink_values(r, f) for f in ("norm_ratio", "cosine", "mass"))
    if kappa is None:
        return None
    group = r.kv_group_size
    kappa, cos = kappa[..., ::group], cos[..., ::group]  # value-only: one column per KV group

    def kv_of(heads: Tensor) -> Tensor:
        return heads.reshape(heads.shape[0], -1, group).any(-1)

    ready = [WindowMeans(x) for x in (kappa, cos, mass)]

    def statistic(idx: Tensor) -> Tensor:
        k, c, m = (head_means(x, idx) for x in ready)
        sink_kv = kv_of(m >= SINK_HEAD_MASS)
        return torch.stack([median_of(k), median_of(c), median_of(k[sink_kv]), median_of(c[sink_kv])])

    values = bootstraps(statistic, len(kappa))
    k_all, c_all = head_means(kappa, torch.arange(len(kappa))), head_means(cos, torch.arange(len(cos)))
    sink_kv = kv_of(head_means(mass, torch.arange(len(mass))) >= SINK_HEAD_MASS)
    units = [int(torch.isfinite(k_all).sum()), int(torch.isfinite(c_all).sum()),
             int(torch.isfinite(k_all[sink_kv]).sum()), int(torch.isfinite(c_all[sink_kv]).sum())]
    return dict(zip(("kappa", "cosine", "sink_kappa", "sink_cosine"),
                    (with_units(v, n) for v, n in zip(values, units))))


def either(a: str, b: str) -> str:
    """One of two rules: held where one is held, not held where both are not held, else the
    missing outcome (too few / no interval) or undecided."""
    if HELD in (a, b):
        return HELD
    if a == b:
        return a
    if NOT_HELD in (a, b):
        other = b if a == NOT_HELD else a
        return other
    return UNDECIDED if UNDECIDED in (a, b) else a


def _rule2(checks: dict[str, list[bool]]) -> str:
    """Held: median κ in range and median c_sink < 0 on every run; not held: no part on any
    run (all KV heads or the sink heads' KV heads); else partly held."""
    if all(checks["kappa"]) and all(checks["cosine"]) and (checks["kappa"] or checks["cosine"]):
        return HELD
    return PARTLY if any(any(v) for v in checks.values()) else NOT_HELD


def claim2(study: Any, figures: Path) -> Claim:
    """The sink's value norm ratio κ and signed cosine to the other values, each median over KV
    heads on its 95 % interval over windows (SPEC §8); a model with a weak sink: "no sink"."""
    checks: dict[str, list[str]] = {"kappa": [], "cosine": [], "sink_heads": []}
    rows, notes = [], []
    lo, hi = KAPPA_RANGE
    for model, corpus, r in runs(study):
        kappa, cos, mean_cos = (r.kv_heads(k) for k in ("sink_norm_ratio", "sink_cosine", "sink_mean_cosine"))
        sink_heads, sink_kv = sink_units(r)
        k_med, c_med = median(kappa), median(cos)
        ks, cs = median(kappa[sink_kv]), median(cos[sink_kv])
        spread = sink_spread(r)
        run = f"{model} on {corpus}"
        if weak_sink(r):
            outcomes = (NO_SINK,) * 3
            notes.append(f"{run}: the sink check found a weak sink (the sink is not the most attended "
                         "of the first 32 keys in most layers; SPEC §1), so the model's sink claims "
                         "are reported as \"no sink\", not decided.")
        elif spread is None:
            outcomes = (NO_INTERVAL,) * 3
        else:
            outcomes = (decide(spread["kappa"], lo, hi), decide(spread["cosine"], high=0.0),
                        either(decide(spread["sink_kappa"], lo, hi), decide(spread["sink_cosine"], high=0.0)))
        for key, outcome in zip(checks, outcomes):
            checks[key].append(outcome)
        if spread is not None and not weak_sink(r):
            if outcomes[0] in (NOT_HELD, UNDECIDED):
                notes.append(f"{run}: the median sink norm ratio κ is {spread['kappa'].show()} "
                             f"({'outside' if outcomes[0] == NOT_HELD else 'not wholly inside'} "
                             f"[0.1, 1/3]), i.e. the sink's value is {fmt(1 / k_med, 1)}× shorter, "
                             "not 3–10×.")
            if outcomes[1] in (NOT_HELD, UNDECIDED):
                notes.append(f"{run}: the median signed cosine c_sink is {spread['cosine'].show()} "
                             f"({'≥ 0' if outcomes[1] == NOT_HELD else 'not wholly < 0'}); only "
                             f"{pct(fraction(cos < 0))} of KV heads have c_sink < 0.")

        def shown(key: str, point: float, spread: dict[str, Interval] | None = spread) -> str:
            return spread[key].show() if spread is not None else f"{fmt(point)} (no interval)"

        rows.append([
            model, corpus, str(kappa.numel()), shown("kappa", k_med),
            pct(fraction((kappa >= lo) & (kappa <= hi))), pct(fraction(kappa < 1)),
            shown("cosine", c_med), pct(fraction(cos < 0)), fmt(median(mean_cos)),
            f"{int(sink_heads.sum())} ({int(sink_kv.sum())})", shown("sink_kappa", ks),
            shown("sink_cosine", cs), NO_SINK if weak_sink(r) else "strong",
        ])

    def draw(ax, model, corpus):
        r = study.analyses[model, corpus]
        sink_heads = sink_units(r)[1].flatten()
        k, c = r.kv_heads("sink_norm_ratio").flatten(), r.kv_heads("sink_cosine").flatten()
        ax.axvspan(lo, hi, color="0.9", label="κ ∈ [0.1, 1/3]")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.scatter(k[~sink_heads], c[~sink_heads], s=9, color=plots.COLORS[0], label="other KV heads")
        ax.scatter(k[sink_heads], c[sink_heads], s=12, color=plots.COLORS[3],
                   label=f"KV heads of sink heads (α_sink ≥ {SINK_HEAD_MASS})")

    plots.grid(figures / "claim2_sink_geometry.png", study.models, study.corpus_names, draw,
               title="Per KV head: sink norm ratio κ vs signed cosine c_sink", xlabel="κ (log)",
               ylabel="c_sink", logx=True)
    result = combine(checks, _rule2)
    because = (f"median κ in [0.1, 1/3] on {_tally(checks['kappa'])}, median c_sink < 0 on "
               f"{_tally(checks['cosine'])}, each on its 95 % interval over windows; medians κ: "
               + ", ".join(f"{row[0]}/{row[1]} {row[3]}" for row in rows)
               + "; c_sink: " + ", ".join(f"{row[0]}/{row[1]} {row[6]}" for row in rows) + ".")
    return Claim(
        2, "The sink's value is short and anti-aligned",
        "The sink token's value norm is 3–10× smaller than the others', and its direction is "
        "systematically negatively aligned with them.",
        "Per KV head (last query, averaged over windows): κ = ‖v_sink‖ / mean_{j≠sink} ‖v_j‖ and "
        "the signed cosine c_sink = mean_{j≠sink} cos(v_sink, v_j) (SPEC §4). Both read only the "
        "values, which the query heads of one KV group share, so they are counted, medianed and "
        "shared over KV heads (SPEC §4, statistical unit, ours: SmolLM2 90, not 270; Gemma-3-270M "
        "18, not 72). 3–10× smaller ⇔ κ ∈ [0.1, 1/3]. Held: on every run the median over all KV "
        "heads has κ ∈ [0.1, 1/3] and c_sink < 0. Not held: neither part holds on any run, for all "
        f"KV heads nor for the KV heads of the sink heads (query heads with α_sink ≥ {SINK_HEAD_MASS}, "
        "ours; α is per query head). Else partly held. Uncertainty (SPEC §8, ours): each median "
        "with its 95 % interval from 1,000 seeded bootstrap resamples of the windows (each head's "
        "mean over the drawn windows, the medians over the same KV heads, the sink heads chosen "
        "again from the drawn windows' masses); a part holds where its whole interval satisfies "
        "it, fails where none of it does, and is undecided otherwise; a median over fewer than 8 "
        "KV heads or windows is too few; a saved analysis without per-window values has no "
        "interval and is not decided. A model whose sink check found a weak sink (SPEC §1) is "
        "reported as \"no sink\" instead of decided.",
        result, because,
        blocks=[table(
            ["model", "corpus", "KV heads", "median κ [95 %]", "κ ∈ [0.1, 1/3]", "κ < 1",
             "median c_sink [95 %]", "c_sink < 0", "median cos(v_sink, mean v)",
             "sink heads (their KV heads)", "their median κ [95 %]", "their median c_sink [95 %]",
             "sink check"], rows)],
        figures=[("claim2_sink_geometry.png",
                  "Every KV head; shaded: the paper's 3–10× range of κ; below the line: c_sink < 0.")],
        disagreements=notes,
    )


def _tally(outcomes: list[str]) -> str:
    """``held/all runs``, with the undecided ones and those without a verdict."""
    held, undecided = outcomes.count(HELD), outcomes.count(UNDECIDED)
    no_sink = outcomes.count(NO_SINK)
    none = len(outcomes) - held - undecided - no_sink - outcomes.count(NOT_HELD)
    extra = ([f"{undecided} undecided"] * bool(undecided) + [f"{no_sink} no sink"] * bool(no_sink)
             + [f"{none} without a verdict: too few or no per-window values"] * bool(none))
    return f"{held}/{len(outcomes)} runs" + (f" ({'; '.join(extra)})" if extra else "")



# --- claim 3 -------------------------------------------------------------------------------

MIN_PAIRED = 8  # (ours) a head enters the median when its sink was inside S_N in ≥ 8 windows
LOWERS = 0.9  # (ours) "significantly": the median head loses at least 10 % of F_N to the sink
HALVING_SHARE = 0.25  # (ours) "often": the median head halves F_N in ≥ a quarter of its instances


@dataclass
class Paired:
    """The paired sink figures of one run at one N: medians over the heads that qualify."""

    n: int
    heads: int  # heads with at least the minimum number of sink-holding instances
    ratio: float  # median over those heads of their median F(with sink) / F(sink removed)
    halved: float  # median over those heads of their share of instances with ratio ≤ 1/2
    ratio_q: tuple[float, float]  # 25 % and 75 % quantiles of the per-head ratios

    @property
    def defined(self) -> bool:
        return self.heads > 0 and not math.isnan(self.ratio)

    @property
    def lowers(self) -> bool:
        return self.defined and self.ratio <= LOWERS

    @property
    def halves(self) -> bool:
        return self.defined and self.halved >= HALVING_SHARE


def paired(n: int, ratio: Tensor, halved: Tensor, count: Tensor, min_count: int) -> Paired:
    """Median over heads of the per-head paired figures (``[layer, head]`` each), over the heads
    with ``count ≥ min_count`` sink-holding instances and a defined ratio: a head whose median
    ratio is ``+inf`` (the sink-removed F is 0 where the sink's is not) counts, as the largest
    ratio, so the median head is not pulled towards "the sink lowers F"."""
    keep = (torch.nan_to_num(count.double(), nan=0.0) >= min_count) & ~torch.isnan(ratio)
    values = ratio[keep].double()
    q = _quantiles(values, (0.25, 0.75))
    return Paired(n, int(keep.sum()), float(_quantiles(values, (0.5,))[0]), median(halved[keep]),
                  (float(q[0]), float(q[1])))


def _quantiles(values: Tensor, qs: tuple[float, ...]) -> Tensor:
    """The ``qs`` quantiles of ``values`` (no NaN; ``+inf`` allowed), interpolated linearly as
    ``torch.quantile`` does (up to rounding), where ``torch.quantile`` would give NaN between two
    ``+inf``: a quantile between a finite value and ``+inf`` is ``+inf``. NaN for no values. (The
    BCa interval over such medians leaves out the resamples whose median is ``+inf``, and has
    NaN ends where the point itself is: undecided, SPEC §8.)"""
    if not values.numel():
        return torch.full((len(qs),), math.nan, dtype=torch.float64)
    ordered = values.double().sort().values
    out = []
    for q in qs:
        at = q * (len(ordered) - 1)
        below, w = math.floor(at), at - math.floor(at)
        a, b = ordered[below], ordered[min(below + 1, len(ordered) - 1)]
        out.append(a if w == 0 or a == b else a + (b - a) * w)
    return torch.stack(out)


def min_paired(result: Any, default: int) -> int:
    """:data:`MIN_PAIRED`, or every window of a run with fewer windows."""
    return max(1, min(MIN_PAIRED, int(result.metadata.get("n_sequences", default))))


def measure_paired(result: Any, n: int, i: int, min_count: int) -> Paired:
    """The paired figures of ``result`` at ``N = n`` (position ``i``), from the engine's pooled
    per-head figures (:meth:`~tl_geometry.HeadAnalysis.paired_sink`: each head's median to within
    its histogram bin, ±1.1 %)."""
    return paired(n, result.paired_sink("ratio")[..., i], result.paired_sink("halved")[..., i],
                  result.paired_sink("count")[..., i], min_count)


def window_ratios(result: Any) -> Tensor | None:
    """Each window's paired ratio ``F_N(with sink) / F_N(sink removed)`` (SPEC §3, comparison 3),
    ``[window, layer, head, n]`` in float64: where the window's top-N set holds the sink (its
    ``sink_in`` F is defined), ``+inf`` where only the sink-removed F is 0, NaN where both are 0
    or the sink is not in S_N, as the engine's paired figures read each instance. At the last
    query a window is one instance, so these are the instances' own ratios. None where the
    analysis does not hold them (:func:`missing_windows` says why)."""
    if missing_windows(result) is not None:
        return None
    with_sink = window_values(result, "f_score", "sink_in")
    removed = window_values(result, "f_score", "sink_removed")
    assert with_sink is not None and removed is not None  # missing_windows checked them
    defined = torch.isfinite(with_sink) & torch.isfinite(removed)
    ratio = torch.where(removed > 0, with_sink / removed, torch.where(with_sink > 0, math.inf, math.nan))
    return torch.where(defined, ratio, math.nan)


def missing_windows(result: Any) -> str | None:
    """Why ``result`` has no per-window paired ratios (None where it has them): no per-window
    arrays, or none of the sink-in / sink-removed F_N per window (analyses saved before they were
    kept), or per-window means that pair more than one instance (queries other than the last)."""
    scores = getattr(result, "window_scores", None)
    if scores is None:
        return "the analysis keeps no per-window values"
    queries = result.metadata.get("queries", "last")
    if queries != "last":
        return (f"the analysis read queries={queries!r}: a window's means pair one instance only at "
                "the last query")
    held = bool(torch.nan_to_num(result.paired_sink("count"), nan=0.0).sum() > 0)
    values = {group: window_values(result, "f_score", group) for group in ("sink_in", "sink_removed")}
    lacking = [group for group, v in values.items() if held and (v is None or not bool(torch.isfinite(v).any()))]
    if lacking:
        return (f"the saved analysis has no per-window {' and '.join(lacking)} F_N (it was saved "
                "before claim 3 read them)")
    return None


def _head_figures(ratios: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each head's ``(median ratio, share ≤ 1/2, count)`` over the windows of ``ratios``
    (``[window, ...]``, NaN where a window has no ratio): the lower median (the ⌈k/2⌉-th
    smallest of its ``k`` ratios, as the engine's paired figure), NaN where ``k = 0``."""
    defined = ~torch.isnan(ratios)
    count = defined.sum(0)
    ordered = ratios.sort(dim=0).values  # NaN sort last, +inf before them
    lower = ((count - 1).clamp_min(0) // 2)[None]
    med = torch.where(count > 0, ordered.gather(0, lower).squeeze(0), math.nan)
    halved = (defined & (ratios <= 0.5)).sum(0).double() / count.double()
    return med, halved, count


def _over_heads(ratios: Tensor, min_count: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(median ratio, median halved share, heads)`` over the qualifying heads at each N of
    ``ratios`` (``[window, layer, head, k]``), and the qualifying heads' ratios' 25 % and 75 %
    quantiles ``[k, 2]``: a head qualifies with ≥ ``min_count`` sink-holding windows and a
    defined median ratio, ``+inf`` included (:func:`paired`)."""
    med, halved, count = _head_figures(ratios.flatten(1, 2))  # [head, k]
    keep = (count >= min_count) & ~torch.isnan(med)
    ratio = torch.stack([_quantiles(med[keep[:, k], k], (0.5,))[0] for k in range(med.shape[-1])])
    share = torch.stack([median_of(halved[keep[:, k], k]) for k in range(med.shape[-1])])
    quartiles = torch.stack([_quantiles(med[keep[:, k], k], (0.25, 0.75)) for k in range(med.shape[-1])])
    return ratio, share, keep.sum(0), quartiles


@dataclass
class PairedSpread:
    """Claim 3's figures of one run at one N from the per-window paired ratios (SPEC §3, §8):
    the point figures on every window and the 95 % BCa intervals of the median head's ratio and
    halved share over a bootstrap of the windows (heads fixed; each resample recomputes every
    head's figures over its drawn sink-holding windows, the qualifying heads and the medians)."""

    point: Paired
    ratio: Interval
    halved: Interval
    windows: int


@per_run
def paired_spread(result: Any, sizes: list[tuple[int, int]], min_count: int) -> dict[int, PairedSpread] | None:
    """:class:`PairedSpread` per ``(N, position)`` of ``sizes``; None where the analysis holds no
    per-window paired ratios (:func:`missing_windows`). A median over fewer than 8 qualifying
    heads (on every window) is too few (SPEC §8), whatever the windows."""
    ratios = window_ratios(result)
    if ratios is None or not sizes:
        return None if ratios is None else {}
    chosen = ratios[..., [i for _, i in sizes]]
    k = len(sizes)

    def statistic(idx: Tensor) -> Tensor:
        ratio, share, _, _ = _over_heads(chosen[idx], min_count)
        return torch.cat([ratio, share])

    values = bootstraps(statistic, len(chosen))
    ratio, share, heads, quartiles = _over_heads(chosen, min_count)
    out = {}
    for j, (n, _) in enumerate(sizes):
        q = (float(quartiles[j, 0]), float(quartiles[j, 1]))
        point_figures = Paired(n, int(heads[j]), float(ratio[j]), float(share[j]), q)
        out[n] = PairedSpread(point_figures, with_units(values[j], int(heads[j])),
                              with_units(values[k + j], int(heads[j])), len(chosen))
    return out


def point_paired(result: Any, positions: list[int], min_count: int) -> list[Paired]:
    """The point figures at each of ``positions`` (along ``n_values``): from the per-window
    ratios where the analysis holds them (as the verdict reads them), else the pooled figures."""
    ns = result.n_values.tolist()
    ratios = window_ratios(result)
    if ratios is None or not positions:
        return [measure_paired(result, ns[i], i, min_count) for i in positions]
    ratio, share, heads, quartiles = _over_heads(ratios[..., positions], min_count)
    return [Paired(ns[i], int(heads[j]), float(ratio[j]), float(share[j]),
                   (float(quartiles[j, 0]), float(quartiles[j, 1]))) for j, i in enumerate(positions)]


def _pooled(r: Any, group: str, i: int) -> float:
    """Mean F_N of a group's instances pooled over heads (weighted by instance counts)."""
    counts, values = r.count(group)[..., i], r.metric("f_score", group)[..., i]
    keep = (counts > 0) & torch.isfinite(values)
    return float((counts * values)[keep].sum() / counts[keep].sum()) if keep.any() else math.nan


def run_checks(figures: list[Paired]) -> tuple[bool, bool]:
    """``(lowers, halves)`` of one run on point values: the median head's ratio ≤ :data:`LOWERS`
    at every N where some head qualifies (and there is one), and its halved share ≥
    :data:`HALVING_SHARE` at some. (The page decides on intervals: :func:`interval_checks`.)"""
    defined = [p for p in figures if p.defined]
    return bool(defined) and all(p.lowers for p in defined), any(p.halves for p in defined)


def interval_checks(spreads: list[PairedSpread]) -> tuple[str, str]:
    """``(lowers, halves)`` of one run on the intervals (SPEC §8): *lowers* — the median head's
    ratio ≤ :data:`LOWERS` on its whole interval at every N where some head qualifies (:func:`every`);
    *halves* — its halved share ≥ :data:`HALVING_SHARE` on its whole interval at some N
    (:func:`some`). Too few where no head qualifies at any N, or a median has fewer than 8 heads."""
    defined = [s for s in spreads if s.point.heads > 0]
    if not defined:
        return TOO_FEW, TOO_FEW
    return (every([decide(s.ratio, high=LOWERS) for s in defined]),
            some([decide(s.halved, low=HALVING_SHARE) for s in defined]))


RULE3 = (
    "Paired per-head figures (SPEC §3, comparison 3) at N = 2, 4, 8 (inside the headline range "
    f"{HEADLINE}), at the last query of each window (one instance per window): for each head, over "
    "the windows whose top-N set holds the sink, the median (the lower one, as the engine's) of "
    "F_N(with sink) / F_N(same query, sink removed and top-N re-selected) (∞ where only the second "
    "is 0; no ratio where both are) and the share of those windows where it is ≤ 1/2; then the "
    f"median over the heads whose sink was in S_N in at least {MIN_PAIRED} windows (ours; every "
    f"window for shorter runs). *Lowers significantly* (ours): the median head's ratio ≤ {LOWERS} at "
    "every such N where some head qualifies. *Often by two* (ours): at some such N the median "
    f"head's share of halved windows ≥ {HALVING_SHARE:.0%}. Uncertainty (SPEC §8): both medians get "
    "a 95 % BCa interval from 1,000 seeded bootstrap resamples of the windows (heads fixed; each "
    "resample recomputes every head's ratios over its drawn sink-holding windows, the qualifying "
    "heads and the medians over them); a check holds where its whole interval satisfies it, fails "
    "where none of it does, and is undecided otherwise; a median over fewer than 8 qualifying heads "
    "or windows is too few. The pooled comparison (instances with vs without the sink in S_N, "
    "pooled over heads and weighted by counts) is shown beside it, not used: pooling mixes heads. "
    "Held: both on every run; not held: *lowers* on no run; else partly held. A saved analysis "
    "without the per-window sink-in and sink-removed F_N prints its point figures (from the "
    "engine's per-head figures) with no interval and is not decided. A model whose sink check "
    "found a weak sink (SPEC §1) is reported as \"no sink\" instead of decided."
)

RECOMPUTE = "re-running the analyses (python demos/reproduce.py without --reuse) computes them"


def claim3(study: Any, figures: Path) -> Claim:
    """The sink's effect on F_N, per head and paired, decided on its intervals over windows
    (SPEC §8); the pooled comparison beside it."""
    checks: dict[str, list[str]] = {"lowers": [], "halves": []}
    rows, notes = [], []
    for model, corpus, r in runs(study):
        min_count = min_paired(r, study.config.n_windows)
        sizes = small_n(r, study.config.seq_len)
        spreads = paired_spread(r, sizes, min_count)
        points = point_paired(r, [i for _, i in sizes], min_count)
        for (n, i), p in zip(sizes, points):
            f_in, f_out = _pooled(r, "sink_in", i), _pooled(r, "sink_out", i)
            heads = r.paired_sink("count")[..., i]
            if spreads is not None:
                spread = spreads[n]
                windows, ratio_shown = str(spread.windows), spread.ratio.show()
                halved_shown = spread.halved.show(digits=1, percent=True)
            else:
                windows = "–"
                ratio_shown, halved_shown = f"{fmt(p.ratio)} ({NO_INTERVAL})", f"{pct(p.halved)} ({NO_INTERVAL})"
            rows.append([model, corpus, str(n), windows, str(p.heads), ratio_shown,
                         f"{fmt(p.ratio_q[0])} – {fmt(p.ratio_q[1])}", halved_shown,
                         pct(fraction(torch.nan_to_num(heads, nan=0.0) > 0)),
                         fmt(f_in), fmt(f_out), fmt(f_in / f_out if f_out > 0 else math.nan)])
            run = f"{model} on {corpus}, N = {n}"
            if not p.defined:
                notes.append(f"{run}: no head had the sink in S_N in {min_count} windows; the "
                             "paired figures are undefined.")
            elif spreads is not None and decide(spreads[n].ratio, high=LOWERS) in (NOT_HELD, UNDECIDED):
                outcome = decide(spreads[n].ratio, high=LOWERS)
                notes.append(f"{run}: within heads the sink does not lower F_N significantly on its "
                             f"interval (median head's F(with sink)/F(sink removed) {spreads[n].ratio.show()}, "
                             f"{'above' if outcome == NOT_HELD else 'not wholly ≤'} {LOWERS}; {p.heads} heads, "
                             f"{spreads[n].windows} windows).")
        if weak_sink(r):  # SPEC §1: a weak sink's claims are reported, not decided
            checks["lowers"].append(NO_SINK)
            checks["halves"].append(NO_SINK)
            notes.append(f"{model} on {corpus}: the sink check found a weak sink (SPEC §1), so the "
                         "paired sink figures are reported as \"no sink\", not decided.")
            continue
        if spreads is None:  # SPEC §8: never decided on a point value
            checks["lowers"].append(NO_INTERVAL)
            checks["halves"].append(NO_INTERVAL)
            notes.append(f"{model} on {corpus}: {missing_windows(r)}, so its paired figures are printed "
                         f"as point values with no interval and not decided (SPEC §8); {RECOMPUTE}.")
            continue
        lowers, halves = interval_checks([spreads[n] for n, _ in sizes])
        checks["lowers"].append(lowers)
        checks["halves"].append(halves)
        if halves in (NOT_HELD, UNDECIDED):
            where = "below" if halves == NOT_HELD else "not wholly ≥"
            notes.append(f"{model} on {corpus}: the sink rarely halves F_N within a head (the median "
                         f"head's share of halved sink-holding windows is {where} {HALVING_SHARE:.0%} "
                         "on its interval at every N = 2, 4, 8).")

    def draw(ax: Any, model: str, corpus: str) -> None:
        r = study.analyses[model, corpus]
        ns = r.n_values.tolist()
        hl = headline(r, study.config.seq_len)
        ps = point_paired(r, hl, min_paired(r, study.config.n_windows))
        xs = [ns[i] for i in hl]
        ax.plot(xs, [p.ratio for p in ps], "o-", color=plots.COLORS[0], ms=4,
                label="paired: median head's F(sink)/F(removed)")
        ax.fill_between(xs, [p.ratio_q[0] for p in ps], [p.ratio_q[1] for p in ps],
                        color=plots.COLORS[0], alpha=0.2, label="heads' 25–75 %")
        pooled = [_pooled(r, "sink_in", i) / _pooled(r, "sink_out", i) if _pooled(r, "sink_out", i) > 0
                  else math.nan for i in hl]
        ax.plot(xs, pooled, "s--", color=plots.COLORS[1], ms=4, label="pooled: F(sink in)/F(sink out)")
        ax.axhline(1.0, color="0.5", lw=0.8)
        ax.axhline(0.5, color="0.5", lw=0.8, ls=":")

    plots.grid(figures / "claim3_sink_in_selection.png", study.models, study.corpus_names, draw,
               title="Effect of the sink on F_N: paired within heads vs pooled over heads",
               xlabel="N (headline range)", ylabel="ratio")
    because = (f"the median head's paired ratio ≤ {LOWERS} at N = 2, 4, 8, on its 95 % interval over "
               f"windows, on {_tally(checks['lowers'])}; halves F_N in ≥ {HALVING_SHARE:.0%} of the "
               f"median head's sink-holding windows on {_tally(checks['halves'])}.")
    return Claim(
        3, "Including the sink lowers F_N",
        "Including the sink in the top-N selection lowers F_N significantly, often by a factor "
        "of two.",
        RULE3, combine(checks, "lowers"), because,
        blocks=[table(["model", "corpus", "N", "windows", "heads in the median",
                       "median paired ratio [95 %]", "heads' 25–75 %", "median share halved [95 %]",
                       "heads with any sink-holding window", "pooled F_N sink in S_N",
                       "pooled F_N sink not in S_N", "pooled ratio in/out"], rows)],
        figures=[("claim3_sink_in_selection.png",
                  "Solid: the median head's paired ratio F_N(with sink)/F_N(sink removed), band: the "
                  "heads' 25–75 %; dashed: the pooled ratio of instances with / without the sink "
                  "(not the verdict); lines at 1 and 1/2.")],
        disagreements=notes,
    )
