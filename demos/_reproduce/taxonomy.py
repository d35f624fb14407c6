"""Claim 5: the head taxonomy (SPEC §5) — Retrievers a minority, Mixer or Reset dominant by
architecture and stable across corpora, Mixers aligned with the sink.

Heads without votes have no label (``None``, "unlabelled"): they are left out of the class shares
and counts, never counted in a class (SPEC §5).

Uncertainty (SPEC §8): the shares are recomputed on every bootstrap resample of the windows from
the per-window votes (``sequence_votes``), labels included, the heads fixed; (c)'s sink masses from
the per-window sink figures (``window_sink``) of the same drawn windows. An analysis saved without
them gives no interval and no verdict.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from tl_geometry.functional.sink import SINK_FIELDS
from tl_geometry.functional.taxonomy import labels_from_votes

from . import layer_kinds, plots
from .document import HELD, NOT_HELD, PARTLY, Claim, fmt, pct, table
from .intervals import (
    NO_INTERVAL,
    TOO_FEW,
    UNDECIDED,
    Interval,
    WindowMeans,
    bootstraps,
    categorize,
    combine,
    decide,
    head_means,
    per_run,
)
from .rules import runs
from .stats import mean

RETRIEVER_RANGE = (0.058, 0.172)
CLASSES = ("Retriever", "Mixer", "Reset")


def _classes(r: Any) -> dict[str, torch.Tensor]:
    """Per class, which heads (flattened ``[layer · head]``) carry its label."""
    labels = [label for row in r.labels for label in row]
    return {c: torch.tensor([x == c for x in labels]) for c in CLASSES}


def _shares(is_class: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each class's share of the labelled heads (unlabelled heads count in no class; SPEC §5)."""
    labelled = sum(int(m.sum()) for m in is_class.values())
    return {c: int(m.sum()) / labelled if labelled else math.nan for c, m in is_class.items()}


#: Which of Mixer and Reset dominates, read on share(Reset) − share(Mixer) (SPEC §8 categories).
DOMINANCE = (("Mixer", -math.inf, 0.0), ("Reset", 0.0, math.inf))


@per_run
def _share_intervals(r: Any) -> dict[str, Interval]:
    """95 % intervals over windows (SPEC §8) of the Retriever share, of Retriever − the smaller of
    Mixer and Reset (below 0: the smallest class) and of Reset − Mixer, each recomputed from the
    drawn windows' votes (labels by plurality, SPEC §5). Fewer than 8 windows: too few (the
    saved votes are per window, so 128-query blocks cannot be drawn)."""
    votes = r.sequence_votes
    if votes is None:
        return {}
    flat = votes.reshape(len(votes), -1, 3).double()

    def figures(idx: torch.Tensor) -> torch.Tensor:
        labels = labels_from_votes(flat[idx].sum(0))
        counts = torch.stack([(labels == k).sum() for k in range(len(CLASSES))]).double()
        share = counts / counts.sum()  # NaN when no head is labelled
        return torch.stack([share[0], share[0] - share[1:].min(), share[2] - share[1]])

    return dict(zip(("retriever", "minority", "dominance"), bootstraps(figures, len(votes))))


@per_run
def _sink_interval(r: Any) -> Interval | None:
    """(c): the Mixers' mean α_sink minus the larger of the Retrievers' and the Resets' (a class
    without heads drops out; NaN without Mixers or without either other class), with its 95 %
    interval over windows (SPEC §8): labels from the drawn windows' votes and each head's α_sink
    from the same windows' per-window means, heads fixed. ``None`` where the analysis holds no
    per-window votes or sink figures."""
    if r.sequence_votes is None or r.window_sink is None or len(r.window_sink) != len(r.sequence_votes):
        return None
    votes = r.sequence_votes.reshape(len(r.sequence_votes), -1, 3).double()
    mass = r.window_sink[:, SINK_FIELDS.index("mass")].reshape(len(r.window_sink), -1).double()

    vote_sums, mass_means = WindowMeans(votes), WindowMeans(mass)

    def figure(idx: torch.Tensor) -> torch.Tensor:
        labels = labels_from_votes(vote_sums.sums_over(idx))
        per_head = head_means(mass_means, idx)
        by_class = [per_head[labels == k].nanmean() for k in range(len(CLASSES))]  # NaN: no head
        others = torch.stack([by_class[0], by_class[2]])
        others = others[torch.isfinite(others)]
        if not others.numel():
            return torch.tensor([math.nan], dtype=torch.float64)
        return (by_class[1] - others.max())[None]  # NaN without Mixers

    return bootstraps(figure, len(votes))[0]


def _stable(outcomes: list[str]) -> str:
    """Held when every corpus names the same dominant class, not held when two name different
    ones, undecided otherwise (no verdict where a corpus has no interval or too few windows)."""
    for missing in (NO_INTERVAL, TOO_FEW):
        if missing in outcomes:
            return missing
    named = set(outcomes) & {c for c, _, _ in DOMINANCE}
    if len(named) > 1:
        return NOT_HELD
    return HELD if len(named) == 1 and len(set(outcomes)) == 1 else UNDECIDED


def _rule(checks: dict[str, list[bool]]) -> str:
    """Held: every check everywhere; not held: Retrievers neither within the range nor the
    smallest class anywhere, and no model stable; else partly held."""
    if all(all(v) for v in checks.values()):
        return HELD
    return PARTLY if any(checks["minority"]) or any(checks["stable"]) or any(checks["retriever_range"]) \
        else NOT_HELD


def _comparable_with_gemma(model: str) -> bool:
    """Whether a run's layers are the kind the paper's Gemma(-7B) has: a Gemma model's global
    layers, or a Gemma model without sliding windows (SPEC §8 (i): its local layers are not)."""
    return layer_kinds.base(model).startswith("gemma") and layer_kinds.kind(model) in (None, "global")


def _gemma_readings(dominant: dict[tuple[str, str], str]) -> list[str]:
    """Per Gemma run, its dominant class beside the paper's Mixer-dominated Gemma(-7B): stated
    for the layers the paper's model has (global), and said to be not comparable for the local
    layers, which it lacks (SPEC §8 (i))."""
    out = []
    for model in dict.fromkeys(m for m, _ in dominant):
        if not layer_kinds.base(model).startswith("gemma"):
            continue
        found = " / ".join(dominant[m, c] for m, c in dominant if m == model)
        if _comparable_with_gemma(model):
            agree = "as" if all(dominant[m, c] == "Mixer" for m, c in dominant if m == model) else "where"
            out.append(f"{model} is {found}-dominated (per corpus), {agree} the paper found Mixers in Gemma")
        else:
            out.append(f"{model} is {found}-dominated (per corpus): sliding-window layers, which the "
                       "paper's Gemma-7B does not have, so no comparison")
    return out


def claim5(study: Any, figures: Path) -> Claim:
    """Class shares, which of Mixer / Reset dominates, its stability, class signatures."""
    checks: dict[str, list[str]] = {"retriever_range": [], "minority": [], "stable": []}
    # (c) Mixers hold the most sink mass: close to the definition of a Mixer (its largest
    # contribution is the sink's), so it is reported with its interval and carries no verdict
    # (SPEC §8 (iii)).
    mixer_sink: list[str] = []
    rows, signature, notes = [], [], []
    dominant: dict[tuple[str, str], str] = {}
    for model, corpus, r in runs(study):
        is_class = _classes(r)
        share = _shares(is_class)
        spread = _share_intervals(r)
        lo, hi = RETRIEVER_RANGE
        retriever = spread.get("retriever")
        checks["retriever_range"].append(decide(retriever, lo, hi) if retriever else NO_INTERVAL)
        if checks["retriever_range"][-1] in (NOT_HELD, UNDECIDED):
            notes.append(f"{model} on {corpus}: Retrievers are {retriever.show(1, percent=True)} of "
                         "heads, " + ("outside" if checks["retriever_range"][-1] == NOT_HELD else
                                      "not clearly inside") + " the paper's 5.8–17.2 %.")
        minority = spread.get("minority")
        checks["minority"].append(decide(minority, high=0.0) if minority else NO_INTERVAL)
        dominance = spread.get("dominance")
        dominant[model, corpus] = categorize(dominance, DOMINANCE) if dominance else NO_INTERVAL
        mass = r.sink_mass.flatten()
        votes = r.vote_fractions.reshape(-1, 3)
        by_class = {c: mean(mass[m]) for c, m in is_class.items()}
        aligned = _sink_interval(r)
        mixer_sink.append(decide(aligned, low=0.0) if aligned else NO_INTERVAL)
        rows.append([model, corpus, retriever.show(1, percent=True) if retriever else pct(share["Retriever"]),
                     pct(share["Mixer"]), pct(share["Reset"]),
                     dominance.show() if dominance else "–", dominant[model, corpus]]
                    + [fmt(by_class[c]) for c in CLASSES] + [aligned.show() if aligned else "–"])
        i2 = r.n_values.tolist().index(2)
        for c, m in is_class.items():
            if m.any():
                signature.append([model, corpus, c, str(int(m.sum())),
                                  fmt(mean(votes[m, 0])), fmt(mean(votes[m, 1])), fmt(mean(votes[m, 2])),
                                  fmt(mean(r.precision[..., i2].flatten()[m])),
                                  fmt(mean(r.recall[..., i2].flatten()[m])),
                                  fmt(mean(r.f_score[..., i2].flatten()[m]))])
    stability = []
    for model in study.models:
        labels = [[x for row in study.analyses[model, c].labels for x in row] for c in study.corpus_names]
        both = [group for group in zip(*labels) if None not in group]  # labelled on every corpus
        agree = sum(all(x == group[0] for x in group) for group in both) / len(both) if both else math.nan
        stable = _stable([dominant[model, c] for c in study.corpus_names])
        stability.append([model, " / ".join(dominant[model, c] for c in study.corpus_names),
                          stable, pct(agree)])
        checks["stable"] += [stable] * len(study.corpus_names)

    def draw(ax, model, corpus):
        r = study.analyses[model, corpus]
        counts = r.class_counts()
        bottom = None
        for k, c in enumerate(CLASSES):
            ax.bar(counts.index, counts[c], bottom=bottom, color=plots.COLORS[k], label=c, width=0.8)
            bottom = counts[c] if bottom is None else bottom + counts[c]

    plots.grid(figures / "claim5_taxonomy.png", study.models, study.corpus_names, draw,
               title="Head classes per layer", xlabel="layer", ylabel="heads", logx=False,
               share_y=False)
    result = combine(checks, _rule)

    def tally(check: str, noun: str = "runs") -> str:
        """"held/all units", with the undecided ones and those without a verdict."""
        outcomes = ([s[2] for s in stability] if check == "stable" else mixer_sink if check == "mixer_sink"
                    else checks[check])
        held, undecided = outcomes.count(HELD), outcomes.count(UNDECIDED)
        none = len(outcomes) - held - undecided - outcomes.count(NOT_HELD)
        extra = [f"{undecided} undecided"] * bool(undecided) + [
            f"{none} without a verdict: too few windows or no per-window votes"] * bool(none)
        return f"{held}/{len(outcomes)} {noun}" + (f" ({'; '.join(extra)})" if extra else "")

    because = (f"Retriever share in 5.8–17.2 % on {tally('retriever_range')} "
               f"(smallest class on {tally('minority')}); dominant class stable across corpora "
               f"for {tally('stable', 'models')} ("
               + "; ".join(f"{s[0]}: {s[1]}" for s in stability)
               + f"); (c, holds by construction, no verdict) Mixers have the largest mean sink mass on "
               f"{tally('mixer_sink')}"
               + "".join(f"; {sentence} (reported, not part of the rule)" for sentence in _gemma_readings(dominant))
               + ".")
    return Claim(
        5, "Head taxonomy: Retrievers are a minority; Mixer or Reset dominates by architecture",
        "Retriever heads are a minority (5.8–17.2 % of heads); whether Mixer or Reset dominates "
        "depends on the architecture (Mixer in Gemma and LLaMA-3, Reset in Mistral and LLaMA-2) "
        "and is stable across corpora; Mixers align with the sink, Retrievers with the current "
        "token.",
        "Labels by plurality of source-winner votes over every query after the sink (SPEC §5); "
        "shares are of the labelled heads (a head without votes is unlabelled and in no class). "
        "What the rule tests: (a) Retriever share within 5.8–17.2 % on every run; (b) the dominant "
        "class among Mixer and Reset is the same on both corpora for each model. Held: (a) and (b) "
        "everywhere; not held: Retrievers neither within the range nor the smallest class "
        "anywhere, and no model stable; else partly held. What it does not test: \"by "
        "architecture\" (one model per family, so architecture is not varied apart from size and "
        "data), and (c) Mixers have a larger mean sink attention mass than Retrievers and Resets, "
        "which is reported with its interval but **holds by construction** (a Mixer is a head "
        "whose largest contribution is most often the sink's; the vote fractions per class are "
        "shown too and test nothing for the same reason), so it carries no verdict (SPEC §8 "
        "(iii)). A model with sliding-window layers is read as its global and its local layers "
        "apart (SPEC §8 (i)); only the global ones compare with the paper's Gemma-7B. "
        "Uncertainty (SPEC §8, ours): each "
        "share and share(Reset) − share(Mixer) with its 95 % interval from 1,000 seeded bootstrap "
        "resamples of the windows, labels recomputed from the drawn windows' votes, heads fixed; a "
        "check holds where its whole interval satisfies it, fails where none of it does, and is "
        "undecided otherwise (the dominant class is the one the whole interval points to); fewer "
        "than 8 windows: too few, no verdict. (c) is read on α_sink(Mixer) − max(α_sink(Retriever), "
        "α_sink(Reset)) ≥ 0, its interval from the same resamples (each head's α_sink from the "
        "drawn windows' per-window means).",
        result, because,
        blocks=[
            table(["model", "corpus", "Retriever [95 % interval]", "Mixer", "Reset",
                   "Reset − Mixer [95 % interval]", "dominant", "α_sink Retriever", "α_sink Mixer",
                   "α_sink Reset", "Mixer − max(other) [95 % interval]"], rows),
            "Stability across corpora (dominant class per corpus; share of heads with the same "
            "label on both):",
            table(["model", "dominant per corpus", "stable", "same label"], stability),
            "Geometric signature of each class: mean vote fractions and mean P, R, F at N = 2:",
            table(["model", "corpus", "class", "heads", "f_current", "f_sink", "f_other", "P_2",
                   "R_2", "F_2"], signature),
        ],
        figures=[("claim5_taxonomy.png", "Retriever / Mixer / Reset heads per layer.")],
        disagreements=notes + [
            f"{s[0]}: the dominant class is "
            + ("not the same on both corpora" if s[2] == NOT_HELD else "not decided on every corpus")
            + f" ({s[1]})." for s in stability if s[2] in (NOT_HELD, UNDECIDED)] + [
            f"{model} is {dom}-dominated on {corpus}; the paper found Mixers dominant in Gemma(-7B), whose "
            "layers are all global." for (model, corpus), dom in dominant.items()
            if _comparable_with_gemma(model) and dom == "Reset"],
    )


