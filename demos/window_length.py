"""How the geometry term moves with the window length (the results page's window-length study).

For each model and window length T, ``--n-windows`` windows of WikiText-2 test are analysed at the
last query of every layer with every default (value-shuffle null, seed 0). The geometry term is
``F*_N(top) − F*_N(shuffled)`` (SPEC §3: the net effect of the real value geometry; negative where
attended-but-unselected keys crowd the ball), averaged over the heads of a layer kind: the
model's global (full-attention) layers and its local (sliding-window) layers apart, read from the
config's ``layer_types``. A mean over heads is NaN-aware: a head whose N is undefined at some T
(``N ≥ |T_t|``) is left out.

    python demos/window_length.py [--models smollm2-135m,gemma3-270m] [--lengths 256,512,1024,2048]
        [--n-windows 8] [--out docs/results]

Writes ``window_length.json`` and ``window_length.png`` into ``--out`` and prints a Markdown table.
``--per-window`` runs the same study one window per forward (window ``i`` seeded as sequence ``i``,
so the means are the joint run's) and writes ``window_length_per_window.json``: the geometry term
per window, layer, head and N, and per layer kind its bootstrap interval over windows.

``--fixed-position`` runs the fixed-position sink-visibility experiment instead: on Gemma-3-270M,
``--n-windows`` windows of ``w + k`` tokens (BOS first, as ``text_windows`` cuts them; ``w`` = 512,
the local layers' window; ``k`` = ``--positions``) go through one forward each; for each query
``t`` in ``w − k … w − 1`` (the local layers see the sink) and ``w … w + k − 1`` (they do not),
the window's cache is cut to its first ``t + 1`` positions and analysed at its last query, which
is query ``t`` of the forward (causal attention: row ``t`` reads keys ``≤ t`` only), with the
value-shuffle null and the three decomposition nulls (norms / directions / unselected) of SPEC §3,
16 permutations each, seed 0, sequence ``i`` of the run seeded as window ``i``. The sink's
attention mass and its place in the top-N order are read from the same rows. Means over heads
and windows get a seeded bootstrap interval over windows (1,000 resamples, 95 %); every layer is
analysed, the global layers (which see the sink at every ``t``) being the control.

    python demos/window_length.py --fixed-position [--n-windows 32] [--positions 12]

Writes ``window_length_fixed.json`` (per-window arrays and their summary) and
``window_length_fixed.png`` into ``--out`` and prints the tables. With ``--from-saved``, either
mode reads its saved JSON again (no model) and redoes the intervals and tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import tl_geometry  # noqa: E402

WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-test.txt"
N_SHOWN = (2, 4, 8)
#: The nulls of SPEC §3, in the library's order: the value shuffle, then its decomposition.
NULLS = ("values", "norms", "directions", "unselected")
SIDES = ("visible", "invisible")
#: SPEC §8: a seeded bootstrap over windows, 1,000 resamples, 95 % percentile interval; fewer
#: than 8 windows get no interval ("too few").
RESAMPLES, LEVEL, MIN_WINDOWS, SEED = 1000, 0.95, 8, 0
#: SPEC §3's reading of the geometry term on its interval.
READINGS = (("lowers", -np.inf, -0.05), ("no effect", -0.05, 0.05), ("raises", 0.05, np.inf))


def layer_kinds(model) -> list[str]:
    """``"local"`` or ``"global"`` per layer, from the Hugging Face config (every layer global
    where the config names no sliding-window layer)."""
    hf = getattr(model, "original_model", model)
    config = getattr(hf, "config", None)
    config = getattr(config, "text_config", config)
    types = getattr(config, "layer_types", None)
    n_layers = model.cfg.n_layers
    if not types:
        return ["global"] * n_layers
    return ["local" if "sliding" in str(t) else "global" for t in types][:n_layers]


def geometry_term(result: tl_geometry.HeadAnalysis, kinds: list[str]) -> dict:
    """Mean over heads of F*(top) − F*(shuffled), per layer kind and N."""
    gap = result.metric("f_score_cc", "top") - result.metric("f_score_cc", "shuffled")  # [layer, head, n]
    n_values = [int(n) for n in result.n_values]
    out: dict = {}
    for kind in sorted(set(kinds)):
        rows = [i for i, layer in enumerate(result.layers) if kinds[layer] == kind]
        per_n = {}
        for n in N_SHOWN:
            if n not in n_values:
                continue
            x = gap[rows][:, :, n_values.index(n)]
            per_n[str(n)] = float(torch.nanmean(x)) if bool(torch.isfinite(x).any()) else None
        out[kind] = dict(layers=[result.layers[i] for i in rows], mean_gap=per_n)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--lengths", default="256,512,1024,2048")
    parser.add_argument("--n-windows", type=int, default=None,
                        help="windows per length (default 8), or per run with --fixed-position (default 32)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"))
    parser.add_argument("--fixed-position", action="store_true",
                        help="the fixed-position sink-visibility experiment on Gemma-3-270M's local layers")
    parser.add_argument("--positions", type=int, default=12,
                        help="queries per side with --fixed-position: w−k … w−1 and w … w+k−1")
    parser.add_argument("--per-window", action="store_true",
                        help="the window-length study again, one window at a time, for intervals over windows")
    parser.add_argument("--from-saved", action="store_true",
                        help="with --fixed-position or --per-window: intervals and tables again from the saved JSON")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if args.fixed_position and args.from_saved:
        summarize_fixed(Path(args.out))
        return
    if args.fixed_position:
        fixed_position(n_windows=args.n_windows or 32, k=args.positions, out=Path(args.out))
        return
    args.n_windows = args.n_windows or 8
    if args.per_window and args.from_saved:
        summarize_per_window(Path(args.out))
        return
    if args.per_window:
        per_window_lengths(args.models.split(","), [int(x) for x in args.lengths.split(",")],
                           args.n_windows, Path(args.out))
        return
    text = WIKITEXT.read_text(encoding="utf-8")
    report: dict = {"text": "wikitext-2-test", "n_windows": args.n_windows, "protocol":
                    "last query, every layer, every default (16 random subsets, 16 value shuffles), seed 0",
                    "runs": []}
    for name in args.models.split(","):
        model = tl_geometry.load_model(name)
        kinds = layer_kinds(model)
        for length in (int(x) for x in args.lengths.split(",")):
            start = time.perf_counter()
            tokens = tl_geometry.text_windows(model, text, n_seqs=args.n_windows, seq_len=length)
            # Few windows per forward at long T: the pattern path's forward also forms logits.
            result = tl_geometry.analyze_model(model, tokens, batch_size=max(1, 4096 // length), progress=False)
            row = dict(model=name, T=length, seconds=time.perf_counter() - start,
                       window=result.metadata.get("window"), **geometry_term(result, kinds))
            print(json.dumps(row), file=sys.stderr)
            report["runs"].append(row)
        del model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "window_length.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "window_length.png")
    print(_table(report))


def _table(report: dict) -> str:
    lines = ["| model | layers | T | " + " | ".join(f"N = {n}" for n in N_SHOWN) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in N_SHOWN) + " |"]
    for run in report["runs"]:
        for kind in ("global", "local"):
            if kind not in run:
                continue
            gaps = run[kind]["mean_gap"]
            cells = [f"{gaps[str(n)]:+.3f}" if gaps.get(str(n)) is not None else "—" for n in N_SHOWN]
            lines.append(f"| {run['model']} | {kind} ({len(run[kind]['layers'])}) | {run['T']} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in report["runs"]})
    fig, axes = plt.subplots(1, len(N_SHOWN), figsize=(4 * len(N_SHOWN), 3.4), sharey=True)
    for ax, n in zip(axes, N_SHOWN):
        for model in models:
            for kind, style in (("global", "-o"), ("local", "--s")):
                runs = [r for r in report["runs"] if r["model"] == model and kind in r]
                xs = [r["T"] for r in runs if r[kind]["mean_gap"].get(str(n)) is not None]
                ys = [r[kind]["mean_gap"][str(n)] for r in runs if r[kind]["mean_gap"].get(str(n)) is not None]
                if xs:
                    ax.plot(xs, ys, style, label=f"{model} {kind}")
        ax.axhline(0, color="grey", lw=0.8)
        ax.axhspan(-0.05, 0.05, color="grey", alpha=0.12)
        ax.set_xscale("log", base=2)
        ax.set_title(f"N = {n}")
        ax.set_xlabel("window length T (tokens)")
    axes[0].set_ylabel("F*(top) − F*(shuffled)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def per_window_lengths(models: list[str], lengths: list[int], n_windows: int, out: Path) -> dict:
    """The window-length study with per-window arrays: each window's last query analysed alone
    by the library's engine (seeded as sequence ``i`` of the run, so its numbers are those of the
    joint run up to the forward's round-off), the geometry term per window, layer, head and N,
    and per layer kind its mean with a bootstrap interval over windows. Writes
    ``window_length_per_window.json``."""
    from tl_geometry.analyze import windows as window_rules
    from tl_geometry.engine import check_options

    runs = [check_options(n_values=N_SHOWN, shuffle="values", random_samples=0, seed=0)]
    report: dict = {"text": "wikitext-2-test", "n_windows": n_windows, "n_values": list(N_SHOWN),
                    "protocol": ("last query, every layer, 16 value shuffles, seed 0, window i seeded as "
                                 "sequence i; one forward per window; random baseline off"),
                    "runs": []}
    for name in models:
        model = tl_geometry.load_model(name)
        kinds = layer_kinds(model)
        layers = list(range(model.cfg.n_layers))
        windows = list(window_rules.resolve("auto", model, layers))
        text = WIKITEXT.read_text(encoding="utf-8")
        for length in lengths:
            start = time.perf_counter()
            tokens = tl_geometry.text_windows(model, text, n_seqs=n_windows, seq_len=length)
            gap = np.full((n_windows, len(layers), model.cfg.n_heads, len(N_SHOWN)), np.nan)
            for i in range(n_windows):
                _, cache = model.run_with_cache(tokens[i : i + 1], names_filter=tl_geometry.CACHE_NAMES_FILTER)
                got = _prefix_scores(cache, length - 1, layers, windows, runs, offset=i, model=model)
                gap[i] = got["top"] - got["values"]
                del cache
            report["runs"].append({"model": name, "T": length, "seconds": time.perf_counter() - start,
                                   "layer_kinds": kinds,
                                   "per_window_gap": np.where(np.isfinite(gap), np.round(gap, 4), None).tolist()})
            print(f"{name} T = {length}: {report['runs'][-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
        del model
    return _write_per_window(report, out)


def summarize_per_window(out: Path) -> dict:
    """The intervals and table again from a saved ``window_length_per_window.json`` (no model)."""
    return _write_per_window(json.loads((out / "window_length_per_window.json").read_text()), out)


def _write_per_window(report: dict, out: Path) -> dict:
    """Per run and layer kind, the mean geometry term with its interval over windows, from the
    per-window arrays; the JSON and the printed table rows."""
    for run in report["runs"]:
        gap = _array(run["per_window_gap"])  # [window, layer, head, n]
        if "layer_kinds" not in run:  # a file written before the kinds were recorded per run
            run["layer_kinds"] = [None] * gap.shape[1]
            for kind in ("global", "local"):
                for layer in run.get(kind, {}).get("layers", []):
                    run["layer_kinds"][layer] = kind
        for kind in sorted(set(run["layer_kinds"])):
            rows = [layer for layer, k in enumerate(run["layer_kinds"]) if k == kind]
            run[kind] = {"layers": rows, "gap": {str(n): bootstrap_mean(gap[:, rows][..., ni], geometry=True)
                                                 for ni, n in enumerate(N_SHOWN)}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "window_length_per_window.json").write_text(json.dumps(report, separators=(",", ":"), allow_nan=False))
    for run in report["runs"]:
        for kind in ("global", "local"):
            if kind in run:
                cells = " | ".join(_fmt(run[kind]["gap"][str(n)], 3) for n in N_SHOWN)
                print(f"| {run['model']} | {kind} ({len(run[kind]['layers'])}) | {run['T']} | {cells} |")
    return report


# --- The fixed-position sink-visibility experiment -------------------------------------------


def side_positions(window: int, k: int, sink: int = 0) -> dict[str, list[int]]:
    """The query positions of each side: a query of a layer with sliding window ``window`` sees
    the sink at ``sink`` while ``t ≤ sink + window − 1`` (SPEC §1, sink-visible reading).

    >>> side_positions(8, 2)
    {'visible': [6, 7], 'invisible': [8, 9]}
    """
    if not 1 <= k <= window:
        raise ValueError(f"k must be in 1..{window}, got {k}.")
    edge = sink + window  # the first query that no longer sees the sink
    return {"visible": list(range(edge - k, edge)), "invisible": list(range(edge, edge + k))}


def bootstrap_mean(per_window, geometry: bool = False) -> dict:
    """Mean of per-window values and its 95 % percentile interval from a seeded bootstrap over
    windows (SPEC §8: 1,000 resamples of the windows with replacement, drawn by
    ``torch.randint`` from a generator seeded 0). ``per_window`` is ``[window, ...]``: every
    resample draws whole windows and averages everything else (heads, positions) NaN-aware, as
    the point value does. Fewer than 8 windows get no interval. With ``geometry``, SPEC §3's
    reading of the interval (lowers / no effect / raises / undecided between two).

    >>> r = bootstrap_mean([1.0] * 8)
    >>> (r["mean"], r["lo"], r["hi"], r["n"])
    (1.0, 1.0, 1.0, 8)
    """
    x = torch.as_tensor(np.asarray(per_window, dtype=np.float64)).reshape(len(per_window), -1)
    n = len(x)
    defined = torch.isfinite(x)
    total, count = torch.where(defined, x, 0.0).sum(1), defined.sum(1).to(torch.float64)
    out = {"mean": _finite(float(total.sum() / count.sum())), "lo": None, "hi": None, "n": n}
    if n >= MIN_WINDOWS and out["mean"] is not None:
        draws = torch.randint(0, n, (RESAMPLES, n), generator=torch.Generator().manual_seed(SEED))
        means = total[draws].sum(1) / count[draws].sum(1)
        means = means[torch.isfinite(means)]
        tail = (1 - LEVEL) / 2
        lo, hi = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
        out.update(lo=lo, hi=hi)
    if geometry:
        out["reading"] = reading(out)
    return out


def reading(cell: dict) -> str:
    """SPEC §3 on an interval: the band that holds all of it, else "undecided between" the lowest
    and highest bands it reaches; "too few" without an interval."""
    if cell.get("lo") is None:
        return "too few"
    reached = [name for name, low, high in READINGS if cell["lo"] <= high and cell["hi"] >= low]
    return reached[0] if len(reached) == 1 else f"undecided between {reached[0]} and {reached[-1]}"


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def head_difference(visible, invisible) -> dict:
    """Per head, the mean over windows of ``visible − invisible`` (``[window, head]`` each, the
    heads flattened over layers); their mean over heads ± the standard error over heads."""
    d = np.nanmean(np.asarray(visible, dtype=np.float64) - np.asarray(invisible, dtype=np.float64), axis=0)
    d = d[np.isfinite(d)]
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else None
    return {"mean": float(d.mean()), "se": se, "n_heads": len(d),
            "n_negative": int((d < 0).sum())}


def _prefix_scores(cache, t: int, layers: list[int], windows: list[int | None], runs, offset: int,
                   model) -> dict[str, np.ndarray]:
    """F*_N of the top-N set and of each null's shuffled values at query ``t`` of one window:
    the cache cut to ``t + 1`` positions, analysed at its last query by the library's engine
    (sequence ``offset`` of the run, for the random streams). ``[layer, head, n]`` per name."""
    from tl_geometry.engine import Accumulator, analyze_layer, run_metadata
    from tl_geometry.inputs import cache as cache_io

    out: dict[str, np.ndarray] = {}
    n_heads = None
    accs = None
    mask = torch.ones(1, t + 1, dtype=torch.bool)
    sink = torch.zeros(1, dtype=torch.long)
    for li, layer in enumerate(layers):
        pattern, v = cache_io.read_layer(cache, layer, upcast=False)
        pattern = pattern[:, :, : t + 1, : t + 1].contiguous()
        v = v[:, : t + 1].contiguous()
        if accs is None:
            n_heads = pattern.shape[1]
            accs = [Accumulator.zeros(len(layers), n_heads, len(o.n_values), n_sequences=1) for o in runs]
        for acc, opts in zip(accs, runs):
            stats = analyze_layer(pattern, v, mask, sink, opts, layer=layer, sequence_offset=offset,
                                  mask_given=False, window=windows[li])
            acc.add(li, stats, 0)
    for acc, opts in zip(accs, runs):
        meta = run_metadata(model, cache, (1, n_heads, t + 1), opts, False)
        result = acc.finish(layers, opts, t + 1, meta, windows)
        if opts.shuffle == "values":
            out["top"] = result.metric("f_score_cc", "top").numpy()
        out[opts.shuffle] = result.metric("f_score_cc", "shuffled").numpy()
    return out


def fixed_position(*, n_windows: int, k: int, out: Path, name: str = "gemma3-270m") -> dict:
    """The fixed-position sink-visibility experiment (module docstring); writes the JSON."""
    from tl_geometry.engine import check_options

    model = tl_geometry.load_model(name)
    kinds = layer_kinds(model)
    layers = list(range(model.cfg.n_layers))
    from tl_geometry.analyze import windows as window_rules

    windows = list(window_rules.resolve("auto", model, layers))
    local_windows = {w for w, kind in zip(windows, kinds) if kind == "local"}
    if len(local_windows) != 1 or None in local_windows:
        raise ValueError(f"{name}: expected one sliding window on the local layers, got {local_windows}.")
    w = local_windows.pop()
    sides = side_positions(w, k)
    positions = sides["visible"] + sides["invisible"]
    text = WIKITEXT.read_text(encoding="utf-8")
    tokens = tl_geometry.text_windows(model, text, n_seqs=n_windows, seq_len=positions[-1] + 1)
    runs = [check_options(n_values=N_SHOWN, shuffle=kind, random_samples=0, seed=0) for kind in NULLS]
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    names = ("top", *NULLS)
    # [window, position, layer, head, n] per score; sink mass [window, position, layer, head]
    scores = {key: np.full((n_windows, len(positions), n_layers, n_heads, len(N_SHOWN)), np.nan) for key in names}
    sink_mass = np.full((n_windows, len(positions), n_layers, n_heads), np.nan)
    sink_rank = np.full((n_windows, len(positions), n_layers, n_heads), np.nan)
    start = time.perf_counter()
    for i in range(n_windows):
        _, cache = model.run_with_cache(tokens[i : i + 1], names_filter=tl_geometry.CACHE_NAMES_FILTER)
        for j, t in enumerate(positions):
            got = _prefix_scores(cache, t, layers, windows, runs, offset=i, model=model)
            for key in names:
                scores[key][i, j] = got[key]
            for layer in layers:
                row = cache[f"blocks.{layer}.attn.hook_pattern"][0, :, t, : t + 1].double()  # [head, key]
                sink_mass[i, j, layer] = row[:, 0].numpy()
                # the sink's place in the top-N order (ties go to the lower index: the sink wins
                # them); undefined where the layer's window does not hold it (SPEC §1)
                if windows[layer] is None or t <= windows[layer] - 1:
                    sink_rank[i, j, layer] = (1 + (row[:, 1:] > row[:, :1]).sum(-1)).numpy()
        del cache
        print(f"window {i + 1}/{n_windows}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    report = {"model": name, "text": "wikitext-2-test", "n_windows": n_windows, "window": w,
              "window_length": int(tokens.shape[1]), "seconds": time.perf_counter() - start,
              "layer_kinds": kinds, "positions": sides, "n_values": list(N_SHOWN),
              "protocol": ("one forward per window; query t read as the last query of the cache cut to "
                           "t+1 positions; F*_N (f_score_cc), 16 permutations per null, seed 0, window i "
                           "seeded as sequence i; random baseline off; sink = position 0 (BOS)"),
              "per_window": _per_window_arrays(scores, sink_mass, sink_rank, positions, sides)}
    return _write_fixed(report, out)


def _write_fixed(report: dict, out: Path) -> dict:
    """The summary (from the saved per-window arrays), the JSON and the printed tables."""
    out.mkdir(parents=True, exist_ok=True)
    report.pop("kinds", None)  # the arrays first: a summary that fails loses no forward
    (out / "window_length_fixed.json").write_text(json.dumps(report, separators=(",", ":"), allow_nan=False))
    report["kinds"] = _fixed_summary(report)
    (out / "window_length_fixed.json").write_text(json.dumps(report, separators=(",", ":"), allow_nan=False))
    _plot_fixed(report, out / "window_length_fixed.png")
    print(_fixed_table(report))
    return report


def _plot_fixed(report: dict, path: Path) -> None:
    """The net geometry term against the query position, mean over windows and the heads of each
    layer kind, per N; the dashed line is the last query whose local window holds the sink."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = report["per_window"]["query_positions"]
    by_position = _array(report["per_window"]["geometry_term_by_position"])  # [window, position, layer, n]
    kinds = report["layer_kinds"]
    fig, axes = plt.subplots(1, len(N_SHOWN), figsize=(4 * len(N_SHOWN), 3.2), sharey=True)
    for ni, (ax, n) in enumerate(zip(axes, N_SHOWN)):
        for kind, style in (("local", "-s"), ("global", "-o")):
            rows = [layer for layer, k in enumerate(kinds) if k == kind]
            ax.plot(positions, np.nanmean(by_position[:, :, rows][..., ni], axis=(0, 2)), style, ms=3,
                    label=f"{kind} ({len(rows)} layers)")
        ax.axvline(report["positions"]["visible"][-1] + 0.5, color="grey", ls="--", lw=0.8)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_title(f"N = {n}")
        ax.set_xlabel("query position t")
    axes[0].set_ylabel("F*(top) − F*(shuffled)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize_fixed(out: Path) -> dict:
    """The summary and tables again from a saved ``window_length_fixed.json`` (no model)."""
    report = json.loads((out / "window_length_fixed.json").read_text())
    return _write_fixed(report, out)


def _array(x) -> np.ndarray:
    return np.array(x, dtype=np.float64)  # JSON nulls (undefined) become NaN


def _fixed_summary(report: dict) -> dict:
    """Per layer kind, from the per-window arrays: per null, side and N the mean over heads and
    windows of ``F*(top) − F*(null)`` (the net geometry term for ``values``, its parts for the
    decomposition nulls) with a bootstrap interval over windows, the visible − invisible change
    (same interval), the per-head change (mean ± SE over heads), and the sink's attention mass."""
    arrays = report["per_window"]
    kinds = report["layer_kinds"]
    positions = arrays["query_positions"]
    means = {key: _array(x) for key, x in arrays["side_means"].items()}  # [window, side, layer, head, n]
    sink_mass = _array(arrays["sink_mass"])  # [window, position, layer, head]
    idx = _side_index(positions, report["positions"])
    summary: dict = {}
    for kind in ("local", "global"):
        rows = [layer for layer, k in enumerate(kinds) if k == kind]
        entry: dict = {"layers": rows, "terms": {}, "change": {}, "per_head_change": {}, "sink_mass": {}}
        for null in NULLS:
            gap = (means["top"] - means[null])[:, :, rows]  # [window, side, layer, head, n]
            term, change, per_head = {}, {}, {}
            for ni, n in enumerate(N_SHOWN):
                by_side = {side: gap[:, si, ..., ni] for si, side in enumerate(SIDES)}  # [window, layer, head]
                term[str(n)] = {side: bootstrap_mean(by_side[side], geometry=True) for side in SIDES}
                change[str(n)] = bootstrap_mean(by_side["visible"] - by_side["invisible"])
                per_head[str(n)] = head_difference(*(by_side[side].reshape(len(gap), -1) for side in SIDES))
            entry["terms"][null], entry["change"][null], entry["per_head_change"][null] = term, change, per_head
        for side in SIDES:
            mass = sink_mass[:, idx[side]][:, :, rows]  # [window, position, layer, head]
            by_layer = np.nanmean(mass, axis=(0, 1, 3))
            entry["sink_mass"][side] = {**bootstrap_mean(mass), "layer_min": float(by_layer.min()),
                                        "layer_max": float(by_layer.max())}
        if "sink_rank" in arrays:  # the share of instances whose top-N set holds the sink
            rank = _array(arrays["sink_rank"])
            entry["sink_in_top"] = {}
            for side in SIDES:
                r = rank[:, idx[side]][:, :, rows]  # [window, position, layer, head]
                entry["sink_in_top"][side] = {
                    str(n): bootstrap_mean(np.where(np.isfinite(r), (r <= n).astype(np.float64), np.nan))
                    for n in N_SHOWN}
        t = report["positions"]["visible"][-1]
        mass = sink_mass[:, positions.index(t)][:, rows]  # [window, layer, head]
        by_layer = np.nanmean(mass, axis=(0, 2))
        entry["sink_mass"]["at_last_visible"] = {**bootstrap_mean(mass), "t": t,
                                                 "layer_min": float(by_layer.min()),
                                                 "layer_max": float(by_layer.max())}
        summary[kind] = entry
    return summary


def _side_index(positions: list[int], sides: dict[str, list[int]]) -> dict[str, list[int]]:
    return {side: [positions.index(t) for t in ts] for side, ts in sides.items()}


def _per_window_arrays(scores, sink_mass, sink_rank, positions, sides) -> dict:
    """What a verdict reads, per window: the means over each side's positions of every score,
    per layer and head (``[window][side][layer][head][n]``), the head-mean geometry term per
    query position (``[window][position][layer][n]``) and the sink mass per query position
    (``[window][position][layer][head]``)."""
    idx = _side_index(positions, sides)

    def r(x):
        x = np.round(np.asarray(x, dtype=np.float64), 4)
        return np.where(np.isfinite(x), x, None).tolist()  # NaN (undefined) as null

    arrays = {"layout": {"side_means": "[window][side: visible, invisible][layer][head][n]",
                         "geometry_term_by_position": "[window][position][layer][n], mean over heads",
                         "sink_mass": "[window][position][layer][head]",
                         "sink_rank": "[window][position][layer][head], 1 = most attended; null: not visible"},
              "query_positions": positions,
              "side_means": {key: r(np.stack([np.nanmean(x[:, idx[side]], 1) for side in SIDES], 1))
                             for key, x in scores.items()},
              "geometry_term_by_position": r(np.nanmean(scores["top"] - scores["values"], axis=3)),
              "sink_mass": r(sink_mass),
              "sink_rank": r(sink_rank)}
    return arrays


def _fmt(cell: dict, digits: int = 2) -> str:
    if cell.get("mean") is None:
        return "—"
    if cell.get("lo") is None:  # fewer than 8 windows: no interval (SPEC §8, "too few")
        return f"{cell['mean']:+.{digits}f} (n = {cell['n']}, too few)"
    return f"{cell['mean']:+.{digits}f} [{cell['lo']:+.{digits}f}, {cell['hi']:+.{digits}f}]"


def _fixed_table(report: dict) -> str:
    """Markdown tables: the geometry term and its parts per side, and the change."""
    sides = report["positions"]
    span = {side: f"{ts[0]}–{ts[-1]}" for side, ts in sides.items()}
    lines = ["| layers | gap | t (sink) | " + " | ".join(f"N = {n}" for n in N_SHOWN) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in N_SHOWN) + " |"]
    for kind, entry in report["kinds"].items():
        for null in NULLS:
            label = "top − values (net)" if null == "values" else f"top − {null}"
            for side in SIDES:
                cells = [_fmt(entry["terms"][null][str(n)][side]) for n in N_SHOWN]
                lines.append(f"| {kind} ({len(entry['layers'])}) | {label} | {span[side]} ({side}) | "
                             + " | ".join(cells) + " |")
            cells = [_fmt(entry["change"][null][str(n)]) for n in N_SHOWN]
            lines.append(f"| {kind} ({len(entry['layers'])}) | {label} | visible − invisible | "
                         + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| layers | gap | per-head visible − invisible, mean ± SE (heads < 0) | N |")
    lines.append("| --- | --- | --- | --- |")
    for kind, entry in report["kinds"].items():
        for null in NULLS:
            for n in N_SHOWN:
                h = entry["per_head_change"][null][str(n)]
                lines.append(f"| {kind} | top − {null} | {h['mean']:+.3f} ± {h['se']:.3f} "
                             f"({h['n_negative']}/{h['n_heads']}) | {n} |")
    lines.append("")
    for kind, entry in report["kinds"].items():
        if "sink_in_top" in entry:
            cells = ", ".join(f"N = {n} {_fmt(entry['sink_in_top']['visible'][str(n)], 3)}" for n in N_SHOWN)
            lines.append(f"sink in the top-N set, {kind}, visible queries: {cells}")
    for kind, entry in report["kinds"].items():
        m = entry["sink_mass"]
        lines.append(f"sink mass, {kind}: visible {_fmt(m['visible'], 3)} (layers {m['visible']['layer_min']:.3f}–"
                     f"{m['visible']['layer_max']:.3f}); at t = {m['at_last_visible']['t']} "
                     f"{_fmt(m['at_last_visible'], 3)} (layers {m['at_last_visible']['layer_min']:.3f}–"
                     f"{m['at_last_visible']['layer_max']:.3f}); invisible {_fmt(m['invisible'], 3)}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
