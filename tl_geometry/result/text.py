"""The text summary of a :class:`~tl_geometry.result.HeadAnalysis` and its parts."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

import torch
from torch import Tensor

from ..functional.local_sink import LOCAL_SINK_FIELDS
from ..functional.taxonomy import CLASSES, UNLABELLED_NAME
from .headline import headline_text, layer_windows, n_label, shuffle_kind
from .labels import stability_note, stability_units
from .protocol import AnalysisLike
from .tables import finite_mean, mode
from .units import kv_group_size, kv_reduce, unit_text

#: One colour per class, shared by the HTML views, the plots and the notebook table;
#: ``"unlabelled"`` (a head with no votes, SPEC §5) is a neutral grey.
CLASS_COLORS = {"Retriever": "#d1495b", "Mixer": "#3b6ea8", "Reset": "#e59f3a", UNLABELLED_NAME: "#b5b5b5"}

#: What the three classes are (SPEC §5), for every legend: the names are the paper's and are
#: easy to misread ("Retriever" is not a retrieval head).
CLASSES_TEXT = (
    "Classes (SPEC §5): a Retriever is a head whose largest contribution α_j‖v_j‖ is most often "
    "the current token's own value; it is NOT a retrieval or induction head (those copy from "
    "earlier context: compare tl_geometry.head_scores). A Mixer's largest contribution is most "
    "often the sink's; a Reset's is most often another key. Votes count every query t ≥ 1, "
    "whatever queries= says, and labels depend on the text: margin = largest vote fraction "
    "minus the second; stab = share of 200 seeded bootstrap resamples of the sequences giving "
    "the same label; stab < 0.8 = unstable (marked ?, counted apart); stab nan = no stability: "
    "too few units (fewer than 8 sequences), a result without per-sequence votes, or a head "
    "without votes; never counted as unstable."
)

LEGEND = (
    "Legend: " + CLASSES_TEXT + " cur/sink/oth = fractions of source-winner votes (the current "
    "token / the sink / another key wins); α_sink = mean attention on the sink; κ = ‖v_sink‖ / mean "
    "‖v_j‖ over the other keys; cos = mean signed cos(v_sink, v_j); FN top/rnd = F_N of the "
    "top-N keys / of random N-subsets (1 = the selection is geometrically separated from the "
    "rest); F* = chance-corrected F_N; shuffled = the top-N keys with the non-sink values "
    "permuted (SPEC §3); N† = a dense N > (t+1)/4, where the precision floor N/(t+1) lifts F: "
    "shown, never headlined; unlabelled = no votes, in no class share. How to read these: "
    "docs/reading.md."
)


def layers_text(layers: tuple[int, ...]) -> str:
    if len(layers) > 4 and list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}..{layers[-1]}"
    return ", ".join(map(str, layers))


def class_totals(result: AnalysisLike) -> dict[str, int]:
    """Heads of each class over all layers; unlabelled heads are in none."""
    counts = result.class_counts().sum()
    return {c: int(counts[c]) for c in CLASSES}


def class_shares_text(result: AnalysisLike) -> str:
    """``Retriever 3 (25.0%), Mixer ..., Reset ...; 2 unlabelled (no votes; not in the shares)``
    (shares of the labelled heads only), then ``; unstable (stability < 0.8): 4 — Retriever 2,
    ...`` or why no head has a stability (:func:`~.labels.stability_note`), SPEC §5."""
    totals = class_totals(result)
    n_labelled = sum(totals.values())
    text = ", ".join(
        f"{c} {k} ({100 * k / n_labelled:.1f}%)" if n_labelled else f"{c} {k}" for c, k in totals.items()
    )
    if unlabelled := result.n_unlabelled:
        text += f"; {unlabelled} {UNLABELLED_NAME} (no votes; not in the shares)"
    if (note := stability_note(result)) is not None:
        return text + f"; label stability {note}"
    counts = unstable_counts(result)
    total = sum(counts.values())
    units = [u for u in stability_units(result) if u is not None and u[0] == "block"]
    blocks = ""
    if units:  # fewer than 8 sequences: a block bootstrap (SPEC §5)
        sizes = sorted(n for _, n in units)
        spread = f"{sizes[0]}" if sizes[0] == sizes[-1] else f"{sizes[0]}–{sizes[-1]}"
        blocks = (f" (block bootstrap: {spread} blocks of 128 voting queries per layer; no stability "
                  f"where a layer has fewer than 8)")
    return (text + f"; unstable (stability < 0.8): {total}"
            + (" — " + ", ".join(f"{c} {k}" for c, k in counts.items()) if total else "") + blocks)


def unstable_counts(result: AnalysisLike) -> dict[str, int]:
    """Unstable heads (label stability < 0.8, SPEC §5) of each class; a head whose stability is
    NaN (too few units, unknown) is in none."""
    flags = result.unstable.flatten().tolist()
    labels = [x for row in result.labels for x in row]
    return {c: sum(1 for label, bad in zip(labels, flags) if bad and label == c) for c in CLASSES}


def label_text(label: str | None) -> str:
    """A head's class as shown: its name, or "unlabelled"."""
    return UNLABELLED_NAME if label is None else label


def _shown(result: AnalysisLike, wanted: Sequence[int]) -> list[int]:
    analysed = result.n_values.tolist()
    shown = [n for n in wanted if n in analysed]
    return shown or list(result.headline_n[:3]) or [n for n in analysed if n >= 2][:3] or analysed[:3]


def _group_line(result: AnalysisLike, label: str, i: int | list[int]) -> str:
    """Mean F (and F*) of every group at N position(s) ``i``, averaged over heads and those N."""
    def mean(name: str, group: str) -> float:
        return finite_mean(result.metric(name, group)[..., i])

    line = f"  {label}: top-N {mean('f_score', 'top'):.3f} (F* {mean('f_score_cc', 'top'):.3f})"
    others = (("shuffled", "shuffled"), ("random", "random"), ("sink_removed", "sink removed"))
    return line + "".join(f"  {name} {mean('f_score', group):.3f}" for group, name in others)


def _baseline_error_line(result: AnalysisLike, shown: list[int]) -> list[str]:
    """The random baseline's standard errors of F_N at the shown N, median over heads (SPEC §3);
    none for a run without the baseline or a file without them."""
    def median(kind: str, i: int) -> float:
        values = result.baseline_error("f_score", kind)[..., i]
        values = values[torch.isfinite(values)]
        return float(values.median()) if values.numel() else float("nan")

    cells = [(n, median("monte_carlo", result._n_index(n)), median("sequences", result._n_index(n))) for n in shown]
    cells = [c for c in cells if not (math.isnan(c[1]) and math.isnan(c[2]))]
    if not cells:
        return []
    draws = result.metadata.get("random_samples")
    subsets = f" ({draws} subsets per query)" if draws else ""
    line = f"  random F_N standard error, median over heads: Monte Carlo{subsets} | over sequences: "
    return textwrap.wrap(line + ", ".join(f"N={n_label(result, n)}: {mc:.4f} | {seq:.4f}" for n, mc, seq in cells),
                         100, subsequent_indent="    ")


def summary(result: AnalysisLike, n_values: Sequence[int], top: int | None) -> str:
    """See :meth:`HeadAnalysis.summary`."""
    meta = result.metadata
    shown = _shown(result, n_values)
    parts = [f"{meta['n_sequences']} sequences × {meta['n_positions']} positions"] \
        if "n_sequences" in meta and "n_positions" in meta else []
    parts += [f"{k}={meta[k]}" for k in ("queries", "distance", "space") if meta.get(k) is not None]
    if (kind := shuffle_kind(result)) != "values":  # the shuffled group is another null (SPEC §3)
        parts.append(f"shuffled = the {kind} null")
    name, klass = meta.get("model_name"), meta.get("model_class")
    model = (f"model {name}" if name else f"a {klass} with no model_name" if klass
             else "model unknown (pass model= to analyze_heads to record it)")
    lines = [
        f"tl_geometry head analysis — {model}",
        f"layers {layers_text(result.layers)} × {result.n_heads} heads "
        f"({result.n_layers * result.n_heads} heads); " + (", ".join(parts) or "run settings not recorded"),
    ]
    if meta.get("distance", "euclidean") == "euclidean":
        lines.append("N=1 is trivial for the Euclidean distance (F_1 = 1); the headline is N ≥ 2.")
    lines += textwrap.wrap(headline_text(result), 100)
    lines += textwrap.wrap(sink_check_text(result), 100)
    lines += textwrap.wrap(window_text(result), 100)
    lines += textwrap.wrap(_local_sink_text(result), 100)
    lines += ["", *textwrap.wrap("Classes: " + class_shares_text(result), 100, subsequent_indent="  ")]
    lines += [textwrap.indent(x, "  ") for x in textwrap.wrap(kind_shares_text(result), 98)]
    lines += textwrap.wrap(value_geometry_text(result), 100, subsequent_indent="  ")
    for n in shown:
        lines.append(_group_line(result, f"mean F_{n_label(result, n)}", result._n_index(n)))
    if headline := result.headline_n:
        span = f"{headline[0]}" if len(headline) == 1 else f"{headline[0]}..{headline[-1]}"
        lines.append(_group_line(result, f"headline N = {span}",
                                 [result._n_index(n) for n in headline]))
    lines += _baseline_error_line(result, shown)
    table = result.paired_sink_summary().set_index("n")
    cells = [f"    N={n_label(result, n)}: F_N(with) / F_N(removed) {table.paired_median_ratio[n]:.2f}, "
             f"fraction ≤ 1/2 {table.paired_median_halved[n]:.2f} ({table.paired_heads[n]} heads)"
             for n in shown if table.paired_heads[n] > 0]
    if cells:  # the paired sink effect (SPEC §3, comparison 3), where it is defined
        lines += ["  paired sink effect (instances whose top-N set holds the sink; median over "
                  "heads):", *cells]
    lines += _layer_kind_lines(result, shown)
    if result.bounds is not None:
        frac = result.certified_fraction
        lines.append("  heads certified (P̲ = R̲ = 1): " + ", ".join(
            f"N={n_label(result, n)}: {100 * float(frac[result._n_index(n)]):.1f}%" for n in shown))
        lines.append("  shell certificate (SPEC §6d), mean F̲_N / mean F_N, K=0 | K=N: " + ", ".join(
            f"N={n_label(result, n)}: {_ratio(result.shell_f_score, result.f_score, result._n_index(n))}"
            f" | {_ratio(result.shell_n_f_score, result.f_score, result._n_index(n))}" for n in shown))
        rhos = result.rho_by_n("shell_n")
        if len(rhos):
            lines.append("  shell (K=N) vs measured F_N, Spearman ρ across heads within each headline N: "
                         + ", ".join(f"N={int(n)}: {rho:.2f}" for n, rho in zip(rhos.n, rhos.rho)))
        agreement = result.best_n_vs_chance("shell_n")
        verdict = ("" if agreement.above_chance or not agreement.heads
                   else "; at or below chance: it predicts nothing" if not agreement.excess > 0
                   else "; not significantly above chance")
        lines += textwrap.wrap(
            f"  best N over the headline range {list(result.headline_n)}: the shell (K=N) gives the "
            f"measured one for {agreement.text()}{verdict}", 100, subsequent_indent="    ")

    n_heads = result.n_layers * result.n_heads
    # Rank by the first shown N of the headline range; a dense N is never the headline.
    rank_n = next((n for n in shown if n in result.headline_n),
                  next((n for n in shown if n >= 2), shown[0]))
    if top is None or top >= n_heads:
        order = list(range(n_heads))
        title = f"All {n_heads} heads, in layer order:"
    else:
        gain = result.f_gain[..., result._n_index(rank_n)].flatten()
        order = torch.nan_to_num(gain, nan=-torch.inf).argsort(descending=True, stable=True)[:top].tolist()
        title = (f"Top {len(order)} of {n_heads} heads by F_{rank_n} gain (top-N minus random); "
                 "summary(top=None) lists every head:")
    header = (f"{'layer':>5} {'head':>4} {'class':<10} {'cur/sink/oth':>14} {'margin':>6} "
              f"{'stab':>5} {'α_sink':>6} {'κ':>6} {'cos':>6}")
    header += "".join(f" {'F' + n_label(result, n) + ' top/rnd':>13}" for n in shown)
    lines += ["", title, header]
    f = {n: result.f_score[..., result._n_index(n)] for n in shown}
    r = {n: result.random_f_score[..., result._n_index(n)] for n in shown}
    fractions, labels = result.vote_fractions, result.labels
    margin, stability, unstable = result.label_margin, result.label_stability, result.unstable
    for flat in order:
        li, h = divmod(flat, result.n_heads)
        votes = "/".join(f"{float(x):.2f}" for x in fractions[li, h])
        mark = "?" if bool(unstable[li, h]) else " "
        row = (f"{result.layers[li]:>5} {h:>4} {label_text(labels[li][h]):<10}{mark}{votes:>14} "
               f"{float(margin[li, h]):>6.2f} {float(stability[li, h]):>5.2f} "
               f"{float(result.sink_mass[li, h]):>6.3f} {float(result.sink_norm_ratio[li, h]):>6.3f} "
               f"{float(result.sink_cosine[li, h]):>6.3f}")
        row += "".join(f" {float(f[n][li, h]):>6.3f}/{float(r[n][li, h]):<6.3f}" for n in shown)
        lines.append(row.rstrip())
    lines += ["", *textwrap.wrap(LEGEND, 100)]
    return "\n".join(lines)


def _layer_kind_lines(result: AnalysisLike, shown: list[int]) -> list[str]:
    """On a model with sliding-window layers, per kind of layer (SPEC §8 (i)): the mean sink mass
    and κ, the classes, and mean F per group at each shown N."""
    parts = result.by_layer_kind() if hasattr(result, "by_layer_kind") else {}
    lines = []
    for kind, part in parts.items():
        lines += textwrap.wrap(f"{kind} layers {layers_text(part.layers)}: sink mass "
                               f"{finite_mean(part.sink_mass):.3f}, "
                               f"κ {finite_mean(part.sink_norm_ratio):.2f}; classes " + class_shares_text(part),
                               100, initial_indent="  ", subsequent_indent="    ")
        for n in shown:
            lines.append(_group_line(part, f"  {kind} mean F_{n_label(part, n)}", part._n_index(n)))
    if lines:
        lines.insert(0, "  By layer kind (SPEC §8 (i); read these, not the pooled lines, on this model):")
    return lines


def sink_check_text(result: AnalysisLike) -> str:
    """Where the sink is and how strong (SPEC §1): its rule and positions, and in how many layers
    it is the most attended of the first 32 tokens ("WEAK SINK" where not in most); empty
    without the record."""
    record = result.metadata.get("sink")
    if not isinstance(record, dict):
        return ""
    positions = record.get("positions") or []
    distinct = sorted(set(positions))
    where = (f"position {distinct[0]} of every window" if len(distinct) == 1
             else f"positions {distinct[:6]}{' …' if len(distinct) > 6 else ''} (one per window)")
    rule = "chosen as each window's most attended of its first 32 tokens" if record.get("rule") == "auto" else "given"
    text = f"Sink (SPEC §1): {where}, {rule}."
    sink_mass, other_mass = record.get("sink_mass"), record.get("other_mass")
    if not isinstance(sink_mass, list) or not isinstance(other_mass, list):
        return text
    pairs = [(s, o) for s, o in zip(sink_mass, other_mass) if s is not None and o is not None]
    if not pairs:
        return text + " Check: windows too short to read (33 tokens or more are needed)."
    strong = sum(s >= o for s, o in pairs)
    mean_s, mean_o = sum(s for s, _ in pairs) / len(pairs), sum(o for _, o in pairs) / len(pairs)
    text += (f" Check: the most attended of the first 32 tokens in {strong} of {len(pairs)} layers "
             f"(mean mass {mean_s:.3f}, the most attended other key {mean_o:.3f}).")
    if record.get("weak"):
        text += (" WEAK SINK: the model may have no sink; read the sink figures as describing an ordinary token."
                 if record.get("rule") == "auto" else
                 " WEAK SINK: read the sink figures as describing an ordinary token, or re-run with sink='auto'.")
    chosen_from = record.get("chosen_from_layers")
    if record.get("rule") == "auto" and isinstance(chosen_from, list) and chosen_from:
        text += (f" Chosen from {len(chosen_from)} layer{'s' * (len(chosen_from) != 1)}: "
                 f"{layers_text(tuple(chosen_from))}.")
    return text


def kind_shares_text(result: AnalysisLike) -> str:
    """On a model with sliding-window layers, the classes of its global and local layers apart
    and the local layers' beyond-window votes (SPEC §1, §5); empty otherwise."""
    windows = layer_windows(result)
    if all(w is None for w in windows) or all(w is not None for w in windows):
        return ""
    labels = result.labels
    parts = []
    for kind, pick in (("global", lambda w: w is None), ("local", lambda w: w is not None)):
        rows = [labels[i] for i, w in enumerate(windows) if pick(w)]
        heads = [x for row in rows for x in row if x is not None]
        counts = ", ".join(f"{c} {sum(1 for x in heads if x == c)}" for c in CLASSES)
        parts.append(f"{kind} layers ({len(rows)}): {counts} of {len(heads)} labelled heads")
    beyond = getattr(result, "beyond_votes", None)
    if beyond is not None and int(beyond.sum()):
        local = [i for i, w in enumerate(windows) if w is not None]
        total = beyond[local].sum((0, 1)).double()
        share = total / total.sum()
        parts.append(f"local queries that cannot see the sink vote (apart, not in the labels): current "
                     f"{float(share[0]):.2f}, other {float(share[2]):.2f} ({int(total.sum())} votes)")
    return "Classes by layer kind: " + "; ".join(parts) + "."


def window_text(result: AnalysisLike) -> str:
    """The sliding windows (SPEC §1, ours) and, per windowed layer, how many of its instances
    could see the sink; empty when no layer has a window."""
    windows = layer_windows(result)
    if all(w is None for w in windows):
        return ""
    visible, instances = result.metadata.get("sink_visible"), result.metadata.get("instances")
    known = isinstance(visible, list) and isinstance(instances, list) and len(visible) == len(instances) == len(windows)
    earlier = result.metadata.get("sink_read_earlier")
    earlier = earlier if isinstance(earlier, list) and len(earlier) == len(windows) else [0] * len(windows)
    cells = []
    for i, (layer, w) in enumerate(zip(result.layers, windows)):
        if w is not None:
            counts = f" {visible[i]}/{instances[i]}" if known else ""  # type: ignore[index]
            moved = f" (+{earlier[i]} read at t_sink)" if earlier[i] else ""
            cells.append(f"L{layer} (w={w}){counts}{moved}")
    return ("Sliding windows (SPEC §1): candidates are the keys a query sees (t − w < i ≤ t); a query "
            "whose window starts after the sink has no sink (no sink comparison, no sink vote); with "
            "the last-query protocol the sink figures are read at t_sink = p + w − 1, the last query "
            "that sees the sink, and the label comes from the queries that see it (the others' votes "
            "are kept apart). "
            + ("Instances that see the sink: " if known else "Windowed layers: ")
            + ", ".join(cells) + "; on global layers every query at or after the sink sees it.")


def _local_sink_text(result: AnalysisLike) -> str:
    """The most common local sink over every (sequence, local head) that has one (its token id
    where known, else its position) and the median mass; empty without local sinks."""
    import numpy as np

    local_sink = getattr(result, "local_sink", None)
    if local_sink is None:
        return ""
    local = [li for li, w in enumerate(layer_windows(result)) if w is not None]
    figures = local_sink[:, :, local].double().permute(0, 2, 3, 1).reshape(-1, len(LOCAL_SINK_FIELDS)).numpy()
    figures = figures[np.isfinite(figures[:, LOCAL_SINK_FIELDS.index("mass")])]
    if not len(figures):
        return ""
    tokens = figures[:, LOCAL_SINK_FIELDS.index("token")]
    what, column = (("token id", tokens) if np.isfinite(tokens).any()
                    else ("position", figures[:, LOCAL_SINK_FIELDS.index("position")]))
    value, share = mode(column)
    mass = float(np.median(figures[:, LOCAL_SINK_FIELDS.index("mass")]))
    return (f"Local sinks (local_sinks()): {what} {int(value)} in {100 * share:.0f} % of {len(figures)} "
            f"(sequence, local head); median mass {mass:.2f}.")


def _median_and_share(x: Tensor, below: float) -> tuple[float, float]:
    finite = x[x.isfinite()].double()
    if not finite.numel():
        return math.nan, math.nan
    return float(finite.quantile(0.5)), float((finite < below).double().mean())


def value_geometry_text(result: AnalysisLike) -> str:
    """Medians and shares of κ, c_sink and cos(v_sink, mean v) (SPEC §4) over their statistical
    unit: the KV heads under GQA/MQA."""
    group = kv_group_size(result)
    unit = f"over the {unit_text(result)}"
    if group > 1:
        unit += f", not the {result.n_layers * result.n_heads} query heads that share them"
    kappa, kappa_below = _median_and_share(kv_reduce(result.sink_norm_ratio, group, "sink_norm_ratio"), 1.0)
    cos, cos_below = _median_and_share(kv_reduce(result.sink_cosine, group, "sink_cosine"), 0.0)
    mean_cos, _ = _median_and_share(kv_reduce(result.sink_mean_cosine, group, "sink_mean_cosine"), 0.0)
    return (f"Sink value geometry (value-only figures, {unit}): median κ {kappa:.3f} "
            f"(κ < 1 for {_percent(kappa_below)}), median c_sink {cos:+.3f} (negative for "
            f"{_percent(cos_below)}), median cos(v_sink, mean v) {mean_cos:+.3f}.")


def _ratio(bound: Tensor, measured: Tensor, i: int) -> str:
    b, m = finite_mean(bound[..., i]), finite_mean(measured[..., i])
    return f"{b / m:.2f}" if m > 0 else "n/a"


def _percent(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"
