"""Claim 4: measurements track the theoretical envelopes; sink similarity correlates with recall.

A claim about the paper's theory is decided on the paper's own bound (SPEC §8 (ii)): the verdict
reads the **sink-aware constant-norm regime envelope** of SPEC §6b (bound kind ``"predicted"``:
the regime bounds with typical values of each head's parameters). It *tracks* the measured F_N
when Spearman ρ between the envelope's mean F̲_N and the measured mean F_N across heads is high
**within each headline N** (pooling (head, N) pairs would inflate ρ through the decline every
curve shares with N), and it *predicts the best N* when its per-head argmax over the headline
range is the measured best N more often than chance (the agreement of the envelope's best Ns
shuffled across heads). The certified regime bound of §6b (the observed extremes; on long windows
its pair cosines are sampled, so it is an estimate there) is counted and shown, not used.

Our **shell certificate** (SPEC §6d; kinds ``"shell"``, K = 0, and ``"shell_n"``, K = N) is
reported beside the envelope with the same figures, labelled as ours: it never decides the
paper's claim, whether it tracks, predicts or is violated (a violation is listed as a bug).

Uncertainty (SPEC §8): the thresholded numbers — the envelope's smallest within-N ρ, its best-N
excess over chance, and ρ(c_sink, R_2); the shell's alike, reported — get 95 % BCa intervals from
a bootstrap over windows, each head's bound, F_N, R_2 and c_sink recomputed as the mean over the
drawn windows (``window_bounds``, ``window_scores``, ``window_sink``); a figure whose per-window
values the analysis does not hold has no interval and is not decided. Soundness is a theorem per
instance, not a threshold on noise: it is counted, never resampled; a violated inversion
certificate (§6a, a theorem of the paper's §3) is a bug in the measurement and makes the verdict
*not held*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tl_geometry.result import BOUND_KINDS
from tl_geometry.result.schema import names
from tl_geometry.result.tables import argmax_n
from tl_geometry.result.tracking import AGREEMENT_P, BestNAgreement, agreement_vs_chance

from . import plots
from .document import HELD, NOT_HELD, Claim, fmt, pct, table
from .intervals import (
    MISSING,
    NO_INTERVAL,
    UNDECIDED,
    Interval,
    WindowMeans,
    bootstraps,
    combine,
    decide,
    every,
    head_means,
    per_run,
    point,
    window_sink_values,
    window_values,
    with_units,
)
from .rules import HEADLINE, headline, runs, small_n
from .stats import mean, per_n, spearman

#: The paper's regime envelope (SPEC §6b), the bound the verdict reads (SPEC §8 (ii)).
ENVELOPE = "predicted"
#: Our shell certificate (SPEC §6d): reported beside the envelope, never the verdict's.
SHELLS = (("shell", "K = 0"), ("shell_n", "K = N"))
#: The lower bounds that are theorems on every input: a measured mean below one is a bug.
CERTIFICATES = ("shell", "shell_n", "inversion")
#: Of those, the paper's (§6a, from its §3): a violation makes the verdict not held.
PAPER_CERTIFICATES = ("inversion",)
#: The regime bounds of SPEC §6b, "certified" with the observed extremes of the head's data; on
#: long windows their pair cosines are sampled (``functional.bounds.MAX_PAIRS``), so they are
#: estimated, not certified: counted and shown, not used.
DIAGNOSTIC_BOUNDS = ("certified",)
TOLERANCE = 1e-9  # float rounding of the means over instances
TRACK_RHO = 0.5  # (ours) "tracks": Spearman ρ(bound, measured F_N) across heads ≥ 0.5 at every headline N
BEST_N_P = AGREEMENT_P  # (ours) "predicts the best N": agreement above chance, shuffle p ≤ 0.05
SINK_RECALL_RHO = 0.3  # (ours) "correlates": |ρ(c_sink, R_2)| ≥ 0.3
#: How the page labels the shell certificate wherever it shows it (SPEC §8 (ii)).
OURS = "ours (SPEC §6d), reported, does not decide the paper's claim"


def shell(r: Any, kind: str, metric: str = "f_score") -> Tensor:
    """The mean bound ``kind`` of ``r`` on ``metric``, ``[layer, head, n]``; NaN where the
    library has no such bound kind (a version before SPEC §6d), so the rule reads "undefined"."""
    if kind not in BOUND_KINDS:
        return torch.full_like(r.f_score, math.nan)
    return r.bound(kind, metric)


def count_violations(bound: Tensor, measured: Tensor) -> tuple[int, int]:
    """``(violations, compared)``: entries where the mean measured value is below the mean bound
    (beyond float rounding), over the entries where both are finite."""
    ok = torch.isfinite(bound) & torch.isfinite(measured)
    return int((measured[ok] < bound[ok] - TOLERANCE).sum()), int(ok.sum())


@dataclass
class BoundFit:
    """How one bound relates to the measured F_N on one run (headline range)."""

    rhos: dict[int, float]  # headline N → Spearman ρ across heads at that N (never pooled over N)
    ratio_2: float  # mean bound / mean measured F_2
    best: BestNAgreement  # same best N as measured: agreement, chance, excess, shuffle p
    means_2: tuple[float, float] = (math.nan, math.nan)  # mean bound F_2, mean measured F_2
    heads_by_n: dict[int, int] | None = None  # headline N → heads where both are finite

    @property
    def rho_min(self) -> float:
        """The smallest within-N ρ over the headline N where it is defined (NaN if none)."""
        defined = [x for x in self.rhos.values() if not math.isnan(x)]
        return min(defined) if defined else math.nan

    @property
    def rho_at(self) -> int | None:
        """The headline N of the smallest defined within-N ρ (None if none)."""
        defined = {n: x for n, x in self.rhos.items() if not math.isnan(x)}
        return min(defined, key=lambda n: (defined[n], n)) if defined else None

    @property
    def rho_heads(self) -> int:
        """The fewest heads behind a within-N ρ (0 without any)."""
        return min((self.heads_by_n or {}).values(), default=0)

    @property
    def tracks(self) -> bool:
        """ρ ≥ :data:`TRACK_RHO` at every headline N where it is defined, and at one at least."""
        return self.rho_min >= TRACK_RHO

    @property
    def predicts(self) -> bool:
        """Best-N agreement above its chance rate with a shuffle p ≤ :data:`BEST_N_P`: an
        agreement at or below chance predicts nothing."""
        return self.best.above_chance

    # The figures the page prints, by their former names.
    @property
    def agree(self) -> float:
        return self.best.agreement

    @property
    def chance(self) -> float:
        return self.best.chance

    @property
    def heads(self) -> int:
        return self.best.heads


def fit(bound: Tensor, measured: Tensor, ns: list[int], hl: list[int], best_bound: Tensor,
        best_measured: Tensor) -> BoundFit:
    """:class:`BoundFit` of ``bound`` against ``measured`` (both ``[layer, head, n]``) on the
    headline positions ``hl``: Spearman ρ across heads **within each headline N** (SPEC §6d:
    pooling (head, N) pairs inflates ρ through the shared decline with N), and the agreement of
    the per-head best N of each (NaN where undefined, as :meth:`tl_geometry.HeadAnalysis.best_n`
    gives them) next to its chance rate (the bound's best Ns shuffled across heads; seeded)."""
    rhos = {ns[i]: spearman(bound[..., i], measured[..., i]) for i in hl}
    heads = {ns[i]: int((torch.isfinite(bound[..., i]) & torch.isfinite(measured[..., i])).sum()) for i in hl}
    ratio, means = math.nan, (math.nan, math.nan)
    if 2 in ns:
        means = mean(bound[..., ns.index(2)]), mean(measured[..., ns.index(2)])
        ratio = means[0] / means[1] if means[1] > 0 else math.nan
    return BoundFit(rhos, ratio, agreement_vs_chance(best_measured, best_bound), means, heads)


@dataclass
class BoundsRun:
    """Claim 4's figures of one run."""

    violations: dict[str, tuple[int, int]]  # per bound kind, over P, R, F (diagnostics too)
    envelope: BoundFit  # the paper's regime envelope (SPEC §6b): the verdict's
    certified: BoundFit  # the certified regime bound of §6b: shown, not used
    shells: dict[str, BoundFit]  # our shell certificate (SPEC §6d): reported, never the verdict's
    sink_recall: dict[int, float]  # N → Spearman ρ(c_sink, R_N) over heads
    sink_heads: int = 0  # query heads with both c_sink and R_2 finite

    @property
    def sound(self) -> bool:
        """No measured mean below the paper's certificates (the verdict's soundness)."""
        return all(v == 0 for k, (v, _) in self.violations.items() if k in PAPER_CERTIFICATES)

    @property
    def shell_sound(self) -> bool:
        """No measured mean below our shell certificate (reported, never the verdict's)."""
        return all(v == 0 for k, (v, _) in self.violations.items() if k in dict(SHELLS))

    @property
    def tracks(self) -> bool:
        return self.envelope.tracks

    @property
    def predicts(self) -> bool:
        return self.envelope.predicts

    @property
    def correlates(self) -> bool:
        return abs(self.sink_recall.get(2, math.nan)) >= SINK_RECALL_RHO


def measure(r: Any, default_keys: int | None = None) -> BoundsRun:
    """Claim 4's figures of one analysis (computed with ``bounds=True``)."""
    ns, hl = r.n_values.tolist(), headline(r, default_keys)
    violations = {}
    for kind in (k for k in CERTIFICATES + DIAGNOSTIC_BOUNDS if k in BOUND_KINDS):
        counts = [count_violations(r.bound(kind, m), getattr(r, m)) for m in ("precision", "recall", "f_score")]
        violations[kind] = (sum(c[0] for c in counts), sum(c[1] for c in counts))
    best = r.best_n()  # the library's best N over the headline range (SPEC §6d)
    measured_best = _column(best, "measured_best_n")

    def against(kind: str) -> BoundFit:
        predicted_best = (_column(best, f"{kind}_best_n") if f"{kind}_best_n" in best
                          else argmax_n(r, shell(r, kind), bound=True).flatten())
        return fit(shell(r, kind), r.f_score, ns, hl, predicted_best, measured_best)

    i2 = ns.index(2) if 2 in ns else None
    recall_2 = r.recall[..., i2] if i2 is not None else torch.full(r.sink_cosine.shape, math.nan)
    sink_heads = int((torch.isfinite(r.sink_cosine) & torch.isfinite(recall_2)).sum())
    return BoundsRun(violations, against(ENVELOPE), against("certified"),
                     {kind: against(kind) for kind, _ in SHELLS},
                     {n: spearman(r.sink_cosine, r.recall[..., i]) for n, i in small_n(r, default_keys)},
                     sink_heads)


@per_run
def intervals(r: Any, default_keys: int | None = None) -> dict[str, Interval] | None:
    """95 % BCa intervals over windows (SPEC §8) of what claim 4's rule thresholds: for the
    envelope (``"predicted"``) and each shell kind, ``"<kind> rho"`` (the smallest within-N
    ρ(bound, F_N) across heads over the headline N) and ``"<kind> excess"`` (best-N agreement −
    chance); and ``"sink rho"`` (ρ(c_sink, R_2) across heads). Each resample recomputes every
    head's means over the drawn windows, heads fixed. A bound kind whose per-window values the
    analysis does not hold (no ``window_bounds``, or a saved file that kept other slices: all NaN)
    has no keys; ``None`` where the analysis holds no per-window scores or sink figures."""
    f_score, recall = window_values(r, "f_score"), window_values(r, "recall")
    cosine = window_sink_values(r, "cosine")
    if f_score is None or recall is None or cosine is None:
        return None
    ns, hl = r.n_values.tolist(), headline(r, default_keys)
    bounds = getattr(r, "window_bounds", None)
    kinds: dict[str, Tensor] = {}
    if bounds is not None:
        f_index = names()["bound_metric"].index("f_score")
        for kind in (ENVELOPE, *(k for k, _ in SHELLS)):
            if kind in BOUND_KINDS:
                values = bounds[:, BOUND_KINDS.index(kind), f_index].double()
                if bool(torch.isfinite(values).any()):
                    kinds[kind] = values
    i2 = ns.index(2) if 2 in ns else None

    f_means, recall_means, cosine_means = WindowMeans(f_score), WindowMeans(recall), WindowMeans(cosine)
    bound_means = [WindowMeans(b) for b in kinds.values()]

    def figures(idx: Tensor) -> Tensor:
        f = head_means(f_means, idx)
        out = []
        for b in bound_means:
            bound = head_means(b, idx)
            rhos = [x for x in (spearman(bound[..., i], f[..., i]) for i in hl) if not math.isnan(x)]
            best = agreement_vs_chance(argmax_n(r, f, bound=False), argmax_n(r, bound, bound=True), n_shuffles=1)
            out += [min(rhos) if rhos else math.nan, best.excess]
        r2 = head_means(recall_means, idx)[..., i2] if i2 is not None else torch.full(f.shape[:-1], math.nan)
        out.append(spearman(head_means(cosine_means, idx), r2))
        return torch.tensor(out, dtype=torch.float64)

    keys = [f"{kind} {what}" for kind in kinds for what in ("rho", "excess")] + ["sink rho"]
    return dict(zip(keys, bootstraps(figures, len(f_score))))


def bound_checks(spread: dict[str, Interval] | None, kind: str, f: BoundFit) -> tuple[str, str]:
    """``(tracks, predicts)`` of bound ``kind`` on its intervals (SPEC §8): *tracks* where the
    whole interval of the smallest within-N ρ is ≥ :data:`TRACK_RHO`, *predicts* where the whole
    interval of the best-N excess over chance is ≥ 0; each too few below 8 heads behind it, not
    held where the bound is undefined on every head (it orders no heads, names no best N), no
    interval where the analysis holds no per-window values of the bound."""
    if spread is None or f"{kind} rho" not in spread:
        return NO_INTERVAL, NO_INTERVAL
    rho = with_units(spread[f"{kind} rho"], f.rho_heads)
    excess = with_units(spread[f"{kind} excess"], f.best.heads)
    return _defined(rho, lambda i: decide(i, low=TRACK_RHO)), _defined(excess, lambda i: decide(i, low=0.0))


def _defined(interval: Interval, rule: Any) -> str:
    """``rule(interval)``, but not held where the statistic is undefined on the full sample of
    enough units (a bound equal at every head orders none of them) and too few where the units
    are."""
    if interval.too_few:
        return rule(interval)
    if math.isnan(interval.value):
        return NOT_HELD
    return rule(interval)


def _magnitude(interval: Interval, threshold: float) -> str:
    """``|x| ≥ threshold`` on ``interval``: held where the whole interval lies beyond ±threshold on
    one side, not held where it lies strictly inside, undecided otherwise (too few as
    :func:`.intervals.decide`)."""
    if interval.too_few or math.isnan(interval.low):
        return decide(interval)
    if interval.low >= threshold or interval.high <= -threshold:
        return HELD
    if -threshold < interval.low and interval.high < threshold:
        return NOT_HELD
    return UNDECIDED


def _column(frame: Any, name: str) -> Tensor:
    """A float column of ``frame`` as a tensor; NaN where the frame lacks it (no such bound)."""
    if name not in frame:
        return torch.full((len(frame),), math.nan, dtype=torch.float64)
    return torch.tensor(frame[name].to_numpy(dtype=float))


RULE4 = (
    "Bounds of SPEC §6 per (head, N), each the mean over windows; a model with sliding-window "
    "layers is two runs, its global and its local layers (SPEC §8 (i)). The claim is about the "
    "paper's theory, so it is decided on the paper's own bound (SPEC §8 (ii)): the sink-aware "
    "constant-norm regime envelope of SPEC §6b (the regime bounds with typical values of each "
    "head's parameters). *Tracks* (ours): Spearman ρ between the envelope's F̲_N and the measured "
    f"F_N **across heads within each headline N** ({HEADLINE}) is ≥ {TRACK_RHO} at every such N "
    "where it is defined, and at one at least (pooling (head, N) pairs would inflate ρ through the "
    "decline every curve shares with N; an envelope equal at every head orders none of them). "
    "*Predicts the best N* (ours): per head, the headline N of the largest envelope value "
    "(undefined where it is 0 at every headline N) equals the headline N of the largest measured "
    "F_N more often than chance — the agreement expected if the envelope's best Ns were shuffled "
    "across the same heads, Σ_n p_measured(n) p_envelope(n); the shuffle p over 1000 seeded "
    "shuffles is printed beside it; an agreement at or below chance predicts nothing, however "
    "high. *Sink similarity correlates with recall* (ours): |Spearman ρ(c_sink, R_2)| across query "
    f"heads ≥ {SINK_RECALL_RHO}, with one sign on every run (R_2 reads α, so the unit is the query "
    "head; c_sink repeats inside a KV group). *Sound*: no measured mean P, R, F falls below the "
    "mean inversion certificate (§6a) at any head and N (a theorem per instance; a violation is a "
    "bug in the measurement and makes the verdict *not held*). Our shell certificate (SPEC §6d, K "
    "= 0 and K = N) gets the same figures and is reported beside the envelope — "
    f"{OURS}: whether it tracks, predicts or is violated changes no verdict. The certified regime "
    "bound of §6b (the observed extremes; an estimate on long windows, where its pair cosines are "
    "sampled) is counted and shown, not used. Uncertainty (SPEC §8, ours): the smallest within-N "
    "ρ, the best-N excess over chance (agreement − chance) and ρ(c_sink, R_2) each get a 95 % BCa "
    "interval from 1,000 seeded bootstrap resamples of the windows, every head's means recomputed "
    "from the drawn windows, heads fixed, printed with its n of windows and heads; *tracks* holds "
    f"where the whole interval is ≥ {TRACK_RHO}, *predicts* where the whole excess interval is ≥ "
    f"0, the correlation where the whole interval lies beyond ±{SINK_RECALL_RHO} on one side; each "
    "fails where none of its interval satisfies it and is undecided otherwise; fewer than 8 "
    "windows or heads behind a figure: too few, no verdict; a figure whose per-window values were "
    "not kept: no interval, not decided. Soundness is counted, never resampled. Held: all on every "
    "run; not held: *tracks* on no run, or a violated inversion certificate; else partly held "
    "(undecided where the intervals leave both open)."
)


def claim4(study: Any, figures: Path) -> Claim:
    """The paper's regime envelope (SPEC §6b) against the measured F_N, which decides; our shell
    certificate (§6d) beside it, reported; c_sink vs recall."""
    checks: dict[str, list[str]] = {"sound": [], "tracks": [], "predicts": [], "sink_recall": []}
    ours: dict[str, list[str]] = {"sound": [], "tracks": [], "predicts": []}
    rows, shell_rows, diagnostics, signs, notes, per_n_rows = [], [], [], [], [], []
    keys = study.config.seq_len
    for model, corpus, r in runs(study):
        b = measure(r, keys)
        spread = intervals(r, keys)
        env = b.envelope
        run = f"{model} on {corpus}"
        n_windows = _windows(r)
        windows = f"{n_windows} windows" if n_windows else "no per-window values"
        checks["sound"].append(point(b.sound))
        tracks, predicts = bound_checks(spread, ENVELOPE, env)
        checks["tracks"].append(tracks)
        checks["predicts"].append(predicts)
        if spread is None:
            sink_rho = Interval(b.sink_recall.get(2, math.nan), math.nan, math.nan, 0)
            checks["sink_recall"].append(NO_INTERVAL)
        else:
            sink_rho = with_units(spread["sink rho"], b.sink_heads)
            checks["sink_recall"].append(_magnitude(sink_rho, SINK_RECALL_RHO))
        signs.append(_sign(sink_rho) if spread is not None else 0)
        shell_checks = [bound_checks(spread, k, b.shells[k]) for k, _ in SHELLS]
        ours["sound"].append(point(b.shell_sound))
        ours["tracks"].append(every([t for t, _ in shell_checks]))
        ours["predicts"].append(every([p for _, p in shell_checks]))

        for kind, (v, total) in b.violations.items():
            if v and kind in PAPER_CERTIFICATES:
                notes.append(f"{run}: {v} of {total} measured means fall below the {kind} certificate "
                             "(a bug in the measurement; the verdict is not held).")
            elif v and kind in CERTIFICATES:
                notes.append(f"{run}: {v} of {total} measured means fall below our {kind} certificate "
                             "(a bug; SPEC §6d is ours and decides no verdict).")
            elif v:
                notes.append(f"{run}: {v} of {total} measured means fall below the {kind} regime bound "
                             "(estimated from sampled pair cosines at this length; a diagnostic).")
        if spread is not None and f"{ENVELOPE} rho" not in spread:
            notes.append(f"{run}: the analysis holds no per-window values of the §6b envelope, so its "
                         "figures have no interval and are not decided (SPEC §8); the point values "
                         "are shown.")
        elif spread is None:
            notes.append(f"{run}: the analysis holds no per-window values, so claim 4's figures have "
                         "no interval and are not decided (SPEC §8); the point values are shown.")
        if tracks != HELD:
            verb = ("does not track the measured F_N" if tracks == NOT_HELD
                    else f"is not shown to track the measured F_N ({tracks})")
            notes.append(f"{run}: the paper's regime envelope (SPEC §6b) {verb}: mean envelope / "
                         f"measured F_2 = {fmt(env.means_2[0])} / "
                         f"{fmt(env.means_2[1])}; Spearman ρ across heads within each headline N: "
                         f"{_rhos(env)}; smallest {_show(spread, f'{ENVELOPE} rho', env.rho_min, env.rho_heads)} "
                         f"({windows}).")
        if predicts != HELD:
            notes.append(f"{run}: the §6b envelope gives the measured best N for {_agreement(env.best)}; "
                         f"excess over chance {_show(spread, f'{ENVELOPE} excess', env.best.excess, env.best.heads)} "
                         f"({windows}): "
                         + ("not above chance, so it predicts nothing." if predicts == NOT_HELD
                            else f"not shown to exceed chance ({predicts})."))
        if checks["sink_recall"][-1] == NOT_HELD:
            notes.append(f"{run}: c_sink and R_2 are only weakly correlated (ρ = {sink_rho.show()}; "
                         f"{windows}, {b.sink_heads} heads).")

        sound = [b.violations[k] for k in PAPER_CERTIFICATES if k in b.violations]
        respected = sum(t - v for v, t in sound), sum(t for _, t in sound)
        rows.append([model, corpus, str(n_windows or "–"), f"{fmt(env.means_2[0])} / {fmt(env.means_2[1])}",
                     _show(spread, f"{ENVELOPE} rho", env.rho_min, env.rho_heads)
                     + (f"; at N = {env.rho_at}" if env.rho_at is not None else ""),
                     _agreement(env.best), _show(spread, f"{ENVELOPE} excess", env.best.excess, env.best.heads),
                     _show(spread, "sink rho", b.sink_recall.get(2, math.nan), b.sink_heads,
                           sink_rho if spread is not None else None),
                     tracks, predicts, checks["sink_recall"][-1], f"{respected[0]}/{respected[1]}"])
        shell_fits = [b.shells[k] for k, _ in SHELLS]
        shell_sound = [b.violations[k] for k, _ in SHELLS if k in b.violations]
        shell_rows.append([model, corpus, str(n_windows or "–"),
                           f"{sum(t - v for v, t in shell_sound)}/{sum(t for _, t in shell_sound)}"]
                          + [_show(spread, f"{k} rho", f.rho_min, f.rho_heads) for (k, _), f in zip(SHELLS, shell_fits)]
                          + [fmt(f.ratio_2) for f in shell_fits]
                          + [f"{_agreement(f.best)}; excess {_show(spread, f'{k} excess', f.best.excess, f.best.heads)}"
                             for (k, _), f in zip(SHELLS, shell_fits)]
                          + [ours["tracks"][-1], ours["predicts"][-1]])
        for n in env.rhos:
            i = r.n_values.tolist().index(n)
            per_n_rows.append([model, corpus, str(n), str((env.heads_by_n or {}).get(n, 0)),
                               f"{fmt(mean(r.bound(ENVELOPE)[..., i]))} / {fmt(mean(r.f_score[..., i]))}",
                               fmt(env.rhos[n]), fmt(b.certified.rhos[n])]
                              + [fmt(f.rhos[n]) for f in shell_fits])
        diagnostics.append([model, corpus] + [f"{t - v}/{t}" for v, t in b.violations.values()]
                           + [f"{fmt(b.certified.means_2[0])} / {fmt(b.certified.means_2[1])}"]
                           + [fmt(b.sink_recall.get(n, math.nan)) for n in (4, 8)])
    if len({s for s in signs if s}) > 1:
        checks["sink_recall"] = [NOT_HELD] * len(signs)
        notes.append("The sign of ρ(c_sink, R_2) differs between runs.")
    result = combine(checks, "tracks")
    if NOT_HELD in checks["sound"]:
        result = NOT_HELD
    _figures(study, figures, keys)

    because = (f"the paper's regime envelope (SPEC §6b) tracks the measured F_N across heads (ρ ≥ "
               f"{TRACK_RHO} within every headline N) on {_tally(checks['tracks'])}; gives the measured "
               f"best N more often than chance on {_tally(checks['predicts'])}; |ρ(c_sink, R_2)| ≥ "
               f"{SINK_RECALL_RHO} with one sign on {_tally(checks['sink_recall'])}; each on its 95 % BCa "
               f"interval over windows; the inversion certificate (§6a) never violated on "
               f"{_tally(checks['sound'])}. The shell certificate — {OURS} — tracks the measured F_N "
               f"(K = 0 and K = N) on {_tally(ours['tracks'])}, gives the best N more often than chance "
               f"on {_tally(ours['predicts'])} and is never violated on {_tally(ours['sound'])}.")
    kinds = [k for k in CERTIFICATES + DIAGNOSTIC_BOUNDS if k in BOUND_KINDS]
    return Claim(
        4, "Measurements track the theoretical bounds; sink similarity correlates with recall",
        "Measurements track the theoretical envelopes; sink similarity correlates with recall.",
        RULE4, result, because,
        blocks=[
            "The paper's regime envelope (SPEC §6b), which decides the claim: its mean F̲_2 against "
            "the measured mean F_2, the smallest within-N Spearman ρ across heads (at which N, and "
            "the heads behind it), the per-head best-N agreement next to its chance rate and the "
            "excess over chance (with the heads where both best Ns are defined), ρ(c_sink, R_2), "
            "each with its 95 % BCa interval over the windows counted here:",
            table(["model", "corpus", "windows", "envelope / measured F_2",
                   "smallest ρ(envelope, F_N) within N [95 %]", "same best N as measured (envelope)",
                   "best-N excess over chance [95 %]", "ρ(c_sink, R_2) [95 %]", "tracks", "predicts",
                   "c_sink–R_2", "inversion certificate respected"], rows),
            "Spearman ρ between each bound and the measured F_N across heads, at each headline N; "
            "the *tracks* rule reads the smallest ρ of the §6b envelope. The certified regime bound "
            f"(§6b) is shown, not used; the shell columns are {OURS}:",
            table(["model", "corpus", "N", "heads", "mean envelope / measured F_N",
                   "ρ(§6b envelope, F_N)", "ρ(§6b certified, F_N)", "ρ(shell K=0, F_N), ours",
                   "ρ(shell K=N, F_N), ours"], per_n_rows),
            f"The shell certificate (K = 0 and K = N) — {OURS}: the same figures as the "
            "envelope's, on the same windows, and the outcomes its rule would give:",
            table(["model", "corpus", "windows", "shell respected", "smallest ρ within N, K=0 [95 %]",
                   "smallest ρ within N, K=N [95 %]", "shell K=0 / F_2", "shell K=N / F_2",
                   "same best N, K=0", "same best N, K=N", "tracks (ours)", "predicts (ours)"], shell_rows),
            "Diagnostics (not the verdict): each bound's respected means (P, R, F at every head "
            "and N; the certified regime bound of §6b samples its pair cosines on long windows, so "
            "it is an estimate there), the certified regime bound's mean F̲_2 / measured F_2, and "
            "ρ(c_sink, R_N) at N = 4, 8 (point values):",
            table(["model", "corpus"] + [f"{k} respected" for k in kinds]
                  + ["certified regime bound / measured F_2", "ρ(c_sink, R_4)", "ρ(c_sink, R_8)"], diagnostics),
        ],
        figures=[("claim4_envelopes.png", "Mean over heads of the measured F_N, the §6b regime "
                  "envelope (the verdict's bound) and the lower bounds; dense N shaded."),
                 ("claim4_bounds_vs_measured.png", "Each point a (head, headline N): the §6b envelope "
                  "(the verdict's bound) and our shell certificate (reported) against the measured "
                  "F_N; on the diagonal the bound would be tight."),
                 ("claim4_sink_recall.png", "Each point a head.")],
        disagreements=notes,
    )


def _windows(r: Any) -> int:
    """The number of windows behind the analysis's intervals (0 without per-window values)."""
    scores = getattr(r, "window_scores", None)
    return int(scores.shape[0]) if scores is not None else 0


def _show(spread: dict[str, Interval] | None, key: str, value: float, heads: int,
          interval: Interval | None = None) -> str:
    """``key``'s interval where there is one (``interval`` if given), else the point ``value``
    marked as such, with the heads behind it."""
    if interval is None and spread is not None and key in spread:
        interval = with_units(spread[key], heads)
    shown = interval.show() if interval is not None else f"{fmt(value)} (no interval)"
    return f"{shown}; {heads} heads"


def _rhos(f: BoundFit) -> str:
    """``"N = 2: -0.330, N = 4: 0.120 (below 0.5 at N = 2, 4)"``."""
    listed = ", ".join(f"N = {n}: {fmt(x)}" for n, x in f.rhos.items())
    below = [str(n) for n, x in f.rhos.items() if x < TRACK_RHO]
    undefined = [str(n) for n, x in f.rhos.items() if math.isnan(x)]
    extra = []
    if below:
        extra.append(f"below {TRACK_RHO} at N = {', '.join(below)}")
    if undefined:
        extra.append(f"undefined (the envelope equal at every head) at N = {', '.join(undefined)}")
    return listed + (f" ({'; '.join(extra)})" if extra else "")


def _tally(outcomes: list[str]) -> str:
    """``held/all runs``, with the undecided ones and those without a verdict."""
    held, undecided = outcomes.count(HELD), outcomes.count(UNDECIDED)
    none = sum(o in MISSING for o in outcomes)
    extra = [f"{undecided} undecided"] * bool(undecided) + [
        f"{none} without a verdict: too few windows or heads, or no per-window values"] * bool(none)
    return f"{held}/{len(outcomes)} runs" + (f" ({'; '.join(extra)})" if extra else "")


def _sign(interval: Interval) -> int:
    """The sign of ρ where it is settled: the whole interval on one side of 0 (the point value's
    sign where there is no interval), else 0."""
    if math.isnan(interval.value):
        return 0
    if math.isnan(interval.low):
        return 0 if interval.too_few else int(math.copysign(1, interval.value))
    if interval.low > 0 or interval.high < 0:
        return 1 if interval.low > 0 else -1
    return 0


def _agreement(best: BestNAgreement) -> str:
    """``"64.8 % (chance 58.2 %, +6.6 points, p = 0.012; 270 heads)"``."""
    if not best.heads:
        return "undefined (0 heads)"
    return (f"{pct(best.agreement)} (chance {pct(best.chance)}, {100 * best.excess:+.1f} points, "
            f"p = {best.p_value:.3f}; {best.heads} heads)")


def _figures(study: Any, figures: Path, keys: int) -> None:
    """Claim 4's three figures."""

    def curves(ax: Any, model: str, corpus: str) -> None:
        r = study.analyses[model, corpus]
        ns = r.n_values.tolist()
        skip = 1 if ns and ns[0] == 1 else 0
        series = [("measured F_N", r.f_score, "o-"),
                  ("§6b regime envelope (the verdict's)", shell(r, ENVELOPE), "s-"),
                  ("shell K = N (ours, reported)", shell(r, "shell_n"), "^--"),
                  ("shell K = 0 (ours, reported)", shell(r, "shell"), "v--"),
                  ("inversion certificate", r.bound("inversion"), "--"),
                  ("§6b certified regime bound", shell(r, "certified"), ":")]
        for k, (label, values, style) in enumerate(series):
            ax.plot(ns[skip:], per_n(values)[skip:], style, color=plots.COLORS[k], label=label, ms=4)
        t1 = r.metadata.get("n_positions", keys)
        ax.axvspan(t1 / 4, max(ns[-1], t1 / 4), color="0.9", label="dense N > (t+1)/4")

    def bound_scatter(ax: Any, model: str, corpus: str) -> None:
        r = study.analyses[model, corpus]
        hl = headline(r, keys)
        measured = r.f_score[..., hl].flatten()
        for k, (kind, label) in enumerate([(ENVELOPE, "§6b envelope (the verdict's)"),
                                           *((kind, f"shell {label} (ours)") for kind, label in SHELLS)]):
            ax.scatter(measured, shell(r, kind)[..., hl].flatten(), s=6, alpha=0.5,
                       color=plots.COLORS[k + 1], label=label)
        ax.plot([0, 1], [0, 1], color="0.5", lw=0.8)

    def sink_scatter(ax: Any, model: str, corpus: str) -> None:
        r = study.analyses[model, corpus]
        i = r.n_values.tolist().index(2)
        ax.scatter(r.sink_cosine.flatten(), r.recall[..., i].flatten(), s=9, color=plots.COLORS[0])

    plots.grid(figures / "claim4_envelopes.png", study.models, study.corpus_names, curves,
               title="Mean over heads: measured F_N, the §6b envelope and the lower bounds",
               xlabel="N", ylabel="F_N")
    plots.grid(figures / "claim4_bounds_vs_measured.png", study.models, study.corpus_names,
               bound_scatter, title="Per head and headline N: §6b envelope and shell bound vs measured F_N",
               xlabel="measured F_N", ylabel="bound", logx=False)
    plots.grid(figures / "claim4_sink_recall.png", study.models, study.corpus_names, sink_scatter,
               title="Per head: c_sink vs recall R_2", xlabel="c_sink", ylabel="R_2", logx=False)
