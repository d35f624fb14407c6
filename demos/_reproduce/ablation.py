"""Claim 6: head removal guided by the taxonomy vs single-metric baselines (SPEC §7).

Uses :mod:`tl_geometry.ablation`. Per model, on WikiText text disjoint from the analysed windows
(its last quarter): the single-head sensitivity sweep and the entropy order on one set of
windows, then structured sparsification curves on another set, for the taxonomy order (built from
the WikiText analysis of the main study), weight magnitude, attention entropy, random orders and
the sensitivity oracle. Zero ablation of ``hook_z``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

import tl_geometry
from tl_geometry import ablation as api
from tl_geometry.functional.uncertainty import critical_threshold, window_mean

from . import plots
from .corpora import Corpus
from .document import HELD, NOT_HELD, PARTLY, Claim, fmt, table
from .intervals import (
    NO_INTERVAL,
    NOT_MEASURED,
    TOO_FEW,
    UNDECIDED,
    Interval,
    bootstraps,
    categorize,
    combine,
    decide,
    every,
    median_of,
    per_run,
    some,
)
from .losses import tally
from .protocol import StudyConfig, beside, windows
from .saved import TABLES_SHA256, load_windows, save_windows

MODERATE = (0.9, 0.75)  # retentions where the taxonomy should be "a useful coarse signal"
AGGRESSIVE = (0.5, 0.25)  # where it should not beat every single-metric baseline
BASELINES = ("weight_norm", "entropy")  # the single-metric orders
BREAKS_MODEL = 1.0  # (ours, reported only) a single-head loss increase ≥ 1 nat "breaks" the model
LOWER, HIGHER = "lower", "higher"
#: A loss change read against 0 (SPEC §8 (iv)): each direction on its own interval rule.
SIGN = ((LOWER, -math.inf, 0.0), (HIGHER, 0.0, math.inf))
#: In a row list of :func:`curve_intervals`: the unablated model's held-out loss.
DENSE = -1


def describe(config: StudyConfig) -> str:
    return (f"zero ablation of `hook_z`; head sensitivity and the entropy order on "
            f"{config.ablation_windows} windows × {config.ablation_seq_len} tokens, sparsification "
            f"curves on {config.ablation_windows} other windows, both from WikiText's last quarter "
            f"(disjoint from the analysed windows); {config.random_orderings} random orders.")


def run(model: Any, analysis: tl_geometry.HeadAnalysis, corpus: Corpus, config: StudyConfig, *,
        progress: bool = True) -> dict[str, Any]:
    """Sensitivity sweep, removal orders and sparsification curves of one model (tables)."""
    tokens = windows(model, corpus, 2 * config.ablation_windows, config.ablation_seq_len)
    rank, held_out = tokens[: config.ablation_windows], tokens[config.ablation_windows:]
    sensitivity = api.head_sensitivity(model, rank, "zero", progress=progress)
    orders = api.head_orderings(model, rank, analysis=analysis, sensitivity=sensitivity,
                                seeds=tuple(range(config.random_orderings)), progress=progress)
    curve = api.sparsification_curve(model, held_out, orders, progress=progress)
    per_window = {"sensitivity": sensitivity.window_loss, "base": sensitivity.base_window_loss,
                  "weight": sensitivity.window_weight, "curve": curve.window_loss,
                  "held_out_base": curve.base_window_loss, "held_out_weight": curve.window_weight}
    return {"sensitivity": sensitivity.to_pandas(), "curve": curve.to_pandas(), "windows": per_window,
            "base_loss": sensitivity.base_loss, "held_out_base_loss": curve.base_loss}


def taxonomy_heads(analysis: tl_geometry.HeadAnalysis) -> list[list[int]]:
    """The taxonomy removal order ``analysis`` gives, as saved with the tables ([layer, head]
    pairs, first removed first): saved tables are reused only where today's analysis gives the
    same order."""
    return [list(head) for head in api.taxonomy_order(analysis).heads]


def save(tables: dict[str, Any], path: Path) -> None:
    """Write one model's ablation tables: two CSV files, a JSON of the base losses and the
    study options, and the per-window losses (``.windows.pt``) the intervals resample: the
    sensitivity sweep's ``[layer, head, window]`` and the curve's ``[row, window]`` (rows in the
    curve table's order), each with its dense losses and prediction counts; the JSON records the
    side file's SHA-256 (:func:`.saved.save_windows`)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    # The record goes first and comes back last: a save cut short leaves no tables to reuse.
    beside(path, ".json").unlink(missing_ok=True)
    tables["sensitivity"].to_csv(beside(path, ".sensitivity.csv"), index=False)
    tables["curve"].to_csv(beside(path, ".curve.csv"), index=False)
    keys = ("base_loss", "held_out_base_loss", "options", "seconds", "threads", "date", "accelerator",
            "window_start", "taxonomy_order")
    record = {k: tables.get(k) for k in keys}
    record[TABLES_SHA256] = save_windows(tables.get("windows"), beside(path, ".windows.pt"))
    beside(path, ".json").write_text(json.dumps(record))


def load(path: Path) -> dict[str, Any] | None:
    """Tables written by :func:`save`, or None when absent. ``windows`` is None for tables saved
    before the per-window losses were kept, or whose side file is missing (then the study
    computes them again); a side file that does not match the checksum the JSON records, or
    cannot be read, raises :class:`.saved.SideFileError` (:func:`.saved.load_windows`)."""
    import json

    if not beside(path, ".json").exists():
        return None
    out = json.loads(beside(path, ".json").read_text())
    out["sensitivity"] = pd.read_csv(beside(path, ".sensitivity.csv"))
    out["curve"] = pd.read_csv(beside(path, ".curve.csv"))
    out["windows"] = load_windows(out, beside(path, ".windows.pt"), beside(path, ".json"))
    return out


def _rows(curve: pd.DataFrame, ordering: str, retention: float) -> list[int]:
    """Positions (in the saved table's order, which the per-window losses follow) of the rows of
    ``ordering`` at ``retention``: one per seed for the random orders."""
    hit = (curve.ordering == ordering) & ((curve.retention - retention).abs() < 1e-9)
    return [i for i, h in enumerate(hit.tolist()) if h]


def _loss(curve: pd.DataFrame, ordering: str, retention: float) -> float:
    rows = curve.loss.iloc[_rows(curve, ordering, retention)]
    return float(rows.mean()) if len(rows) else math.nan


def _range(curve: pd.DataFrame, ordering: str, retention: float) -> tuple[float, float]:
    """Smallest and largest loss over the seeds of ``ordering`` at ``retention``."""
    rows = curve.loss.iloc[_rows(curve, ordering, retention)]
    return (float(rows.min()), float(rows.max())) if len(rows) else (math.nan, math.nan)


def sign(interval: Interval) -> str:
    """A loss change read against 0 on its 95 % interval (SPEC §8 (iv)): ``"lower"`` where the
    whole interval lies below 0, ``"higher"`` where it lies above, undecided where it holds 0,
    too few below 8 windows."""
    outcome = categorize(interval, SIGN)
    return UNDECIDED if outcome.startswith(UNDECIDED) else outcome


def curve_intervals(tables: dict[str, Any],
                    spec: Sequence[tuple[Sequence[int], Sequence[int] | None]]) -> list[Interval] | None:
    """For each ``(plus, minus)`` of ``spec``: the mean held-out loss of the curve rows ``plus``
    minus the mean of the rows ``minus`` (``None``: nothing subtracted; :data:`DENSE` stands for
    the unablated model), with its BCa 95 % interval over the held-out windows (SPEC §8). Every
    resample recomputes each row's loss, and the unablated one, as the prediction-weighted mean
    over the drawn windows. NaN where ``plus`` or a given ``minus`` is empty; None for tables saved
    without per-window losses."""
    per_window = tables.get("windows")
    if per_window is None:
        return None
    loss, base, weight = per_window["curve"], per_window["held_out_base"], per_window["held_out_weight"]
    nan = torch.tensor(math.nan, dtype=torch.float64)

    def statistic(idx: torch.Tensor) -> torch.Tensor:
        rows = torch.cat([window_mean(loss, weight, idx), window_mean(base, weight, idx)[None]])
        out = []
        for plus, minus in spec:
            if not plus or (minus is not None and not minus):
                out.append(nan)
            else:
                out.append(rows[list(plus)].mean() - (rows[list(minus)].mean() if minus else 0.0))
        return torch.stack(out)

    return bootstraps(statistic, loss.shape[-1])


@per_run
def order_losses(tables: dict[str, Any]) -> dict[tuple[str, float], Interval] | None:
    """Each order's held-out loss at each retention (the random orders: the mean over their
    seeds) with its 95 % interval over the held-out windows; None without per-window losses."""
    curve = tables["curve"]
    keys = [(name, r) for name in dict.fromkeys(curve.ordering) for r in sorted(set(curve.retention), reverse=True)]
    intervals = curve_intervals(tables, [(_rows(curve, name, r), None) for name, r in keys])
    return None if intervals is None else dict(zip(keys, intervals))


def _windows(interval: Interval, which: str) -> str:
    return f"{interval.n} {which} window" + "s" * (interval.n != 1)


def below_dense(model: str, tables: dict[str, Any], heads: list[Interval] | None = None) -> list[str]:
    """A note for each order whose held-out loss minus the unablated model's (paired over the
    held-out windows) is not above 0 on its whole 95 % interval at some retention below 1: lower
    there (the whole interval below 0: removing those heads helps the model on that text) or
    undecided (the interval holds 0), each with its interval and n of windows (SPEC §8 (iv)).
    For the oracle order (the smallest single-head point estimate removed first) the note adds
    how many heads lower, and raise, the ablation windows' loss on their whole interval when
    removed alone (``heads``: :func:`head_intervals`), and how many are undecided. Nothing for
    tables without per-window losses or with too few windows."""
    curve = tables["curve"]
    names = list(dict.fromkeys(curve.ordering))
    retentions = [r for r in sorted(set(curve.retention), reverse=True) if r < 1]
    keys = [(name, r) for name in names for r in retentions]
    intervals = curve_intervals(tables, [(_rows(curve, name, r), [DENSE]) for name, r in keys])
    if intervals is None:
        return []
    notes = []
    for name in names:
        cells = [(r, iv, sign(iv)) for (n, r), iv in zip(keys, intervals)
                 if n == name and sign(iv) in (LOWER, UNDECIDED)]
        if not cells:
            continue
        seeds = curve[curve.ordering == name].seed.nunique()
        label = (f"random orders' mean held-out loss ({seeds} seeds)" if name == "random"
                 else f"{name} order's held-out loss")
        parts = "; ".join(
            f"{iv.show()} nats at retention {r:g}, "
            + ("lower on its whole interval" if outcome == LOWER else "undecided (the interval holds 0)")
            for r, iv, outcome in cells)
        note = (f"{model}: the {label} minus the unablated model's, 95 % BCa interval "
                f"over the same {_windows(cells[0][1], 'held-out')}: {parts}.")
        if name == "oracle" and heads is not None:
            note += " " + head_signs(heads, int(tables["sensitivity"]["head"].max() + 1))
        notes.append(note)
    return notes


def head_signs(heads: list[Interval], n_heads: int) -> str:
    """How many heads lower, and raise, the ablation windows' loss when removed alone, each on its
    whole 95 % interval (SPEC §8 (iv): never a count of point estimates), how many are undecided
    (and too few), and the largest decrease among the lowering ones with its interval."""
    outcomes = [sign(iv) for iv in heads]
    lower = [i for i, o in enumerate(outcomes) if o == LOWER]
    n = heads[0].n if heads else 0
    text = (f"On the {_windows(heads[0], 'ablation') if heads else '0 ablation windows'}, "
            f"{len(lower)} of {len(heads)} heads lower the loss when removed alone on their whole "
            f"95 % interval, {outcomes.count(HIGHER)} raise it on theirs and "
            f"{outcomes.count(UNDECIDED)} are undecided")
    if outcomes.count(TOO_FEW):
        text += f" ({outcomes.count(TOO_FEW)} with too few windows: n = {n})"
    if lower:
        most = min(lower, key=lambda i: heads[i].value)
        text += (f"; the largest decrease among them is L{most // n_heads}H{most % n_heads}'s "
                 f"{heads[most].show()} nats")
    return (text + ". Each head is removed alone; the oracle order removes heads by their "
            "single-head point estimate, smallest first, and its sparsification curve is the measured "
            "joint removal.")


def order_checks(tables: dict[str, Any]) -> list[tuple[str, str, Interval]] | None:
    """Claim 6 (a) and (b) per model on their 95 % intervals over the held-out windows (SPEC §8):
    ``(check, label, interval)`` for the taxonomy order's loss minus the random orders' mean at
    each moderate retention (check ``"moderate"``: held where below 0), and each single-metric
    order's loss minus the taxonomy's at each aggressive retention (``"not_uniform"``: held
    where ≤ 0). Every resample recomputes each order's loss from the drawn windows. None for
    tables saved without per-window losses."""
    curve = tables["curve"]
    spec = [("moderate", f"taxonomy − random (mean) at r = {r:g}", _rows(curve, "taxonomy", r),
             _rows(curve, "random", r)) for r in MODERATE]
    spec += [("not_uniform", f"{b} − taxonomy at r = {r:g}", _rows(curve, b, r), _rows(curve, "taxonomy", r))
             for b in BASELINES for r in AGGRESSIVE]
    intervals = curve_intervals(tables, [(plus, minus) for _, _, plus, minus in spec])
    if intervals is None:
        return None
    return [(check, label, iv) for (check, label, _, _), iv in zip(spec, intervals)]


def versus_random(model: str, tables: dict[str, Any]) -> list[str]:
    """At each moderate retention, the taxonomy order's held-out loss minus each random order's
    (one per seed), each with its 95 % interval over the held-out windows and read lower /
    undecided / higher (SPEC §8 (iv)): a note where they do not all agree on one decided side,
    i.e. where the taxonomy order is not shown to lie below (or above) every random order."""
    curve = tables["curve"]
    seeds = curve.seed.tolist()
    notes = []
    for r in MODERATE:
        taxonomy, random = _rows(curve, "taxonomy", r), _rows(curve, "random", r)
        if not taxonomy or not random:
            continue
        intervals = curve_intervals(tables, [(taxonomy, [row]) for row in random])
        if intervals is None:
            continue
        outcomes = [sign(iv) for iv in intervals]
        if TOO_FEW in outcomes or outcomes in ([LOWER] * len(outcomes), [HIGHER] * len(outcomes)):
            continue
        cells = ", ".join(f"seed {int(seeds[row])}: {iv.show()} ({o})"
                          for row, iv, o in zip(random, intervals, outcomes))
        tally_ = ", ".join(f"{o} than {outcomes.count(o)}" if o != UNDECIDED
                           else f"undecided against {outcomes.count(o)}"
                           for o in (LOWER, UNDECIDED, HIGHER) if outcomes.count(o))
        notes.append(f"{model}: at retention {r:g} the taxonomy order's held-out loss minus each random "
                     f"order's, 95 % BCa interval over {_windows(intervals[0], 'held-out')}: {cells} "
                     f"nats — {tally_} of the {len(random)} random orders.")
    return notes


@per_run
def _sweep(tables: dict[str, Any]) -> list[Interval] | None:
    """:func:`head_intervals` followed by the median over heads of the single-head loss increase
    (the heads fixed, the median recomputed in every resample), from the same draws."""
    per_window = tables.get("windows")
    if per_window is None:
        return None
    loss, base, weight = per_window["sensitivity"], per_window["base"], per_window["weight"]

    def statistic(idx: torch.Tensor) -> torch.Tensor:
        increase = (window_mean(loss, weight, idx) - window_mean(base, weight, idx)).flatten()
        return torch.cat([increase, median_of(increase)[None]])

    return bootstraps(statistic, loss.shape[-1])


def head_intervals(tables: dict[str, Any]) -> list[Interval] | None:
    """Each head's single-head loss increase ``[layer · head]`` (layer-major, the sensitivity
    table's order) with its 95 % bootstrap interval over the ablation windows (SPEC §7–§8);
    None for tables saved without per-window losses."""
    out = _sweep(tables)
    return None if out is None else out[:-1]


def head_outcome(interval: Interval, threshold: float) -> str:
    """SPEC §7 on a head's interval: critical (held) where its lower end reaches ``threshold``,
    not critical (not held) where its upper end stays below, undecided otherwise."""
    return decide(interval, low=threshold)


def _rule6(checks: dict[str, list[bool]]) -> str:
    """Held: (a), (b) and (c) for every model; not held: neither (a) nor (c) for any; else partly."""
    if all(all(v) for v in checks.values()):
        return HELD
    return NOT_HELD if not any(checks["moderate"]) and not any(checks["critical"]) else PARTLY


def _moderate_note(model: str, label: str, interval: Interval, outcome: str) -> str:
    """Claim 6 (a) where it is not held at one retention, read on its interval."""
    if outcome == TOO_FEW:
        reading = "too few windows for an interval, so no verdict"
    elif math.isnan(interval.low):
        reading = "no resample defines its interval, so nothing can be said either way"
    elif outcome == NOT_HELD:
        reading = "the taxonomy order's loss is above the random orders' mean on the whole interval"
    else:
        reading = ("the interval holds 0: the taxonomy order is not shown to be below the random "
                   "orders' mean there")
    return (f"{model}: {label}: {interval.show()} nats over {_windows(interval, 'held-out')}, "
            f"{outcome} against 'below 0' — {reading}.")


def breaks_model(model: str, heads: list[Interval], n_heads: int) -> list[str]:
    """Whether a single head breaks the model alone (ours, reported only: a single-head loss
    increase of at least :data:`BREAKS_MODEL` nats), read on each head's 95 % interval over the
    ablation windows (SPEC §8): breaks where the lower end reaches it, does not where the upper end
    stays below, undecided otherwise. Nothing with too few windows."""
    outcomes = [decide(iv, low=BREAKS_MODEL) for iv in heads]
    if not heads or TOO_FEW in outcomes:
        return []

    def key(i: int) -> float:
        return -heads[i].value if math.isfinite(heads[i].value) else math.inf

    def shown(i: int) -> str:
        return f"L{i // n_heads}H{i % n_heads} {heads[i].show()}"

    broken = sorted((i for i, o in enumerate(outcomes) if o == HELD), key=key)
    open_ = sorted((i for i, o in enumerate(outcomes) if o == UNDECIDED), key=key)
    n = _windows(heads[0], "ablation")
    rule = f"(ours: a loss increase of at least {BREAKS_MODEL:g} nat on the whole 95 % interval over {n})"
    paper = "the paper's Gemma-7B layer 0 head 12 broke it alone"
    if broken:
        more = f"; {len(open_)} more undecided" if open_ else ""
        return [f"{model}: {len(broken)} of {len(heads)} heads break the model alone {rule}: "
                + ", ".join(shown(i) for i in broken[:5]) + f" nats{more} ({paper})."]
    if open_:
        return [f"{model}: whether a single head breaks the model alone {rule} is undecided: "
                + ", ".join(shown(i) for i in open_[:5]) + " nats, "
                + ("an interval that holds" if len(open_) == 1 else f"{len(open_)} intervals that hold")
                + f" {BREAKS_MODEL:g} nat; no head breaks it on its whole interval ({paper})."]
    return [f"{model}: no single head breaks the model alone {rule}: every head's interval stays "
            f"below {BREAKS_MODEL:g} nat, the largest point estimate {shown(sorted(range(len(heads)), key=key)[0])} "
            f"nats ({paper})."]


def claim6(study, figures: Path):
    """Taxonomy order vs random and single-metric orders; critical single heads; each check on its
    95 % interval over the windows (SPEC §7–§8)."""
    statement = ("The taxonomy is a useful coarse signal for head removal at moderate retention, "
                 "not uniformly better than single-metric baselines under aggressive pruning; "
                 "single heads can be critical.")
    if not study.ablation:
        return Claim(6, "Head removal guided by the taxonomy", statement, "–", NOT_MEASURED,
                     "not measured in this run (no ablation study was run).")
    checks: dict[str, list[str]] = {"moderate": [], "not_uniform": [], "critical": []}
    loss_rows, check_rows, crit_rows, notes, largest = [], [], [], [], []
    held_out: set[int] = set()
    for model, tables in study.ablation.items():
        curve, sens = tables["curve"], tables["sensitivity"]
        orderings = list(dict.fromkeys(curve.ordering))
        retentions = sorted(set(curve.retention), reverse=True)
        losses = order_losses(tables)
        for name in orderings:
            label = name + (f" (mean of {curve[curve.ordering == name].seed.nunique()})"
                            if name == "random" else "")
            loss_rows.append([model, label] + [
                losses[name, r].show() if losses is not None else f"{fmt(_loss(curve, name, r))} (no interval)"
                for r in retentions])
            if name == "random":
                loss_rows.append([model, "random (min – max over seeds)"] + [
                    "{} – {}".format(*(fmt(x) for x in _range(curve, name, r))) for r in retentions])
        orders = order_checks(tables)
        sweep = _sweep(tables)
        intervals, median = (None, None) if sweep is None else (sweep[:-1], sweep[-1])
        threshold = critical_threshold(tables["base_loss"])
        if orders is None or intervals is None:
            checks["moderate"].append(NO_INTERVAL)
            checks["not_uniform"].append(NO_INTERVAL)
            checks["critical"].append(NO_INTERVAL)
            notes.append(f"{model}: the saved ablation tables keep no per-window losses, so no "
                         "interval and no verdict (SPEC §8); re-run the ablation study.")
        else:
            found = {"moderate": [], "not_uniform": []}
            held_out.add(orders[0][2].n)
            for check, label, iv in orders:
                outcome = decide(iv, high=0.0)
                found[check].append(outcome)
                check_rows.append([model, label, iv.show(), str(iv.n), outcome])
                if check == "moderate" and outcome != HELD:
                    notes.append(_moderate_note(model, label, iv, outcome))
            checks["moderate"].append(every(found["moderate"]))
            checks["not_uniform"].append(some(found["not_uniform"]))
            if checks["not_uniform"][-1] == NOT_HELD:
                notes.append(f"{model}: the taxonomy order's loss is below weight magnitude's and "
                             "entropy's at retention 0.5 and 0.25, each difference on its whole "
                             f"95 % interval over {_windows(orders[0][2], 'held-out')} (table "
                             "below) — better than the paper found.")
            notes += versus_random(model, tables)
            notes += below_dense(model, tables, intervals)
        worst = sens.sort_values("loss_increase", ascending=False).iloc[0]
        n_heads = int(sens["head"].max() + 1)
        worst_at = int(worst.layer) * n_heads + int(worst["head"])
        worst_name = f"L{int(worst.layer)}H{int(worst['head'])}"
        if intervals is None:
            crit_rows.append([model, fmt(tables["base_loss"]), fmt(threshold), worst_name,
                              f"{fmt(float(worst.loss_increase))} (no interval)",
                              f"{fmt(float(sens.loss_increase.median()))} (no interval)",
                              NO_INTERVAL, NO_INTERVAL, "–", NO_INTERVAL, f"–, {len(sens)}"])
            largest.append(f"{model} {fmt(float(worst.loss_increase))} nats ({worst_name}, no interval)")
            continue
        notes += breaks_model(model, intervals, n_heads)
        outcomes = [head_outcome(iv, threshold) for iv in intervals]
        checks["critical"].append(some(outcomes))
        critical = sorted((i for i, o in enumerate(outcomes) if o == HELD),
                          key=lambda i: -intervals[i].value)
        n = _windows(intervals[worst_at], "ablation")
        if not critical:
            undecided = outcomes.count(UNDECIDED)
            notes.append(f"{model}: no single head is critical on its whole interval: the largest "
                         f"point estimate, {worst_name}'s {intervals[worst_at].show()} nats, does not "
                         f"reach {fmt(threshold)} nats (max(0.1 nats, 5 % of the dense loss)) with "
                         f"its whole 95 % interval over {n}"
                         + (f"; {undecided} of {len(intervals)} heads are undecided." if undecided else "."))
        signs = [sign(iv) for iv in intervals]
        largest.append(f"{model} {intervals[worst_at].show()} nats ({worst_name}, {n}, "
                       f"{len(intervals)} heads)")
        crit_rows.append([
            model, fmt(tables["base_loss"]), fmt(threshold), worst_name, intervals[worst_at].show(),
            median.show(), str(len(critical)), str(outcomes.count(UNDECIDED)),
            ", ".join(f"L{i // n_heads}H{i % n_heads} ({intervals[i].show(2)})" for i in critical[:5]) or "none",
            " / ".join(str(signs.count(o)) for o in (LOWER, HIGHER, UNDECIDED))
            + (f" ({signs.count(TOO_FEW)} too few)" if signs.count(TOO_FEW) else ""),
            f"{intervals[worst_at].n}, {len(intervals)}",
        ])

    models = list(study.ablation)

    def draw(ax, model, _):
        curve = study.ablation[model]["curve"]
        for k, name in enumerate(dict.fromkeys(curve.ordering)):
            stats = curve[curve.ordering == name].groupby("retention").loss.mean().sort_index()
            ax.plot(stats.index, stats.values, "o-" if name == "taxonomy" else "--",
                    color=plots.COLORS[k], label=name + (" (mean)" if name == "random" else ""), ms=4)
        ax.axhline(study.ablation[model]["held_out_base_loss"], color="0.5", ls=":", label="unablated")
        ax.set_yscale("log")
        ax.invert_xaxis()

    plots.grid(figures / "claim6_sparsification.png", models, ["held-out WikiText"], draw,
               title="Loss after removing heads in each order", xlabel="retention (fraction kept)",
               ylabel="loss (nats, log)", logx=False, share_y=False)
    result = combine(checks, _rule6)
    because = (f"taxonomy order below the random orders' mean loss at retention 0.9 and 0.75 for "
               f"{tally(checks['moderate'])}; a single-metric order at least as good at retention "
               f"0.5 or 0.25 for {tally(checks['not_uniform'])}; critical single heads for "
               f"{tally(checks['critical'])}; each on its 95 % BCa interval over the windows"
               + (f" ({' or '.join(map(str, sorted(held_out)))} held-out windows per model for the "
                  "orders)" if held_out else "")
               + "; largest single-head loss increase (point estimate, with its interval): "
               + ", ".join(largest) + ".")
    retentions = sorted(set(next(iter(study.ablation.values()))["curve"].retention), reverse=True)
    return Claim(
        6, "Head removal guided by the taxonomy", statement,
        "Zero ablation of whole query heads (`hook_z`), loss on held-out WikiText windows. "
        "(a) *Useful at moderate retention*: the taxonomy order (tl_geometry's, ours: Mixers "
        "first, then Resets, Retrievers last; inside a class the smallest F_2 gain first) gives "
        "a lower loss than the mean of the random orders at retention 0.9 and 0.75. (b) *Not "
        "uniformly better under aggressive pruning*: at retention 0.5 or 0.25, weight magnitude "
        "or attention entropy gives a loss no higher than the taxonomy's. (c) *Single heads can "
        "be critical*: at least one head is critical by SPEC §7's rule (ours): the lower end of "
        "the 95 % interval of its single-head loss increase reaches max(0.1 nats, 5 % of the "
        "dense loss); not critical where the upper end stays below, undecided otherwise; a "
        "robust outlier of the sweep alone (median + k · MAD) does not count. Every difference "
        "and loss increase is read on its 95 % interval from a seeded bootstrap over the "
        "windows (SPEC §8: 1,000 resamples; each resample recomputes every order's loss, and "
        "every head's, as the prediction-weighted mean over the drawn windows): held where the "
        "whole interval satisfies the rule, not held where none of it does, undecided otherwise. "
        "Held: (a), (b), (c) for every model; not held: neither (a) nor (c) for any model; else "
        "partly held. The notes read every other loss the same way (SPEC §8 (iv)): an order's "
        "loss against the unablated model's, or against another order's, is lower, undecided or "
        "higher on the 95 % interval of the paired difference over the same held-out windows; a "
        "head lowers (raises) the loss when removed alone only where its whole interval lies "
        "below (above) 0, and the heads that do neither are counted as undecided; single-head "
        "changes are never added up into a joint removal (the curves are the measured joint "
        "removals). Reported only (ours): a head breaks the model where the lower end of its "
        "interval reaches 1 nat.",
        result, because,
        blocks=[
            "Loss (nats) on the held-out windows after removing heads in each order, each with its "
            "95 % BCa interval over those windows (the random orders: the mean over their seeds, "
            "recomputed in every resample; r = 1 is the unablated model; the min – max row is the "
            "spread of the seeds' point losses, not an interval):",
            table(["model", "ordering"] + [f"r={r:g}" for r in retentions], loss_rows,
                  "ll" + "r" * len(retentions)),
            "The differences the rule reads, with their 95 % BCa intervals over the held-out "
            "windows ((a): below 0 holds; (b): at most 0 holds):",
            table(["model", "difference (nats)", "value [95 % interval]", "windows", "outcome"],
                  check_rows, "llrrl"),
            "Single-head sensitivity on the ablation windows, each loss increase with its 95 % BCa "
            "interval over them (worst head: the largest point estimate; the median over heads is "
            "recomputed in every resample; critical: SPEC §7's rule, with the heads it leaves "
            "undecided; lower / higher / undecided: the heads whose whole interval lies below 0, "
            "above 0, or neither):",
            table(["model", "base loss", "critical from (nats)", "worst head", "its Δloss [95 %]",
                   "median Δloss [95 %]", "critical heads", "undecided (critical)", "largest critical",
                   "lower / higher / undecided", "windows, heads"], crit_rows, "lrrllrrrlrr"),
        ],
        figures=[("claim6_sparsification.png",
                  "Held-out loss against the fraction of heads kept (point losses; their 95 % "
                  "intervals are in the first table); dotted: unablated.")],
        disagreements=notes,
    )
