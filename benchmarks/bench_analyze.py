"""Benchmark analyze_heads against the forward pass that produced its cache, and the loop reference.

For each built-in model (``--models``; default: SmolLM2-135M, Gemma-3-270M, and
Qwen2.5-Coder-0.5B when its weights are installed), on real text (WikiText-2 test from
../shared/data when present, else the built-in sample), times in one process: ``run_with_cache``
keeping only ``hook_pattern`` and ``hook_v``; ``analyze_heads`` at the last query (8 × 128 tokens)
with every default, then with one part switched off or swapped at a time — no value-shuffle
null, no baseline at all, and each decomposition null of SPEC §3 (``shuffle="norms" |
"directions" | "unselected"``) in place of the values null; and at all queries (4 × 128 tokens)
with every default, without the null and without either baseline. Every time is reported as a
ratio to the forward pass of the same tokens, timed just before it.

For SmolLM2 it also times the NumPy per-query loop reference (tests/reference.py) on one layer,
scaled to the whole model, with the largest difference between the two, and the extra memory of
one long layer (T = 2048, 4 heads), measured in a fresh process against the size of its pattern.
Peak resident memory of each phase is read from /proc (VmHWM, reset before each phase).

    python benchmarks/bench_analyze.py [--models smollm2-135m,gemma3-270m] [--repeats 3] [--skip-all] [--parts]

``--parts`` also times every default once more per query set with each compiled entry point that
an analysis of a cache calls timed apart (the scoring, validation-and-vote, Gram, tie,
sink-geometry and reduction kernels; the votes from queries and keys belong to the recompute
path) and the rest (per-layer torch and Python work) as the difference: the run with the
shortest total is kept.

Targets (issue 26, reported, not enforced): every default on, the last query ≤ 0.05× the forward
(8 × 128) and all queries ≤ 2× (4 × 128); extra memory ≤ 1× the pattern at T = 2048.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS, ROOT, real_text, write_report

sys.path.insert(0, str(ROOT / "tests"))


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _rss_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _long_layer_memory(seq_len: int = 2048, n_heads: int = 4) -> dict:
    """Peak extra memory of analysing one [1, 4, T, T] layer, against the pattern's size."""
    import tl_geometry

    g = torch.Generator().manual_seed(0)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    logits = torch.randn(1, n_heads, seq_len, seq_len, generator=g).masked_fill(~causal, -torch.inf)
    cache = {"blocks.0.attn.hook_pattern": torch.softmax(logits, -1),
             "blocks.0.attn.hook_v": torch.randn(1, seq_len, n_heads, 64, generator=g)}
    del logits, causal
    small = {k: v[:, :, :64, :64] if "pattern" in k else v[:, :64] for k, v in cache.items()}
    out = {"seq_len": seq_len, "n_heads": n_heads,
           "pattern_mib": cache["blocks.0.attn.hook_pattern"].numel() * 4 / 2**20}
    for queries in ("last", "all"):
        tl_geometry.analyze_heads({k: v.contiguous() for k, v in small.items()}, queries=queries,
                                  progress=False)  # compiled kernels loaded before measuring
        base = _rss_mib()
        _reset_peak()
        start = time.perf_counter()
        tl_geometry.analyze_heads(cache, queries=queries, progress=False)
        out[f"{queries}_s"] = time.perf_counter() - start
        peak = _peak_mib()
        if base is not None and peak is not None:
            out[f"{queries}_extra_mib"] = peak - base
            out[f"{queries}_extra_over_pattern"] = (peak - base) / out["pattern_mib"]
    return out


def _in_fresh_process(fn):
    """``fn()`` in a new interpreter: peak memory is not hidden by a heap the earlier phases grew
    (freed memory stays in the allocator, so an allocation that reuses it raises no peak)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn).result()


def _timed(fn, repeats: int) -> tuple[float, list[float], float | None, object]:
    """Minimum time over ``repeats`` runs (the least disturbed: this machine's speed drifts),
    every run's time, the peak resident memory over them, and the last output."""
    times, out = [], None
    _reset_peak()
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), times, _peak_mib(), out


#: (name, queries, options): every setting timed per model; "defaults" first at each query set.
SETTINGS = (
    ("defaults", "last", {}),
    ("no_shuffle", "last", {"shuffle_samples": 0}),
    ("no_baselines", "last", {"random_samples": 0, "shuffle_samples": 0}),
    ("null_norms", "last", {"shuffle": "norms"}),
    ("null_directions", "last", {"shuffle": "directions"}),
    ("null_unselected", "last", {"shuffle": "unselected"}),
    ("defaults", "all", {}),
    ("no_shuffle", "all", {"shuffle_samples": 0}),
    ("no_baselines", "all", {"random_samples": 0, "shuffle_samples": 0}),
)


#: The engine's compiled entry points of an analysis of a cache, timed apart by ``--parts``.
PARTS = (("compiled.score", "score_rows"), ("compiled.check", "check_and_vote"), ("twins.geometry", "band_gram"),
         ("compiled.geometry", "tie_duplicates"), ("compiled.geometry", "sink_geometry"),
         ("compiled.reduce", "reduce_rows"))


@contextlib.contextmanager
def _timing_parts(spent: dict[str, float]):
    """Each function of :data:`PARTS` wrapped, while inside, to add its time to ``spent``: the
    backend looks each one up on its module at every call, so the wrapper is what it calls."""
    saved = []
    for module_name, attr in PARTS:
        module = importlib.import_module(f"tl_geometry.engine.{module_name}")
        inner = getattr(module, attr)

        def timed(*args, _inner=inner, _name=attr, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - start

        saved.append((module, attr, inner))
        setattr(module, attr, timed)
    try:
        yield
    finally:
        for module, attr, inner in saved:
            setattr(module, attr, inner)


def _parts(fn, repeats: int) -> dict[str, float]:
    """Seconds of one call of ``fn`` in each of :data:`PARTS` and in the rest, from the run (of
    ``repeats``) with the shortest total."""
    best: dict[str, float] | None = None
    for _ in range(repeats):
        spent: dict[str, float] = {}
        with _timing_parts(spent):
            start = time.perf_counter()
            fn()
            total = time.perf_counter() - start
        if best is None or total < best["total_s"]:
            best = {"total_s": total, **{f"{name}_s": s for name, s in spent.items()}}
    assert best is not None
    best["rest_s"] = best["total_s"] - sum(s for name, s in best.items() if name != "total_s")
    return best


def _installed(name: str) -> bool:
    """Whether a built-in model's weight packages are installed (loads and assembles nothing)."""
    from tl_geometry.inputs.models import ModelNotInstalledError, model_source

    try:
        model_source(name)
    except ModelNotInstalledError:
        return False
    return True


def _n_values(seq_len: int) -> tuple[int, ...]:
    return tuple(n for n in (1, 2, 4, 8, 16, 32, 64) if n < seq_len)


def _bench_model(name: str, model: Any, text: str | None, args: argparse.Namespace) -> dict:
    """Every setting of :data:`SETTINGS` on one model, each against its own forward pass."""
    import tl_geometry

    sizes = {"last": args.n_seqs, "all": args.all_n_seqs}
    n_values = _n_values(args.seq_len)
    out: dict = {"n_layers": model.cfg.n_layers, "n_heads": model.cfg.n_heads,
                 "seq_len": args.seq_len, "n_seqs": sizes, "n_values": list(n_values)}
    for queries, n_seqs in sizes.items():
        if queries == "all" and args.skip_all:
            continue
        tokens = tl_geometry.text_windows(model, text, n_seqs=n_seqs, seq_len=args.seq_len)

        def forward(tokens=tokens):
            with torch.no_grad():
                return model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)[1]

        forward()  # warm-up
        fwd, fwd_times, fwd_peak, cache = _timed(forward, args.repeats)
        cache = dict(cache.items())
        out[f"forward_{queries}_s"] = fwd
        out[f"forward_{queries}_runs_s"] = fwd_times
        out[f"forward_{queries}_peak_rss_mib"] = fwd_peak
        out[f"cache_{queries}_mib"] = round(sum(t.numel() * t.element_size() for t in cache.values())
                                            / 2**20, 1)
        for setting, q, options in SETTINGS:
            if q != queries:
                continue
            # Warm-up on one layer: each setting's kernels are loaded before it is timed.
            tl_geometry.analyze_heads(cache, n_values=n_values, queries=queries, layers=[0],
                                      progress=False, **options)
            def analysis(c=cache, o=options):
                return tl_geometry.analyze_heads(c, n_values=n_values, queries=queries, progress=False, **o)

            best, runs, peak, _ = _timed(analysis, args.repeats)
            key = f"{queries}_{setting}"
            out[key] = {"s": best, "runs_s": runs, "over_forward": best / fwd, "peak_rss_mib": peak,
                        "options": options}
            print(f"{name}: {key} {best:.3f} s, {best / fwd:.3f}× the forward ({fwd:.2f} s)",
                  file=sys.stderr, flush=True)
            if args.parts and setting == "defaults":
                out[f"{key}_parts"] = _parts(analysis, args.repeats)
                print(f"{name}: {key} by parts {out[f'{key}_parts']}", file=sys.stderr, flush=True)
        del cache
    return out


def _reference_check(model: Any, args: argparse.Namespace, text: str | None) -> dict:
    """The loop reference against the engine on SmolLM2's first layer (last query)."""
    from reference import ref_analyze

    import tl_geometry

    tokens = tl_geometry.text_windows(model, text, n_seqs=args.n_seqs, seq_len=args.seq_len)
    n_values = _n_values(args.seq_len)
    names = ("blocks.0.attn.hook_pattern", "blocks.0.attn.hook_v")
    with torch.no_grad():
        cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)[1]
    layer = {k: cache[k] for k in names}
    pattern = layer[names[0]].double().numpy()
    v = layer[names[1]].double().numpy()
    # The loop reference does top-N / sink-removed / sink / votes; the engine the same work plus
    # one random subset.
    loop, _, _, want = _timed(lambda: ref_analyze(pattern, v, n_values, queries="last"), 1)
    vec, _, _, got = _timed(
        lambda: tl_geometry.analyze_heads(layer, n_values=n_values, queries="last", random_samples=1,
                                          shuffle_samples=0, progress=False),
        args.repeats,
    )
    diff = max(
        float(torch.nan_to_num((got.metric(m, g)[0] - torch.as_tensor(want[f"{g}_{m}"])).abs()).max())
        for g in ("top", "sink_removed", "sink_in", "sink_out")
        for m in ("precision", "recall", "f_score", "margin", "inversions", "precision_cc", "f_score_cc")
    )
    n_layers = model.cfg.n_layers
    return {"reference_loop_one_layer_s": loop, "vectorised_one_layer_s": vec,
            "reference_loop_scaled_to_model_s": loop * n_layers,
            "vectorised_speedup_over_loop": loop / vec, "max_abs_difference_to_reference": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None,
                        help="comma-separated built-in names (default: every installed one)")
    parser.add_argument("--n-seqs", type=int, default=8, help="sequences for the last query")
    parser.add_argument("--all-n-seqs", type=int, default=4, help="sequences for all queries")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-all", action="store_true", help="skip the all-query analysis")
    parser.add_argument("--parts", action="store_true",
                        help="also time every default by the engine's compiled entry points")
    parser.add_argument("--out", default=str(RESULTS / "bench_analyze.json"))
    args = parser.parse_args()

    import tl_geometry
    from tl_geometry.inputs.models import MODELS

    if args.models:
        names = [m.strip() for m in args.models.split(",") if m.strip()]
    else:  # the built-in models that are installed, smallest first; the 1.5B on request
        names = [m for m in ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")
                 if m in MODELS and _installed(m)]
    text, text_name = real_text()
    report = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "processor": platform.processor() or platform.machine()},
        "input": {"text": text_name,
                  "defaults": "queries per setting; SPEC §3's R random subsets and value shuffles (16 at "
                              "the last query, 4 at all queries), N < seq_len from 1, 2, 4, …, 64, "
                              "bounds off"},
        "arithmetic": "float64 (E-form comparisons; numba kernels on CPU)",
        "timing": "minimum over --repeats runs, analysis over the forward pass of the same "
                  "tokens in the same process",
        "models": {},
    }
    smollm2 = None  # kept for the reference check; the other models are freed one by one
    for name in names:
        model = tl_geometry.load_model(name)
        report["models"][name] = _bench_model(name, model, text, args)
        smollm2 = model if name == "smollm2-135m" else smollm2
        del model
    report.update(_reference_check(smollm2 or tl_geometry.load_model("smollm2-135m"), args, text))
    report["long_layer_memory"] = _in_fresh_process(_long_layer_memory)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
