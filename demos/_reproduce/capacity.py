"""Claim 7 (ours): retrieval capacity under top-N attention, and whether geometry predicts it.

Uses :mod:`tl_geometry.capacity`'s top-N attention (``hook_pattern``). Per model, on the first
ablation windows of held-out WikiText (as claim 6): the loss with every head keeping only each
query's top-N keys for N = 1, 2, 4, … below the window length, renormalised and deleted, and N*
(the smallest N within 5 % of the dense loss); then, on the same windows, the per-head sweep at
N = 4 (renormalised) and Spearman's ρ between each head's F_4 (and its shell certificate, SPEC
§6d) and the loss increase of sparsifying that head alone. Every loss and F_4 is kept per window,
so each thresholded number gets a bootstrap interval over the windows (SPEC §8).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from tl_geometry import capacity as api
from tl_geometry.capacity.geometry import window_rho
from tl_geometry.functional.uncertainty import window_mean

from .corpora import Corpus
from .document import HELD, NOT_HELD, PARTLY, Claim, fmt, table
from .intervals import NO_INTERVAL, NOT_MEASURED, Interval, bootstraps, combine, decide, per_run
from .losses import tally
from .protocol import StudyConfig, beside, windows
from .saved import TABLES_SHA256, load_windows, save_windows

TOLERANCE = 0.05  # N*: within 5 % of the dense loss (the rule)
HEAD_N = 4  # the per-head sweep's N
RHO_CUT = -0.2  # (ours) "geometry tracks capacity": ρ(F_4, Δ loss) at or below this

def describe(config: StudyConfig) -> str:
    return (f"top-N attention on `hook_pattern` (renormalised and deleted) on the first "
            f"{config.ablation_windows} ablation windows × {config.ablation_seq_len} tokens of "
            f"WikiText's last quarter; N* within {TOLERANCE:.0%} of the dense loss; per-head sweep "
            f"at N = {HEAD_N}, renormalised, on the same windows.")


def run(model: Any, corpus: Corpus, config: StudyConfig, *, progress: bool = True) -> dict[str, Any]:
    """Loss-against-N curves (both modes) and the per-head correlation of one model (tables, and
    their per-window values for the intervals)."""
    start = time.perf_counter()
    tokens = windows(model, corpus, config.ablation_windows, config.ablation_seq_len)
    n_pos = tokens.shape[1]
    n_values = tuple(2**k for k in range(n_pos.bit_length()) if 2**k < n_pos)
    caps = {mode: api.retrieval_capacity(model, tokens, n_values, mode=mode, tolerance=TOLERANCE,
                                         progress=progress) for mode in ("renormalize", "delete")}
    corr = api.capacity_correlation(model, tokens, min(HEAD_N, n_pos - 1), progress=progress)
    per_window = {f"{mode}_loss": cap.window_loss for mode, cap in caps.items()}
    per_window.update(dense=caps["renormalize"].dense_window_loss, weight=corr.window_weight,
                      head_increase=corr.window_loss_increase,
                      **{f"head_{name}": score for name, score in (corr.window_scores or {}).items()})
    return {"curve": pd.concat([cap.to_pandas() for cap in caps.values()], ignore_index=True),
            "heads": corr.to_pandas(), "rho": corr.rho, "seq_len": n_pos, "windows": per_window,
            "seconds": time.perf_counter() - start}


def save(tables: dict[str, Any], path: Path) -> None:
    """Write one model's capacity tables: two CSV files, a JSON of the figures and options, and
    the per-window values (``.windows.pt``) the intervals resample, whose SHA-256 the JSON
    records (:func:`.saved.save_windows`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # The record goes first and comes back last: a save cut short leaves no tables to reuse.
    beside(path, ".json").unlink(missing_ok=True)
    tables["curve"].to_csv(beside(path, ".curve.csv"), index=False)
    tables["heads"].to_csv(beside(path, ".heads.csv"), index=False)
    keys = ("rho", "seq_len", "seconds", "options", "threads", "date", "accelerator", "window_start",
            "windows_read")
    record = {k: tables.get(k) for k in keys}
    record[TABLES_SHA256] = save_windows(tables.get("windows"), beside(path, ".windows.pt"))
    beside(path, ".json").write_text(json.dumps(record))


def load(path: Path) -> dict[str, Any] | None:
    """Tables written by :func:`save`, or None when absent. ``windows`` is None for tables saved
    before the per-window values were kept, or whose side file is missing (then the study
    computes them again); a side file that does not match the checksum the JSON records, or
    cannot be read, raises :class:`.saved.SideFileError` (:func:`.saved.load_windows`)."""
    if not beside(path, ".json").exists():
        return None
    out = json.loads(beside(path, ".json").read_text())
    out["curve"] = pd.read_csv(beside(path, ".curve.csv"))
    out["heads"] = pd.read_csv(beside(path, ".heads.csv"))
    out["windows"] = load_windows(out, beside(path, ".windows.pt"), beside(path, ".json"))
    return out


def _n_star(curve: pd.DataFrame, mode: str) -> int | None:
    ok = curve[(curve["mode"] == mode) & curve["within_tolerance"].astype(bool)]
    return int(ok["n"].min()) if len(ok) else None


def curve_intervals(tables: dict[str, Any]) -> dict[str, Any] | None:
    """Claim 7 (a) on its 95 % interval over the windows (SPEC §8): per mode the relative loss
    increase at every N and N* (each resample's smallest N within the tolerance; resamples
    without one are left out of N*'s interval), and the smallest renormalised increase over
    N ≤ T/4, which (a) compares with the tolerance. None without per-window losses."""
    per_window = tables.get("windows")
    if per_window is None:
        return None
    curve, t = tables["curve"], tables["seq_len"]
    ns = torch.tensor(sorted(set(curve["n"])), dtype=torch.float64)
    modes = ("renormalize", "delete")
    dense, weight = per_window["dense"], per_window["weight"]

    def statistic(idx: torch.Tensor) -> torch.Tensor:
        base = window_mean(dense, weight, idx)
        out = []
        for mode in modes:
            rel = (window_mean(per_window[f"{mode}_loss"], weight, idx) - base) / base
            within = ns[rel <= TOLERANCE]
            out += [rel, (within.min() if within.numel() else torch.tensor(math.nan, dtype=torch.float64))[None]]
        renorm = out[0]
        out.append(renorm[ns <= t / 4].min()[None])
        return torch.cat(out)

    ivs = bootstraps(statistic, dense.shape[-1])
    k = len(ns)
    return {"n": ns.long().tolist(),
            "relative": {m: ivs[i * (k + 1): i * (k + 1) + k] for i, m in enumerate(modes)},
            "n_star": {m: ivs[i * (k + 1) + k] for i, m in enumerate(modes)},
            "smallest": ivs[-1]}


@per_run
def rho_intervals(tables: dict[str, Any]) -> dict[str, Interval] | None:
    """Claim 7 (b) on its 95 % interval over the windows (SPEC §8): Spearman's ρ over heads (fixed)
    between each geometric score (``f_score``, ``shell_k0``, ``shell_kn``; each head's mean over
    the drawn windows' last queries) and the loss increase of sparsifying that head alone (its
    prediction-weighted mean over the drawn windows). None without per-window values."""
    per_window = tables.get("windows")
    if per_window is None:
        return None
    names = ("f_score", "shell_k0", "shell_kn")
    scores = {name: per_window[f"head_{name}"] for name in names}
    increase, weight = per_window["head_increase"], per_window["weight"]

    def statistic(idx: torch.Tensor) -> torch.Tensor:
        return torch.tensor(list(window_rho(scores, increase, weight, idx).values()), dtype=torch.float64)

    return dict(zip(names, bootstraps(statistic, weight.shape[-1])))


def _rule7(checks: dict[str, list[bool]]) -> str:
    """Held: (a) and (b) for every model; not held: neither for any model; else partly held."""
    if all(checks["sparse"]) and all(checks["tracks"]):
        return HELD
    return NOT_HELD if not any(checks["tracks"]) and not any(checks["sparse"]) else PARTLY


def claim7(study, figures: Path):
    """N* per model and mode; ρ of per-head geometry against the loss of sparsifying that head;
    each on its 95 % interval over the windows (SPEC §8)."""

    statement = ("(ours, following the paper's call for geometry-aware sparsification) Each query "
                 "needs only a few keys: keeping every query's top-N attention weights costs little "
                 "loss at small N; and a head's geometric separability F_N predicts how much "
                 "sparsifying it to N costs.")
    if not getattr(study, "capacity", None):
        return Claim(7, "Retrieval capacity under top-N attention (ours)", statement, "–", NOT_MEASURED,
                     "not measured in this run (no capacity study was run).")
    checks: dict[str, list[str]] = {"sparse": [], "tracks": []}
    curve_rows, rho_rows, notes, summary = [], [], [], []
    for model, tables in study.capacity.items():
        curve, t = tables["curve"], tables["seq_len"]
        spread, rhos = curve_intervals(tables), rho_intervals(tables)
        n_head = int(tables["heads"]["n"].iloc[0])
        dense = float(curve["dense_loss"].iloc[0])
        if spread is None or rhos is None:
            checks["sparse"].append(NO_INTERVAL)
            checks["tracks"].append(NO_INTERVAL)
            notes.append(f"{model}: the saved capacity tables keep no per-window losses, so no "
                         "interval and no verdict (SPEC §8); re-run the capacity study.")
            for mode in ("renormalize", "delete"):
                part = curve[curve["mode"] == mode].sort_values("n")
                curve_rows.append([model, mode, fmt(dense), str(_n_star(curve, mode) or "none")]
                                  + [f"{100 * r:+.1f} %" for r in part["relative_increase"]])
            rho = tables["rho"]
            rho_rows.append([model, str(n_head), fmt(rho["f_score"]), fmt(rho["shell_k0"]),
                             fmt(rho["shell_kn"]), fmt(float(tables["heads"]["loss_increase"].median()), 4)])
            summary.append(f"{model} ρ = {fmt(rho['f_score'])} (no interval)")
            continue
        sparse = decide(spread["smallest"], high=TOLERANCE)
        tracks = decide(rhos["f_score"], high=RHO_CUT)
        checks["sparse"].append(sparse)
        checks["tracks"].append(tracks)
        for mode in ("renormalize", "delete"):
            star = spread["n_star"][mode]
            curve_rows.append([model, mode, fmt(dense), "none" if math.isnan(star.value) else star.show(0)]
                              + [iv.show(1, percent=True) for iv in spread["relative"][mode]])
        rho_rows.append([model, str(n_head), rhos["f_score"].show(), rhos["shell_k0"].show(),
                         rhos["shell_kn"].show(), fmt(float(tables["heads"]["loss_increase"].median()), 4)])
        star = spread["n_star"]["renormalize"]
        summary.append(f"{model} ρ = {rhos['f_score'].show()}, N* = "
                       + ("none" if math.isnan(star.value) else star.show(0)))
        if sparse != HELD:
            notes.append(f"{model}: the smallest renormalised loss increase at N ≤ T/4 = {t // 4} is "
                         f"{spread['smallest'].show(1, percent=True)}, {sparse} against the "
                         f"{TOLERANCE:.0%} tolerance.")
        if rhos["f_score"].low > 0:
            notes.append(f"{model}: ρ(F_{n_head}, Δ loss) = {rhos['f_score'].show()} > 0 on its whole "
                         "interval — the heads whose top-N sets are most separable lose *more* when "
                         "cut to N.")
    n_cols = max(len(r) for r in curve_rows) - 4
    ns = sorted(set(next(iter(study.capacity.values()))["curve"]["n"]))[:n_cols]
    result = combine(checks, _rule7)
    because = (f"N* (renormalised, within {TOLERANCE:.0%}) at most T/4 for {tally(checks['sparse'])}; "
               f"ρ(F_N, Δ loss) ≤ {RHO_CUT} for {tally(checks['tracks'])}; each on its 95 % "
               "interval over the windows (" + "; ".join(summary) + ").")
    return Claim(
        7, "Retrieval capacity under top-N attention (ours)", statement,
        "Every head keeps only each query's top-N attention weights (ties to the lower index) on "
        "`hook_pattern`, renormalised to sum to one or with the rest deleted; loss on held-out "
        "WikiText windows. N* = the smallest N whose relative loss increase over the dense model is "
        f"at most {TOLERANCE:.0%}. (a) *Few keys suffice*: with renormalisation N* exists and is at "
        f"most T/4, i.e. the smallest relative increase over N ≤ T/4 is at most {TOLERANCE:.0%}. "
        f"(b) *Geometry tracks capacity*: over all heads, Spearman ρ between F_{HEAD_N} (last "
        f"query, mean over the windows) and the loss increase when that head alone is cut to "
        f"{HEAD_N} keys (on the same windows) is at most {RHO_CUT} (ours). Each is read on its 95 % "
        "interval from a seeded bootstrap over the windows (SPEC §8: 1,000 resamples; each "
        "recomputes every loss, and every head's F and loss increase, from the drawn windows, the "
        "heads fixed): held where the whole interval satisfies the rule, not held where none of "
        "it does, undecided otherwise. Held: (a) and (b) for every model; not held: neither for "
        "any model; else partly held. The shell certificates' ρ is reported beside it.",
        result, because,
        blocks=[
            "Relative loss increase over the dense model when every head keeps its top-N keys "
            "(95 % intervals over the windows):",
            table(["model", "mode", "dense loss", "N* [95 %]"] + [f"N={x}" for x in ns], curve_rows,
                  "llrr" + "r" * len(ns)),
            "Per head: Spearman ρ against the loss increase of sparsifying that head alone "
            "(95 % intervals over the windows):",
            table(["model", "N", "ρ(F_N)", "ρ(shell, K=0)", "ρ(shell, K=N)", "median Δ loss"], rho_rows),
        ],
        disagreements=notes,
    )
