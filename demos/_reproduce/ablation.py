"""Claim 6: head removal guided by the taxonomy vs single-metric baselines (SPEC §7).

Uses :mod:`tl_geometry.ablation`. Per model, on WikiText text disjoint from the analysed windows
(its last quarter): the single-head sensitivity sweep and the entropy order on one set of
windows, then structured sparsification curves on another set, for the taxonomy order (built from
the WikiText analysis of the main study), weight magnitude, attention entropy, random orders and
the sensitivity oracle. Zero ablation of ``hook_z``.
"""

from __future__ import annotations

import math
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
from .intervals import NO_INTERVAL, UNDECIDED, Interval, bootstraps, combine, decide, every, some
from .losses import tally
from .protocol import StudyConfig, beside, windows
from .saved import TABLES_SHA256, load_windows, save_windows

MODERATE = (0.9, 0.75)  # retentions where the taxonomy should be "a useful coarse signal"
AGGRESSIVE = (0.5, 0.25)  # where it should not beat every single-metric baseline
BASELINES = ("weight_norm", "entropy")  # the single-metric orders
BREAKS_MODEL = 1.0  # (ours, reported only) a single-head loss increase ≥ 1 nat "breaks" the model


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


def _below_dense(model: str, curve: pd.DataFrame, sens: pd.DataFrame, dense: float) -> list[str]:
    """A note for each order whose held-out loss falls below the unablated model's at some
    retention: removing heads then helps the model on that text. For the oracle order (the
    smallest single-head loss increase first) the note says how many heads lower the loss when
    removed alone, and by how much, on the ablation windows."""
    notes = []
    lowering = sens[sens.loss_increase < 0]
    for name in dict.fromkeys(curve.ordering):
        below = [r for r in sorted(set(curve.retention), reverse=True)
                 if r < 1 and _loss(curve, name, r) < dense]
        if not below:
            continue
        cells = ", ".join(f"{fmt(_loss(curve, name, r))} at retention {r:g}" for r in below)
        note = f"{model}: the {name} order's held-out loss falls below the unablated {fmt(dense)}: {cells}."
        if name == "oracle":
            note += (f" {len(lowering)} of {len(sens)} heads lower the ablation windows' loss when "
                     f"removed alone (together {fmt(float(lowering.loss_increase.sum()))} nats, the "
                     f"largest {fmt(float(lowering.loss_increase.min()) if len(lowering) else math.nan)}); "
                     "the oracle removes them first.")
        notes.append(note)
    return notes


def order_checks(tables: dict[str, Any]) -> list[tuple[str, str, Interval]] | None:
    """Claim 6 (a) and (b) per model on their 95 % intervals over the held-out windows (SPEC §8):
    ``(check, label, interval)`` for the taxonomy order's loss minus the random orders' mean at
    each moderate retention (check ``"moderate"``: held where below 0), and each single-metric
    order's loss minus the taxonomy's at each aggressive retention (``"not_uniform"``: held
    where ≤ 0). Every resample recomputes each order's loss from the drawn windows. None for
    tables saved without per-window losses."""
    per_window = tables.get("windows")
    if per_window is None:
        return None
    curve = tables["curve"]
    spec = [("moderate", f"taxonomy − random (mean) at r = {r:g}", _rows(curve, "taxonomy", r),
             _rows(curve, "random", r)) for r in MODERATE]
    spec += [("not_uniform", f"{b} − taxonomy at r = {r:g}", _rows(curve, b, r), _rows(curve, "taxonomy", r))
             for b in BASELINES for r in AGGRESSIVE]
    loss, weight = per_window["curve"], per_window["held_out_weight"]

    def statistic(idx: torch.Tensor) -> torch.Tensor:
        per_row = window_mean(loss, weight, idx)
        nan = torch.tensor(math.nan, dtype=torch.float64)
        return torch.stack([per_row[plus].mean() - per_row[minus].mean() if plus and minus else nan
                            for _, _, plus, minus in spec])

    intervals = bootstraps(statistic, loss.shape[-1])
    return [(check, label, iv) for (check, label, _, _), iv in zip(spec, intervals)]


def head_intervals(tables: dict[str, Any]) -> list[Interval] | None:
    """Each head's single-head loss increase ``[layer · head]`` (layer-major, the sensitivity
    table's order) with its 95 % bootstrap interval over the ablation windows (SPEC §7–§8);
    None for tables saved without per-window losses."""
    per_window = tables.get("windows")
    if per_window is None:
        return None
    loss, base, weight = per_window["sensitivity"], per_window["base"], per_window["weight"]

    def statistic(idx: torch.Tensor) -> torch.Tensor:
        return (window_mean(loss, weight, idx) - window_mean(base, weight, idx)).flatten()

    return bootstraps(statistic, loss.shape[-1])


def head_outcome(interval: Interval, threshold: float) -> str:
    """SPEC §7 on a head's interval: critical (held) where its lower end reaches ``threshold``,
    not critical (not held) where its upper end stays below, undecided otherwise."""
    return decide(interval, low=threshold)


def _rule6(checks: dict[str, list[bool]]) -> str:
    """Held: (a), (b) and (c) for every model; not held: neither (a) nor (c) for any; else partly."""
    if all(all(v) for v in checks.values()):
        return HELD
    return NOT_HELD if not any(checks["moderate"]) and not any(checks["critical"]) else PARTLY


def claim6(study, figures: Path):
    """Taxonomy order vs random and single-metric orders; critical single heads; each check on its
    95 % interval over the windows (SPEC §7–§8)."""
    statement = ("The taxonomy is a useful coarse signal for head removal at moderate retention, "
                 "not uniformly better than single-metric baselines under aggressive pruning; "
                 "single heads can be critical.")
    if not study.ablation:
        return Claim(6, "Head removal guided by the taxonomy", statement, "–", NOT_HELD,
                     "not measured in this run (no ablation study was run).")
    checks: dict[str, list[str]] = {"moderate": [], "not_uniform": [], "critical": []}
    loss_rows, check_rows, crit_rows, notes = [], [], [], []
    for model, tables in study.ablation.items():
        curve, sens = tables["curve"], tables["sensitivity"]
        orderings = list(dict.fromkeys(curve.ordering))
        retentions = sorted(set(curve.retention), reverse=True)
        for name in orderings:
            label = name + (f" (mean of {curve[curve.ordering == name].seed.nunique()})"
                            if name == "random" else "")
            loss_rows.append([model, label] + [fmt(_loss(curve, name, r)) for r in retentions])
            if name == "random":
                loss_rows.append([model, "random (min – max)"] + [
                    "{} – {}".format(*(fmt(x) for x in _range(curve, name, r))) for r in retentions])
        orders = order_checks(tables)
        intervals = head_intervals(tables)
        threshold = critical_threshold(tables["base_loss"])
        if orders is None or intervals is None:
            checks["moderate"].append(NO_INTERVAL)
            checks["not_uniform"].append(NO_INTERVAL)
            checks["critical"].append(NO_INTERVAL)
            notes.append(f"{model}: the saved ablation tables keep no per-window losses, so no "
                         "interval and no verdict (SPEC §8); re-run the ablation study.")
        else:
            found = {"moderate": [], "not_uniform": []}
            for check, label, iv in orders:
                outcome = decide(iv, high=0.0)
                found[check].append(outcome)
                check_rows.append([model, label, iv.show(), outcome])
                if check == "moderate" and outcome != HELD:
                    notes.append(f"{model}: {label}: {iv.show()} nats, {outcome} against 'below "
                                 "0' — the taxonomy order is not below the random orders' mean "
                                 "there on the whole interval.")
            checks["moderate"].append(every(found["moderate"]))
            checks["not_uniform"].append(some(found["not_uniform"]))
            if checks["not_uniform"][-1] == NOT_HELD:
                notes.append(f"{model}: the taxonomy order beats weight magnitude and entropy at "
                             "retention 0.5 and 0.25 on the whole interval — better than the paper found.")
        for r in MODERATE:
            low, high = _range(curve, "random", r)
            if low <= _loss(curve, "taxonomy", r) <= high:
                notes.append(f"{model}: at retention {r:g} the taxonomy order's loss "
                             f"{fmt(_loss(curve, 'taxonomy', r))} lies within the random orders' "
                             f"range {fmt(low)} – {fmt(high)}.")
        notes += _below_dense(model, curve, sens, tables["held_out_base_loss"])
        worst = sens.sort_values("loss_increase", ascending=False).iloc[0]
        n_heads = int(sens["head"].max() + 1)
        worst_at = int(worst.layer) * n_heads + int(worst["head"])
        worst_name = f"L{int(worst.layer)}H{int(worst['head'])}"
        if float(worst.loss_increase) < BREAKS_MODEL:
            notes.append(f"{model}: no single head breaks the model — the worst, {worst_name}, adds "
                         f"{fmt(float(worst.loss_increase), 2)} nats (the paper's Gemma-7B layer 0 "
                         "head 12 broke it alone).")
        if intervals is None:
            crit_rows.append([model, fmt(tables["base_loss"]), fmt(threshold), worst_name,
                              f"{fmt(float(worst.loss_increase))} (no interval)",
                              fmt(float(sens.loss_increase.median())), NO_INTERVAL, NO_INTERVAL, "–"])
            continue
        outcomes = [head_outcome(iv, threshold) for iv in intervals]
        checks["critical"].append(some(outcomes))
        critical = sorted((i for i, o in enumerate(outcomes) if o == HELD),
                          key=lambda i: -intervals[i].value)
        if not critical:
            notes.append(f"{model}: no single head is critical: the largest loss increase, "
                         f"{worst_name}'s {intervals[worst_at].show()}, does not reach "
                         f"{fmt(threshold)} nats (max(0.1 nats, 5 % of the dense loss)) with its "
                         f"whole interval over {study.config.ablation_windows} windows.")
        crit_rows.append([
            model, fmt(tables["base_loss"]), fmt(threshold), worst_name, intervals[worst_at].show(),
            fmt(float(sens.loss_increase.median())),
            str(len(critical)), str(outcomes.count(UNDECIDED)),
            ", ".join(f"L{i // n_heads}H{i % n_heads} ({intervals[i].show(2)})" for i in critical[:5]) or "none",
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
               f"{tally(checks['critical'])}; each on its 95 % interval over the windows; largest "
               "single-head loss increase: "
               + ", ".join(f"{row[0]} {row[4]} nats" for row in crit_rows) + ".")
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
        "partly held.",
        result, because,
        blocks=[
            "Loss (nats) on held-out windows after removing heads in each order:",
            table(["model", "ordering"] + [f"r={r:g}" for r in retentions], loss_rows,
                  "ll" + "r" * len(retentions)),
            "The differences the rule reads, with their 95 % intervals over the held-out windows "
            "((a): below 0 holds; (b): at most 0 holds):",
            table(["model", "difference (nats)", "value [95 % interval]", "outcome"], check_rows, "llrl"),
            "Single-head sensitivity (ablation windows; intervals over the windows):",
            table(["model", "base loss", "critical from (nats)", "worst head", "its Δloss [95 %]",
                   "median Δloss", "critical heads", "undecided heads", "largest critical"], crit_rows),
        ],
        figures=[("claim6_sparsification.png",
                  "Held-out loss against the fraction of heads kept; dotted: unablated.")],
        disagreements=notes,
    )
