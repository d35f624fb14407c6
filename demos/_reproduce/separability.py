"""Claim 1: top-N selections are more separable than random subsets, read on the headline range
with the chance-corrected F∗_N and the value-shuffle null (SPEC §3).

The gain of the top-N set over random N-subsets splits in two (SPEC §3, value-shuffle null,
corrected reading): ``F∗(top) − F∗(shuffled)`` is the **net** effect of the value geometry (same
α, same set, values permuted) and has two signs — positive where the selected values cohere more
than chance, negative where attended but unselected keys carry values aligned with the selection
and crowd the ball (a gap ≤ −0.05 reads "geometry lowers separability", never "equal"); and
``F∗(shuffled) − F∗(random)`` is what the attention ranking achieves on values with the real norm
distribution but no coupling (not "the attention magnitudes alone"). With the decomposition nulls
(norms, directions, unselected; ``Study.nulls``) the page splits the net effect further.
The old rule "the gain is largest at sparse N rather than dense N" is gone: at dense N precision
sits on its floor ``N/(t+1)`` and raw F rises with it, which measures the floor, not geometry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tl_geometry.result import null_decomposition
from tl_geometry.result.headline import GEOMETRY_GAP, LOWERS, RAISES, geometry_reading

from . import plots
from .document import Claim, fmt, pct, table
from .rules import HEADLINE, headline, runs, ticks, verdict
from .stats import fraction, per_n

# GEOMETRY_GAP (ours, tl_geometry.result.headline): |F∗(top) − F∗(shuffled)| below it is "equal".
SMALL_BEST = 4  # the paper's theory: the strongest non-trivial separability at N ≈ 2–4


@dataclass
class TopVsRandom:
    """One run's mean-over-heads curves and the checks of claim 1's rule."""

    ns: list[int]
    headline: list[int]  # positions along ns
    top: list[float]  # mean F∗_N over heads, per N
    shuffled: list[float]
    random: list[float]

    @property
    def geometry(self) -> list[float]:
        """F∗(top) − F∗(shuffled): the net effect of the value geometry, of either sign."""
        return [t - s for t, s in zip(self.top, self.shuffled)]

    @property
    def ranking(self) -> list[float]:
        """F∗(shuffled) − F∗(random): what the attention ranking achieves on values with the
        real norm distribution but no coupling to them."""
        return [s - r for s, r in zip(self.shuffled, self.random)]

    @property
    def max_geometry(self) -> float:
        """The largest geometry part over the headline N (NaN without one)."""
        return max((self.geometry[i] for i in self.headline), default=math.nan)

    @property
    def min_geometry(self) -> float:
        """The smallest (most negative) geometry part over the headline N (NaN without one)."""
        return min((self.geometry[i] for i in self.headline), default=math.nan)

    @property
    def lowering(self) -> list[int]:
        """The headline N where the geometry lowers separability (gap ≤ −:data:`GEOMETRY_GAP`)."""
        return [self.ns[i] for i in self.headline if geometry_reading(self.geometry[i]) == LOWERS]

    @property
    def min_gain(self) -> float:
        """The smallest F∗(top) − F∗(random) over the headline N (NaN without one)."""
        return min((self.top[i] - self.random[i] for i in self.headline), default=math.nan)

    @property
    def consistent(self) -> bool:
        """(a): F∗(top) > F∗(random) at every headline N (and there is one)."""
        return bool(self.headline) and all(self.top[i] > self.random[i] for i in self.headline)

    @property
    def geometric(self) -> bool:
        """(b): at some headline N the geometry carries at least :data:`GEOMETRY_GAP`."""
        return any(geometry_reading(self.geometry[i]) == RAISES for i in self.headline)

    @property
    def best(self) -> int | None:
        """The headline N with the largest mean F∗_N(top) (ties → the smaller N)."""
        finite = [i for i in self.headline if not math.isnan(self.top[i])]
        return self.ns[max(finite, key=lambda i: (self.top[i], -self.ns[i]))] if finite else None

    @property
    def small(self) -> bool:
        """(c): the best headline N is at most :data:`SMALL_BEST`."""
        return self.best is not None and self.best <= SMALL_BEST


def measure(result: Any, default_keys: int | None = None) -> TopVsRandom:
    """Claim 1's curves of one analysis (mean over heads of F∗_N for top, shuffled, random)."""
    curves = [per_n(result.metric("f_score_cc", g)) for g in ("top", "shuffled", "random")]
    return TopVsRandom(result.n_values.tolist(), headline(result, default_keys), *curves)


RULE = (
    "Per run (model × corpus), the mean over heads of the chance-corrected F∗_N (SPEC §3: "
    "precision rescaled above its floor N/(t+1), harmonic mean with recall) for the top-N set, for "
    "the value-shuffle null (same α and set, non-sink values permuted; 16 permutations) and for "
    f"random N-subsets (16 permutations), on the headline range {HEADLINE}. (a) *consistently*: "
    "F∗(top) > F∗(random) at every headline N. (b) *the geometry carries part of it* (ours): at "
    f"some headline N, F∗(top) − F∗(shuffled) ≥ {GEOMETRY_GAP}. The gap is the net effect of the "
    f"value geometry and is read with both signs (ours): ≥ {GEOMETRY_GAP} geometry raises "
    f"separability, ≤ −{GEOMETRY_GAP} geometry lowers it (attended but unselected keys carry values "
    "aligned with the selection and crowd the ball; never called equal), in between equal. "
    "F∗(shuffled) − F∗(random) is what the attention ranking achieves on values with the real norm "
    "distribution but no coupling (not the attention magnitudes alone), shown beside it. "
    "(c) *strongest at small N*: the headline N with the largest F∗(top) is 2 or 4 (the "
    "paper's theory: about 2–4). The paper's \"especially at sparse and intermediate N\" is not "
    "tested against dense N: there precision sits on its floor, and only the headline range is "
    "read. Held: (a), (b), (c) on every run; not held: (a) on no run; else partly held."
)


def claim1(study: Any, figures: Path) -> Claim:
    """Top-N vs the shuffled null vs random subsets on the headline range."""
    checks: dict[str, list[bool]] = {"a": [], "b": [], "c": []}
    curves: dict[tuple[str, str], TopVsRandom] = {}
    split, detail, notes = [], [], []
    keys = study.config.seq_len
    for model, corpus, r in runs(study):
        m = curves[model, corpus] = measure(r, keys)
        for key, ok in zip("abc", (m.consistent, m.geometric, m.small)):
            checks[key].append(ok)
        ns, hl = m.ns, m.headline
        run = f"{model} on {corpus}"
        if not m.consistent:
            worse = [str(ns[i]) for i in hl if not m.top[i] > m.random[i]]
            notes.append(f"{run}: F∗(top) is not above F∗(random) at N = {', '.join(worse) or '–'}.")
        if m.lowering:
            notes.append(f"{run}: geometry lowers separability at N = {', '.join(map(str, m.lowering))} "
                         f"(smallest F∗(top) − F∗(shuffled) {fmt(m.min_geometry)} ≤ −{GEOMETRY_GAP}): "
                         "attended but unselected keys carry values aligned with the selection and "
                         "crowd the ball.")
        if not m.geometric and not m.lowering:
            notes.append(f"{run}: the value-shuffle null matches the top-N set at every headline N "
                         f"(|F∗(top) − F∗(shuffled)| < {GEOMETRY_GAP}; largest {fmt(m.max_geometry)}): "
                         "the geometry's net effect is nil; the gain over random is the attention "
                         "ranking's on values with the real norms.")
        if not m.small:
            notes.append(f"{run}: mean F∗(top) peaks at N = {m.best} on the headline range, above "
                         "the paper's 2–4.")
        raw_top, raw_random = per_n(r.f_score), per_n(r.random_f_score)
        for i in hl:
            split.append([model, corpus, str(ns[i]), fmt(m.top[i]), fmt(m.geometry[i]),
                          geometry_reading(m.geometry[i]), fmt(m.ranking[i]), fmt(m.random[i]),
                          f"{fmt(raw_top[i])} / {fmt(raw_random[i])}"])
        i2 = ns.index(2) if 2 in ns else None
        per_head = "–"
        if i2 is not None:
            gap = (r.metric("f_score_cc") - r.metric("f_score_cc", "shuffled"))[..., i2]
            gain = (r.metric("f_score_cc") - r.metric("f_score_cc", "random"))[..., i2]
            per_head = (f"{pct(fraction(gain > 0, torch.isfinite(gain)))} / "
                        f"{pct(fraction(gap > 0, torch.isfinite(gap)))}")
        detail.append([model, corpus, fmt(m.min_gain), fmt(m.max_geometry), fmt(m.min_geometry),
                       str(m.best), per_head, ticks(m.consistent), ticks(m.geometric), ticks(m.small)])
    header_ns = sorted({m.ns[i] for m in curves.values() for i in m.headline})
    rows = [[model, corpus] + [_cell(m, n) for n in header_ns] for (model, corpus), m in curves.items()]

    def draw(ax: Any, model: str, corpus: str) -> None:
        r = study.analyses[model, corpus]
        m = curves[model, corpus]
        ns = m.ns[1:] if m.ns and m.ns[0] == 1 else m.ns
        skip = len(m.ns) - len(ns)
        for k, (ys, label, style) in enumerate([(m.top, "F∗_N top-N", "o-"),
                                                (m.shuffled, "F∗_N shuffled values", "^-"),
                                                (m.random, "F∗_N random N-subset", "s--")]):
            ax.plot(ns, ys[skip:], style, color=plots.COLORS[k], label=label, ms=4)
        ax.plot(ns, per_n(r.f_score)[skip:], ":", color="0.4", label="raw F_N top-N")
        keys_r = r.metadata.get("n_positions", keys)
        ax.axvspan(keys_r / 4, max(max(ns, default=2), keys_r / 4), color="0.9", label="dense N > (t+1)/4")

    plots.grid(figures / "claim1_top_vs_random.png", study.models, study.corpus_names, draw,
               title="Mean over heads: F∗_N of top-N, shuffled-value null and random subsets",
               xlabel="N", ylabel="F∗_N")
    n_runs = len(checks["a"])
    lowers = sum(bool(m.lowering) for m in curves.values())
    because = (f"(a) F∗(top) > F∗(random) at every headline N on {sum(checks['a'])}/{n_runs} runs; "
               f"(b) geometry raises F∗ by ≥ {GEOMETRY_GAP} at some headline N on "
               f"{sum(checks['b'])}/{n_runs} (and lowers it by ≥ {GEOMETRY_GAP} at some headline N on "
               f"{lowers}/{n_runs}); (c) best headline N ≤ {SMALL_BEST} on {sum(checks['c'])}/{n_runs}.")
    return Claim(
        1, "Top-N selections are more separable than random subsets",
        "Top-N selections are consistently more separable than random subsets of the same size, "
        "especially at sparse and intermediate N; the strongest non-trivial separability is at "
        "small N.",
        RULE, verdict(checks, "a"), because,
        blocks=[
            "Mean F∗_N over heads on the headline range, top-N / shuffled values / random:",
            table(["model", "corpus"] + [f"N={n}" for n in header_ns], rows),
            "The gain split: geometry = F∗(top) − F∗(shuffled) (net, either sign), ranking = "
            "F∗(shuffled) − F∗(random):",
            table(["model", "corpus", "N", "F∗(top)", "geometry", "reading", "ranking", "F∗(random)",
                   "raw F_N top / random"], split),
            table(["model", "corpus", "min F∗ gain over random", "max geometry", "min geometry",
                   "best headline N", "heads top > random / top > shuffled at N=2", "(a)", "(b)", "(c)"],
                  detail),
            *decomposition_blocks(study),
        ],
        figures=[("claim1_top_vs_random.png",
                  "Mean F∗_N over heads (solid: top-N, shuffled-value null; dashed: random); dotted: "
                  "raw F_N of the top-N set; dense N shaded.")],
        disagreements=notes,
    )


def _cell(m: TopVsRandom, n: int) -> str:
    """``top / shuffled / random`` at ``n``, or ``–`` where ``n`` is not a headline N of the run."""
    i = m.ns.index(n) if n in m.ns else None
    if i is None or i not in m.headline:
        return "–"
    return f"{fmt(m.top[i], 2)} / {fmt(m.shuffled[i], 2)} / {fmt(m.random[i], 2)}"


def decomposition_blocks(study: Any) -> list[str]:
    """The net effect split over the decomposition nulls (SPEC §3), on the headline range: per
    run and N, F∗(top) − F∗(null) for the values, norms, directions and unselected nulls (mean
    over heads, same seed); nothing when the study analysed no decomposition null.

    The nulls' analyses are saved beside the main one and may be computed in a later run, on
    another machine: its float32 forward rounds differently, so a few near-tied top-N sets
    differ. Then each gap is taken against its own analysis's top-N set (:func:`_split_gaps`)
    and the page says by how much the two runs' F∗(top) differ.
    """
    rows = []
    kinds: list[str] = []
    apart: list[str] = []
    for model, corpus, r in runs(study):
        nulls = getattr(study, "nulls", {}).get((model, corpus))
        if not nulls:
            continue
        table_, differ = _split_gaps(r, nulls)
        if differ is not None:
            apart.append(f"{model} on {corpus}: up to {differ:.1e}")
        kinds = [c.removeprefix("top − ") for c in table_.columns if c.startswith("top − ")]
        for i in headline(r, study.config.seq_len):
            row = table_.iloc[i]
            rows.append([model, corpus, str(int(row.n)), fmt(row.top),
                         *(fmt(row[f"top − {k}"]) for k in kinds)])
    if not rows:
        return []
    blocks = [
        "The net effect decomposed (SPEC §3; each null with the same seed and 16 permutations): "
        "F∗(top) − F∗(null), mean over heads. values: every non-sink value permuted (the net effect); "
        "norms: each key keeps its direction and takes a permuted norm; directions: each key keeps "
        "its norm and takes a permuted direction; unselected: only the values outside the top-N set "
        "permuted — negative where the real unselected values crowd the ball:",
        table(["model", "corpus", "N", "F∗(top)", *(f"top − {k}" for k in kinds)], rows),
    ]
    if apart:
        blocks.append(
            "The decomposition nulls were analysed in a later run than the main analysis (another "
            "session, another machine), whose float32 forward rounds a little differently: a few "
            "near-tied top-N sets differ, "
            "so each gap is taken against its own run's top-N set (F∗(top) above is the main "
            "analysis's). The two runs' per-head F∗(top) differ by " + "; ".join(apart) + ".")
    return blocks


def _split_gaps(main: Any, nulls: dict[str, Any]) -> tuple[Any, float | None]:
    """:func:`~tl_geometry.result.null_decomposition` of the main analysis and its nulls, and
    ``None``; or, where the nulls do not share the main analysis's top-N scores but were made
    with the same layers, N, seed and permutation count (another run's forward), the net gap
    from the main analysis and each null's gap against its own top-N scores, with the largest
    per-head difference of F∗(top) between the two runs. Any other mismatch is raised."""
    try:
        return null_decomposition({main.shuffle: main, **nulls}), None
    except ValueError:
        other = next(iter(nulls.values()))
        if not (other.layers == main.layers and torch.equal(other.n_values, main.n_values)
                and all(other.metadata.get(k) == main.metadata.get(k) for k in ("seed", "shuffle_samples"))):
            raise
    net = null_decomposition({main.shuffle: main}).drop(columns="reading", errors="ignore")
    own = null_decomposition(dict(nulls))
    differ = float(other.metric("f_score_cc", "top").sub(main.metric("f_score_cc", "top")).abs().nan_to_num(0.0).max())
    return net.join(own[[c for c in own.columns if c.startswith("top − ")]]), differ
