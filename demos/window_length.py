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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import tl_geometry  # noqa: E402

WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-test.txt"
N_SHOWN = (2, 4, 8)


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
    parser.add_argument("--n-windows", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
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


if __name__ == "__main__":
    main()
