"""Claims 2 and 3: the sink's value geometry (SPEC §4) and the sink's effect on F_N (SPEC §3).

Claim 3 reads the **paired** per-head figures (SPEC §3, comparison 3): only the instances whose
top-N set holds the sink, each compared with itself re-selected without the sink; per head the
median ratio ``F_N(with sink) / F_N(sink removed)`` and the share of instances where it is ≤ 1/2,
then their median over heads. Pooling instances across heads (comparison 1) mixes heads and can
show an effect no head has: it is shown beside the verdict, not used by it.
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
from .rules import HEADLINE, headline, runs, small_n, verdict
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


def claim2(study: Any, figures: Path) -> Claim:
    """The sink's value norm ratio κ and signed cosine to the other values."""
    checks: dict[str, list[bool]] = {"kappa": [], "cosine": []}
    sink_checks: list[bool] = []
    rows, notes = [], []
    lo, hi = KAPPA_RANGE
    for model, corpus, r in runs(study):
        kappa, cos, mean_cos = (r.kv_heads(k) for k in ("sink_norm_ratio", "sink_cosine", "sink_mean_cosine"))
        sink_heads, sink_kv = sink_units(r)
        k_med, c_med = median(kappa), median(cos)
        checks["kappa"].append(lo <= k_med <= hi)
        checks["cosine"].append(c_med < 0)
        ks, cs = median(kappa[sink_kv]), median(cos[sink_kv])
        if not lo <= k_med <= hi:
            notes.append(f"{model} on {corpus}: the median sink norm ratio κ is {fmt(k_med)}, "
                         f"i.e. the sink's value is {fmt(1 / k_med, 1)}× shorter, not 3–10×.")
        if not c_med < 0:
            notes.append(f"{model} on {corpus}: the median signed cosine c_sink is {fmt(c_med)} "
                         f"(≥ 0); only {pct(fraction(cos < 0))} of KV heads have c_sink < 0.")
        sink_checks.append((lo <= ks <= hi) or cs < 0)
        rows.append([
            model, corpus, str(kappa.numel()), fmt(k_med), pct(fraction((kappa >= lo) & (kappa <= hi))),
            pct(fraction(kappa < 1)), fmt(c_med), pct(fraction(cos < 0)), fmt(median(mean_cos)),
            f"{int(sink_heads.sum())} ({int(sink_kv.sum())})", fmt(ks), fmt(cs),
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
    any_part = [k or c or s for k, c, s in zip(checks["kappa"], checks["cosine"], sink_checks)]
    result = HELD if all(checks["kappa"]) and all(checks["cosine"]) else (
        PARTLY if any(any_part) else NOT_HELD)
    n_runs = len(rows)
    because = (f"median κ in [0.1, 1/3] on {sum(checks['kappa'])}/{n_runs} runs, median "
               f"c_sink < 0 on {sum(checks['cosine'])}/{n_runs}; medians κ: "
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
        "ours; α is per query head). Else partly held.",
        result, because,
        blocks=[table(
            ["model", "corpus", "KV heads", "median κ", "κ ∈ [0.1, 1/3]", "κ < 1", "median c_sink",
             "c_sink < 0", "median cos(v_sink, mean v)", "sink heads (their KV heads)",
             "their median κ", "their median c_sink"], rows)],
        figures=[("claim2_sink_geometry.png",
                  "Every KV head; shaded: the paper's 3–10× range of κ; below the line: c_sink < 0.")],
        disagreements=notes,
    )



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
    with ``count ≥ min_count`` sink-holding instances and a finite ratio."""
    keep = (torch.nan_to_num(count.double(), nan=0.0) >= min_count) & torch.isfinite(ratio)
    values = ratio[keep].double()
    q = (float(values.quantile(0.25)), float(values.quantile(0.75))) if values.numel() else (math.nan, math.nan)
    return Paired(n, int(keep.sum()), median(values), median(halved[keep]), q)


def min_paired(result: Any, default: int) -> int:
    """:data:`MIN_PAIRED`, or every window of a run with fewer windows."""
    return max(1, min(MIN_PAIRED, int(result.metadata.get("n_sequences", default))))


def measure_paired(result: Any, n: int, i: int, min_count: int) -> Paired:
    """The paired figures of ``result`` at ``N = n`` (position ``i``)."""
    return paired(n, result.paired_sink("ratio")[..., i], result.paired_sink("halved")[..., i],
                  result.paired_sink("count")[..., i], min_count)


def _pooled(r: Any, group: str, i: int) -> float:
    """Mean F_N of a group's instances pooled over heads (weighted by instance counts)."""
    counts, values = r.count(group)[..., i], r.metric("f_score", group)[..., i]
    keep = (counts > 0) & torch.isfinite(values)
    return float((counts * values)[keep].sum() / counts[keep].sum()) if keep.any() else math.nan


def run_checks(figures: list[Paired]) -> tuple[bool, bool]:
    """``(lowers, halves)`` of one run: the median head's ratio ≤ :data:`LOWERS` at every N where
    some head qualifies (and there is one), and its halved share ≥ :data:`HALVING_SHARE` at some."""
    defined = [p for p in figures if p.defined]
    return bool(defined) and all(p.lowers for p in defined), any(p.halves for p in defined)


RULE3 = (
    "Paired per-head figures (SPEC §3, comparison 3) at N = 2, 4, 8 (inside the headline range "
    f"{HEADLINE}): for each head, over the windows whose top-N set holds the sink, the median of "
    "F_N(with sink) / F_N(same query, sink removed and top-N re-selected) and the share of those "
    "windows where it is ≤ 1/2; then the median over the heads whose sink was in S_N in at least "
    f"{MIN_PAIRED} windows (ours; every window for shorter runs). *Lowers significantly* (ours): "
    f"the median head's ratio ≤ {LOWERS} at every such N where some head qualifies. *Often by "
    f"two* (ours): at some such N the median head's share of halved windows ≥ {HALVING_SHARE:.0%}. "
    "The pooled comparison (instances with vs without the sink in S_N, pooled over heads and "
    "weighted by counts) is shown beside it, not used: pooling mixes heads. Held: both on every "
    "run; not held: *lowers* on no run; else partly held."
)


def claim3(study: Any, figures: Path) -> Claim:
    """The sink's effect on F_N, per head and paired; the pooled comparison beside it."""
    checks: dict[str, list[bool]] = {"lowers": [], "halves": []}
    rows, notes = [], []
    for model, corpus, r in runs(study):
        min_count = min_paired(r, study.config.n_windows)
        figures_run = []
        for n, i in small_n(r, study.config.seq_len):
            p = measure_paired(r, n, i, min_count)
            figures_run.append(p)
            f_in, f_out = _pooled(r, "sink_in", i), _pooled(r, "sink_out", i)
            heads = r.paired_sink("count")[..., i]
            rows.append([model, corpus, str(n), str(p.heads), fmt(p.ratio),
                         f"{fmt(p.ratio_q[0])} – {fmt(p.ratio_q[1])}", pct(p.halved),
                         pct(fraction(torch.nan_to_num(heads, nan=0.0) > 0)),
                         fmt(f_in), fmt(f_out), fmt(f_in / f_out if f_out > 0 else math.nan)])
            run = f"{model} on {corpus}, N = {n}"
            if not p.defined:
                notes.append(f"{run}: no head had the sink in S_N in {min_count} windows; the "
                             "paired figures are undefined.")
            elif not p.lowers:
                notes.append(f"{run}: within heads the sink does not lower F_N significantly "
                             f"(median head's F(with sink)/F(sink removed) {fmt(p.ratio)} > {LOWERS}, "
                             f"over {p.heads} heads).")
        lowers, halves = run_checks(figures_run)
        checks["lowers"].append(lowers)
        checks["halves"].append(halves)
        if not halves:
            notes.append(f"{model} on {corpus}: the sink rarely halves F_N within a head (the median "
                         f"head halves fewer than {HALVING_SHARE:.0%} of its sink-holding windows at "
                         "every N = 2, 4, 8).")

    def draw(ax: Any, model: str, corpus: str) -> None:
        r = study.analyses[model, corpus]
        ns = r.n_values.tolist()
        hl = headline(r, study.config.seq_len)
        min_count = min_paired(r, study.config.n_windows)
        ps = [measure_paired(r, ns[i], i, min_count) for i in hl]
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
    n_runs = len(checks["lowers"])
    because = (f"the median head's paired ratio ≤ {LOWERS} at N = 2, 4, 8 on "
               f"{sum(checks['lowers'])}/{n_runs} runs; halves F_N in ≥ {HALVING_SHARE:.0%} of the "
               f"median head's sink-holding windows on {sum(checks['halves'])}/{n_runs}.")
    return Claim(
        3, "Including the sink lowers F_N",
        "Including the sink in the top-N selection lowers F_N significantly, often by a factor "
        "of two.",
        RULE3, verdict(checks, "lowers"), because,
        blocks=[table(["model", "corpus", "N", "heads in the median", "median paired ratio",
                       "heads' 25–75 %", "median share halved", "heads with any sink-holding window",
                       "pooled F_N sink in S_N", "pooled F_N sink not in S_N", "pooled ratio in/out"],
                      rows)],
        figures=[("claim3_sink_in_selection.png",
                  "Solid: the median head's paired ratio F_N(with sink)/F_N(sink removed), band: the "
                  "heads' 25–75 %; dashed: the pooled ratio of instances with / without the sink "
                  "(not the verdict); lines at 1 and 1/2.")],
        disagreements=notes,
    )
