"""The offline HTML report of an analysis, and the ``tl-geometry report`` command.

:func:`write_report` turns a :class:`~tl_geometry.HeadAnalysis` (plus, optionally, the cache it
came from) into a folder::

    tl_geometry_report/
      index.html          self-contained: circuitsvis's JavaScript once, figures inlined
      analysis.pt         the HeadAnalysis (HeadAnalysis.load)
      heads.csv           one row per head: class, vote fractions, margin, stability, sink figures
                          (and the head scores when given)
      labels.csv          one row per head: the label file of HeadAnalysis.export_labels
      metrics.csv         long form: layer, head, N, group, P/R/F, margin, inversions, ...
      class_counts.csv    heads of each class per layer
      sink_effect.csv     per N: the pooled and the paired sink effect on F_N
      null_decomposition.csv  per N: F*(top) − F*(null) for each null (when write_report gets nulls=)
      figures/*.png|svg   F_N (and F*_N) against N by class, F_N by layer, sink per layer, class counts

``tl-geometry prune`` / ``capacity --out DIR`` tables already in the folder add an Ablation /
Retrieval capacity section. The command itself lives in :mod:`tl_geometry.cli.report`.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..functional.taxonomy import CLASSES
from ..result import HeadAnalysis
from ..result.headline import GEOMETRY_GAP, dense_from, geometry_reading, n_label
from ..result.labels import (
    HIGH_SCORE,
    check_score_heads,
    check_scores,
    label_agreement,
    stability_note,
)
from ..result.schema import SHUFFLE_KINDS
from ..result.tables import finite_mean, null_decomposition
from ..result.text import (
    CLASSES_TEXT,
    class_shares_text,
    kind_shares_text,
    sink_check_text,
    unstable_counts,
    value_geometry_text,
    window_text,
)
from . import _page
from .attention import attention_view, contribution_view
from .plots import SAVE_DPI, ablation_plot, class_counts_plot, f_curves_plot, save_figure, sink_plot
from .sink import sink_view
from .taxonomy import CLASS_COLORS, taxonomy_view
from .tokens import token_view

__all__ = ["DEFAULT_OUT", "agreement_section", "capacity_section", "example_heads", "label_confidence_section",
           "n_means_table", "null_decomposition_section", "sink_effect_section", "write_report"]

#: Where write_report (and tl-geometry report) writes by default.
DEFAULT_OUT = "tl_geometry_report"

#: The id of the report's one statement of what the classes are; other sections link to it.
CLASSES_ID = "tlg-classes"
_CLASSES_LINK = f'<a href="#{CLASSES_ID}">what the classes, margin and stability are</a>'


def example_heads(result: HeadAnalysis, n: int = 2) -> list[tuple[str, int, int]]:
    """Per class present, the head where the top-``n`` set beats random subsets the most
    (largest ``f_gain`` at ``N = n``): ``[(class, layer, head), ...]``."""
    gain = torch.nan_to_num(result.f_gain[..., result._n_index(n)], nan=-torch.inf)
    labels = result.labels
    chosen = []
    for c in CLASSES:
        mask = torch.tensor([[label == c for label in row] for row in labels])
        if mask.any():
            flat = int(torch.where(mask, gain, -torch.inf).flatten().argmax())
            li, h = divmod(flat, result.n_heads)
            chosen.append((c, result.layers[li], h))
    return chosen


def _figure(fig: Any, stem: Path, caption: str, dpi: int = 90) -> str:
    """Save ``fig`` as ``stem``.png and .svg, and inline the PNG with ``caption``."""
    # 90 dpi keeps the inlined PNGs small (the page stays a few MB); the SVGs are the print copies.
    data = base64.b64encode(save_figure(fig, stem, dpi=dpi)[0].read_bytes()).decode("ascii")
    return (f'<figure class="tlg-figure"><img alt="{html.escape(caption)}" '
            f'src="data:image/png;base64,{data}"><figcaption class="tlg-caption">'
            f"{html.escape(caption)}</figcaption></figure>")


def _table(frame: Any, digits: int = 3) -> str:
    return frame.to_html(index=False, classes="tlg-table", border=0, float_format=lambda x: f"{x:.{digits}f}")


def _n_table(result: HeadAnalysis, table: Any, columns: dict[str, str]) -> str:
    """``_table`` of a per-N table: N labelled (dense N marked †), ``columns`` renamed."""
    return _table(table.assign(n=[n_label(result, n) for n in table.n]).drop(columns="dense")
                  .rename(columns={"n": "N", **columns}))


#: Columns of the per-N table: (heading, metric, group); the two differences follow SPEC §3.
_PER_N = (("F top-N", "f_score", "top"), ("F* top-N", "f_score_cc", "top"),
          ("F shuffled", "f_score", "shuffled"), ("F random", "f_score", "random"),
          ("F sink removed", "f_score", "sink_removed"))


def n_means_table(result: HeadAnalysis):
    """Mean over heads, per analysed N (dense N marked ``†``), of F_N (and F*_N) for each
    selection group, with the split of SPEC §3: ``top − shuffled`` (the net effect of the value
    geometry, of either sign, read by ``geometry``:
    :func:`~tl_geometry.result.headline.geometry_reading`) and ``shuffled − random``."""
    import pandas as pd

    rows = []
    for i, n in enumerate(result.n_values.tolist()):
        row: dict[str, Any] = {"N": n_label(result, n)}
        row.update({head: finite_mean(result.metric(m, g)[..., i]) for head, m, g in _PER_N})
        row["top − shuffled"] = row["F top-N"] - row["F shuffled"]
        row["shuffled − random"] = row["F shuffled"] - row["F random"]
        row["geometry"] = geometry_reading(row["top − shuffled"])
        rows.append(row)
    return pd.DataFrame(rows)


def layer_kind_section(result: HeadAnalysis) -> list[str]:
    """On a model with sliding-window layers, its global and local layers apart (SPEC §8 (i)),
    then the local heads' votes from beyond the sink's window (SPEC §1, §5); else nothing."""
    import pandas as pd

    parts = result.by_layer_kind()
    if not parts:
        return []
    rows = []
    for kind, part in parts.items():
        counts = part.class_counts().sum()
        for i, n in enumerate(part.n_values.tolist()):
            rows.append({"layers": kind, "N": n_label(part, n), "α_sink": finite_mean(part.sink_mass),
                         "κ": finite_mean(part.sink_norm_ratio),
                         **{c: int(counts[c]) for c in counts.index},
                         **{head: finite_mean(part.metric(m, g)[..., i]) for head, m, g in _PER_N}})
    beyond = result.beyond_table()
    out = ["<h2>Global and local layers apart</h2>", _table(pd.DataFrame(rows)),
           '<p class="tlg-caption">A sliding-window (local) layer attends over its last w keys, a '
           "global one over every key; the two kinds are read apart (SPEC §8 (i)): the pooled "
           "figures above mix them.</p>"]
    if len(beyond):
        by_layer = beyond.groupby("layer").agg(
            window=("window", "first"), heads=("head", "count"),
            beyond_current=("beyond_current", "sum"), beyond_other=("beyond_other", "sum"),
            label_reset=("label", lambda x: int((x == "Reset").sum())),
            beyond_label_reset=("beyond_label", lambda x: int((x == "Reset").sum()))).reset_index()
        by_layer["beyond_current_share"] = by_layer.beyond_current / (by_layer.beyond_current
                                                                      + by_layer.beyond_other)
        out += ["<h3>Local layers: queries beyond the sink's window</h3>", _table(by_layer),
                '<p class="tlg-caption">Votes of the queries whose window starts after the sink '
                "(they cannot vote \"sink\"), per local layer, beside the labels from the queries "
                "that see it; <code>result.beyond_table()</code> has them per head.</p>"]
    return out


def null_decomposition_section(result: HeadAnalysis, nulls: Mapping[str, HeadAnalysis]) -> list[str]:
    """The decomposition of the top − shuffled gap over the nulls of ``result`` and ``nulls``
    (kind → analysis; :func:`~tl_geometry.result.null_decomposition`, SPEC §3)."""
    table = null_decomposition({result.shuffle: result, **nulls}, "f_score_cc")
    gaps = {f"top − {kind}": f"F*(top) − F*({kind})" for kind in SHUFFLE_KINDS}
    return [
        "<h2>Decomposing the top − shuffled gap</h2>", _n_table(result, table, {"top": "F* top-N", **gaps}),
        '<p class="tlg-caption">Per N, the mean over heads of F*(top) − F*(null) for each null (same '
        "attention, same top-N set, same seed; SPEC §3). values: every non-sink value permuted — the "
        "net effect of the geometry, of either sign. norms: each key keeps its direction and takes a "
        "permuted norm — what the real pairing of keys with norms carries. directions: each key keeps "
        "its norm and takes a permuted direction — what the real pairing with directions carries. "
        "unselected: only the values outside the top-N set permuted — what the real unselected values "
        "do to the selection; negative where attended but unselected keys carry values aligned with "
        f"it and crowd the ball. A gap ≥ {GEOMETRY_GAP} reads \"geometry raises separability\", one ≤ "
        f"−{GEOMETRY_GAP} \"geometry lowers separability\" (never \"equal\"). † dense N, not "
        "headlined.</p>",
    ]


def sink_effect_section(result: HeadAnalysis) -> list[str]:
    """The sink effect on F_N per N, pooled and paired (SPEC §3;
    :meth:`~tl_geometry.result.HeadAnalysis.paired_sink_summary`)."""
    table = result.paired_sink_summary()
    shown = _n_table(result, table, {
        "pooled_f_sink_in": "pooled F, sink in S_N", "instances_in": "instances in",
        "pooled_f_sink_out": "pooled F, sink outside", "instances_out": "instances out",
        "f_sink_removed": "F, sink removed", "paired_median_ratio": "paired: median ratio",
        "paired_median_halved": "paired: median fraction ≤ 1/2", "paired_heads": "paired: heads",
        "paired_instances": "paired: instances"})
    missing = "" if int(table.paired_heads.sum()) else (
        " No head has a paired instance here (no top-N set holds the sink, or the analysis was "
        "saved without paired figures): the paired columns are NaN.")
    return [
        "<h2>Sink effect on F_N: pooled and paired</h2>", shown,
        '<p class="tlg-caption">Pooled (comparison 1): mean F_N of the top-N instances with / without '
        "the sink in the selection, every instance of every head pooled; it mixes heads and can show "
        "an effect no head has. Paired (comparison 3, ours, the headline form): per head, over the "
        "instances whose top-N set holds the sink, the median of F_N(with sink) / F_N(sink re-selected "
        "away) and the fraction ≤ 1/2 (\"the sink halves F_N\"); the columns give their median over the "
        "heads that have such instances. A ratio near 1 means the sink leaves F_N alone. "
        f"† dense N, not headlined (SPEC §3).{html.escape(missing)}</p>",
    ]


def label_confidence_section(result: HeadAnalysis) -> list[str]:
    """How sure the labels are (SPEC §5): the unstable heads (stability < 0.8), counted per class
    and listed, or why no head has a stability; it links to the report's class definitions."""
    table = result.heads_table()
    columns = ["layer", "head", "label", "vote_current", "vote_sink", "vote_other", "label_margin", "label_stability"]
    shaky = table[table["unstable"]][columns]
    counts = unstable_counts(result)
    note = stability_note(result)
    median = ("" if note is not None  # no stability to take the median of: said below
              else f", median stability {finite_mean(result.label_stability.nanmedian().reshape(1)):.3f}")
    if result.sequence_votes is None:
        body = ('<p class="tlg-caption">This result has no per-sequence votes (a file of format 3 or '
                "earlier): the stability is unknown. Re-run the analysis to get it.</p>")
    elif note is not None:
        body = (f'<p class="tlg-caption">Label stability {html.escape(note)}: the bootstrap over so few '
                "sequences cannot move a label, so no stability is given (NaN in heads.csv and "
                "labels.csv) and no head is counted unstable.</p>")
    elif shaky.empty:
        body = '<p class="tlg-caption">No head is unstable: every label survives ≥ 80 % of the resamples.</p>'
    else:
        body = (f'<p class="tlg-caption">{len(shaky)} unstable heads ('
                + html.escape(", ".join(f"{c} {k}" for c, k in counts.items())) + "), counted apart from "
                "the stable ones:</p>" + _table(shaky))
    return [
        "<h2>Label confidence</h2>",
        f'<p class="tlg-caption">See {_CLASSES_LINK}. Median margin '
        f"{finite_mean(result.label_margin.nanmedian().reshape(1)):.3f}{median}.</p>",
        body,
    ]


def agreement_section(result: HeadAnalysis, scores: Any) -> list[str]:
    """"Do the labels agree with other detectors?" (SPEC §9): the tables of
    :func:`~tl_geometry.result.labels.label_agreement` and the model's Sink^ε."""
    agreement = label_agreement(result, scores)
    mean = agreement["mean"].reset_index().rename(columns={"label": "class"})
    share = agreement["share_high"].reset_index().rename(columns={"index": "score"})
    rho = agreement["spearman"].reset_index().rename(columns={"index": "vote fraction"})
    eps = scores.attrs.get("sink_epsilon")
    sink = "" if eps is None or math.isnan(float(eps)) else (
        f" Sink^ε (share of heads with sink_rate > {scores.attrs.get('epsilon', 0.3)}, Gu et al.): "
        f"{100 * float(eps):.1f} %.")
    return [
        "<h2>Do the labels agree with other detectors?</h2>",
        '<p class="tlg-caption">Head scores read from attention patterns alone (SPEC §9): '
        "previous_token, duplicate_token and induction on BOS + R random tokens repeated (TransformerLens "
        "head_detector's patterns, as a mean weight on the expected key), sink_rate on real text, "
        "retrieval (after Wu et al.) on a needle repeated at the end of a text window. A Retriever is "
        "not a retrieval or induction head: read these tables to see where those heads land."
        f"{html.escape(sink)}</p>",
        "<h3>Mean score per class</h3>", _table(mean),
        f"<h3>Share of each class among the heads with a score above {HIGH_SCORE}</h3>", _table(share),
        "<h3>Spearman's ρ between vote fractions and scores (labelled heads)</h3>", _table(rho),
    ]


def _header(result: HeadAnalysis, files: list[str]) -> str:
    meta = result.metadata
    n_heads = result.n_layers * result.n_heads
    headline = result.headline_n
    where = [result._n_index(n) for n in headline]
    facts = {
        "model": meta.get("model_name", "?"),
        "text": meta.get("text", "?"),
        "sequences × positions": f"{meta.get('n_sequences', '?')} × {meta.get('n_positions', '?')}",
        "queries": meta.get("queries", "?"),
        "N": ", ".join(n_label(result, n) for n in result.n_values.tolist()),
        "headline range 2 ≤ N ≤ (t+1)/4": (
            (f"N ≤ {dense_from(result):g}: " if math.isfinite(dense_from(result)) else "t+1 not recorded: ")
            + (", ".join(map(str, headline)) or "no analysed N")
            + " (dense N, marked †, are shown and shaded, never headlined)"),
        "distance / space": f"{meta.get('distance', '?')} / {meta.get('space', '?')}",
        "random subsets per query": meta.get("random_samples", "?"),
        "value shuffles per query": f"{meta.get('shuffle_samples', '?')} (the {result.shuffle} null)",
        "heads": f"{len(result.layers)} layers × {result.n_heads} = {n_heads}"
                 + (f" query heads sharing {result.n_layers * result.n_kv_heads} KV heads"
                    if result.kv_group_size > 1 else ""),
        "sink": sink_check_text(result) or "not recorded (a result made before the sink check)",
        "sink value geometry": value_geometry_text(result),
        "classes": class_shares_text(result),
    }
    if kinds := kind_shares_text(result):
        facts["classes by layer kind"] = kinds
    if windows := window_text(result):
        facts["sliding windows"] = windows
    if where:
        groups = (("top", "top-N"), ("shuffled", "shuffled"), ("random", "random"), ("sink_removed", "sink removed"))
        span = "N = " + (f"{headline[0]}..{headline[-1]}" if len(headline) > 1 else str(headline[0]))
        for metric, name in (("f_score", "F_N"), ("f_score_cc", "F*_N (chance-corrected)")):
            facts[f"mean {name} over {span}: " + " / ".join(n for _, n in groups)] = " / ".join(
                f"{finite_mean(result.metric(metric, g)[..., where]):.3f}" for g, _ in groups)
    rows = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
                   f"{html.escape(str(v))}</td></tr>" for k, v in facts.items())
    links = " · ".join(f'<a href="{html.escape(f)}">{html.escape(f)}</a>' for f in files)
    return (
        "<h1>tl_geometry report</h1>"
        '<p class="tlg-caption">Geometric separability of the top-N attended tokens\' contributions '
        "α_i·v_i, attention-sink diagnostics and the Retriever / Mixer / Reset taxonomy, per layer and "
        "head. Euclidean F_1 = 1 trivially; the headline is 2 ≤ N ≤ (t+1)/4: above it precision cannot "
        "fall below N/(t+1), so F rises for reasons that are not geometry. F* corrects for that floor "
        "(SPEC §3).</p>"
        f'<table class="tlg-table">{rows}</table>'
        f'<p class="tlg-caption" id="{CLASSES_ID}"><b>What the classes are.</b> {html.escape(CLASSES_TEXT)}</p>'
        f'<p class="tlg-caption">Files: {links}</p>'
    )


def critical_text(sens: Any) -> str:
    """The report's line on the critical heads (SPEC §7) of a ``sensitivity.csv`` table; "not
    determined" for a table without ``loss_increase_se``."""
    if "loss_increase_se" not in sens or "critical" not in sens:
        return ("Critical heads: not determined — this sensitivity.csv has no loss_increase_se "
                "column (no standard errors over windows); re-run tl-geometry prune.")
    critical = sens[sens["critical"].astype(bool)].sort_values("loss_increase", ascending=False)
    names = ", ".join(f"L{r.layer}H{r.head}" for r in critical.itertuples()) or "none"
    return (f"Critical heads: {names}. Rule (SPEC §7): loss increase ≥ max(0.1 nats, 5 % of the "
            "dense loss) and the lower end of its 95 % interval over windows (Student t on the "
            "paired per-window changes) above 0; a robust outlier of the sweep (column outlier: "
            "median + 3.5 · 1.4826 · MAD) is shown, not used.")


def _ablation(out: Path, figures: Path) -> list[str]:
    import pandas as pd

    parts = []
    sens_path, sparse_path = out / "sensitivity.csv", out / "sparsification.csv"
    if sens_path.is_file():
        sens = pd.read_csv(sens_path)
        top = sens.sort_values("loss_increase", ascending=False).head(12)
        parts.append("<h3>Single-head ablation: largest loss increase</h3>" + _table(top, 4)
                     + f'<p class="tlg-caption">{html.escape(critical_text(sens))}</p>')
    if sparse_path.is_file():
        sparse = pd.read_csv(sparse_path)
        parts.append(_figure(ablation_plot(sparse), figures / "ablation", "Loss against the fraction of "
                             "heads kept, per ordering (random: mean and min–max over seeds).", dpi=SAVE_DPI))
    return (["<h2>Ablation</h2>", *parts]) if parts else []


def capacity_section(out: Path, figures: Path) -> list[str]:
    """The "Retrieval capacity" section from ``out/capacity.csv`` and ``out/capacity_heads.csv``;
    empty when the folder has neither."""
    import pandas as pd

    from ..functional.stats import spearman
    from .capacity import capacity_plot, correlation_plot

    parts = []
    curve_path, heads_path = out / "capacity.csv", out / "capacity_heads.csv"
    if curve_path.is_file():
        curve = pd.read_csv(curve_path)
        ok = curve[curve["within_tolerance"].astype(bool)].groupby("mode")["n"].min()
        stars = [f"{mode}: N* = {int(ok[mode]) if mode in ok else 'none'}" for mode in sorted(set(curve["mode"]))]
        tol = float(curve["tolerance"].iloc[0]) if "tolerance" in curve else float("nan")
        parts += [_figure(capacity_plot(curve), figures / "capacity", "Next-token loss when every head "
                          "keeps only each query's top-N keys (renormalised, or the rest deleted); ★ N*."),
                  f'<p class="tlg-caption">{html.escape("; ".join(stars))} (smallest N within '
                  f"{tol:.0%} of the dense loss).</p>", _table(curve, 4)]
    if heads_path.is_file():
        heads = pd.read_csv(heads_path)
        names = [c for c in ("f_score", "shell_k0", "shell_kn", "tail_mass", "truncation_error")
                 if c in heads]
        rows = [{"mode": mode, "N": int(part["n"].iloc[0]),
                 **{f"ρ({name}, Δ loss)": spearman(torch.tensor(part[name].to_numpy(float)),
                                                   torch.tensor(part["loss_increase"].to_numpy(float)))
                    for name in names}} for mode, part in heads.groupby("mode", sort=True)]
        parts += ["<h3>Per head: geometry against the loss of sparsifying that head alone</h3>",
                  _table(pd.DataFrame(rows), 3)]
        for mode, part in heads.groupby("mode", sort=True):
            parts.append(_figure(correlation_plot(part), figures / f"capacity_heads_{mode}", f"{mode}: F_N, "
                                 "shell certificates, tail mass and relative truncation error against Δ "
                                 "loss, per head."))
    return (["<h2>Retrieval capacity</h2>", *parts]) if parts else []


def write_section(parts: list[str], path: Path, *, title: str) -> Path:
    """Write raw HTML ``parts`` as one self-contained page at ``path``."""
    path.write_text(_page.page_html(parts, title=title), encoding="utf-8")
    return path


def write_report(
    result: HeadAnalysis,
    out_dir: str | Path = DEFAULT_OUT,
    *,
    cache: Any = None,
    tokens: Any = None,
    model: Any = None,
    n: int = 4,
    max_tokens: int = 64,
    scores: Any = None,
    nulls: Mapping[str, HeadAnalysis] | None = None,
) -> Path:
    """Write the report folder for ``result`` and return the path of its ``index.html``.

    With ``cache`` (the one ``result`` was computed from), the report adds token-level views of
    one example head per class at the last query of sequence 0, its top-``n`` keys highlighted;
    ``tokens`` and ``model`` turn ids into text. With ``scores`` (a :func:`tl_geometry.head_scores`
    table) it adds their agreement with the labels and the score columns; with ``nulls``
    (``{kind: analysis}`` of the same inputs with other ``shuffle=`` nulls, SPEC §3) the
    decomposition of the top − shuffled gap. The page needs no network: everything is inlined.

    >>> write_report(result, "tl_geometry_report", cache=cache, tokens=tokens, model=model)  # doctest: +SKIP
    PosixPath('tl_geometry_report/index.html')
    """
    if not isinstance(result, HeadAnalysis):
        raise TypeError(f"write_report needs a HeadAnalysis (from analyze_heads), got {type(result).__name__}.")
    if scores is not None:  # before anything is written
        check_scores(scores)
        check_score_heads(scores, ((layer, head) for layer in result.layers for head in range(result.n_heads)))
    decomposition = null_decomposition_section(result, nulls) if nulls else []  # checked here too
    out = Path(out_dir)
    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    result.save(out / "analysis.pt")  # the tables of TABLE_FILES, with the head scores when given
    result.heads_table(scores).to_csv(out / "heads.csv", index=False)
    result.export_labels(out / "labels.csv", scores=scores)
    result.to_pandas().to_csv(out / "metrics.csv", index=False)
    result.class_counts().to_csv(out / "class_counts.csv")
    result.paired_sink_summary().to_csv(out / "sink_effect.csv", index=False)
    if nulls:
        null_decomposition({result.shuffle: result, **nulls}).to_csv(out / "null_decomposition.csv", index=False)
    parts: list[_page.View | str] = [*_summary_parts(result, scores), *decomposition, "<h2>Figures</h2>",
                                     *_figure_parts(result, figures)]
    # The heads where top-N beats random the most, at the first N of the headline range.
    analysed = result.n_values.tolist()
    top_n = next(iter(result.headline_n), 2 if 2 in analysed else analysed[0])
    parts += [f"<h2>Heads where top-N beats random the most (N = {n_label(result, top_n)})</h2>",
              _table(result.top(12, by="f_gain", n=top_n))]
    if cache is not None:
        parts += _example_head_parts(result, cache, dict(tokens=tokens, model=model, max_tokens=max_tokens), n)
    parts += _ablation(out, figures)
    parts += capacity_section(out, figures)
    files = [*TABLE_FILES, *(["null_decomposition.csv"] if nulls else []),
             *(name for name in OPTIONAL_FILES if (out / name).is_file())]
    page = _page.page_html(parts, title=f"tl_geometry report — {result.metadata.get('model_name', '')}",
                           header=_header(result, files))
    index = out / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


#: The tables every report writes beside its page, and the ones it reads when they are there.
TABLE_FILES = ("analysis.pt", "heads.csv", "labels.csv", "metrics.csv", "class_counts.csv", "sink_effect.csv")
OPTIONAL_FILES = ("sensitivity.csv", "sparsification.csv", "capacity.csv", "capacity_heads.csv")


def _summary_parts(result: HeadAnalysis, scores: Any) -> list[_page.View | str]:
    """The taxonomy grid, label confidence, agreement, sink views and tables of the page's top."""
    agreement = agreement_section(result, scores) if scores is not None else []
    return [
        taxonomy_view(result, scores=scores, classes_note=f"See {_CLASSES_LINK}."),
        *label_confidence_section(result), *agreement,
        sink_view(result), *sink_effect_section(result), *layer_kind_section(result),
        "<h2>Mean over heads per N</h2>", _table(n_means_table(result)),
        '<p class="tlg-caption">† dense N > (t+1)/4: the precision floor N/(t+1) lifts F; shown, '
        "never headlined. F* = chance-corrected F (SPEC §3). top − shuffled is the net effect of the "
        "value geometry, of either sign: positive where the selected values cohere, negative where "
        "attended but unselected keys carry values aligned with the selection; shuffled − random is "
        "what the attention ranking achieves on values with the real norms but no coupling. geometry "
        f"reads the gap with both signs: ≥ {GEOMETRY_GAP} raises, ≤ −{GEOMETRY_GAP} lowers "
        f"separability, in between equal. Shuffled here is the {result.shuffle} null.</p>",
    ]


def _figure_parts(result: HeadAnalysis, figures: Path) -> list[str]:
    """The figures, saved under ``figures/`` (PNG and SVG) and inlined with their captions."""
    bounds = ", and the bounds" if result.bounds is not None else ""
    plots = [
        ("f_by_class", f_curves_plot(result, by="class"),
         "F_N against N, mean over the heads of each class: top-N, random subsets, values shuffled, "
         f"sink removed, sink in / outside the set{bounds}. Shaded: N = 1 (trivial) and the dense "
         "N > (t+1)/4 (not headlined)."),
        ("f_cc_by_class", f_curves_plot(result, by="class", metric="f_score_cc"),
         "Chance-corrected F*_N against N, the same groups: the precision floor N/(t+1) taken out, so "
         "a rise at dense N is not read as separability."),
        ("f_by_layer", f_curves_plot(result, by="layer"), "F_N against N, mean over each layer's heads."),
        ("sink", sink_plot(result), "Sink value-norm ratio κ, signed cosine and attention mass per layer."),
        ("class_counts", class_counts_plot(result), "Heads of each class per layer."),
    ]
    return [_figure(fig, figures / name, caption) for name, fig, caption in plots]


def _example_head_parts(result: HeadAnalysis, cache: Any, text: dict[str, Any], n: int) -> list[_page.View | str]:
    """Token-level views of one example head per class, its top-``n`` keys highlighted."""
    parts: list[_page.View | str] = ["<h2>Example heads</h2>"]
    for cls, layer, head in example_heads(result) if 2 in result.n_values.tolist() else []:
        parts.append(f'<h3 style="color:{CLASS_COLORS[cls]}">{cls}: layer {layer}, head {head}</h3>')
        # The last query has n_pos keys: a short window (e.g. --seq-len 3) shows them all.
        n_view = min(n, int(cache[f"blocks.{layer}.attn.hook_pattern"].shape[-1]))
        parts += [attention_view(cache, layer, head, n=n_view, **text),
                  contribution_view(cache, layer, head, **text), token_view(cache, layer, head, n=n_view, **text)]
    return parts

