"""Long contexts: the pattern path against the recompute path, each in a fresh process.

For each model and length T, one window (``--n-seqs``) of T tokens of real text (WikiText-2 test when
../shared/data has it) is analysed at the last query of every layer by
``analyze_model(attention="pattern")`` (eager attention, ``hook_pattern``) and by
``analyze_model(attention="recompute")`` (SDPA forward, rows recomputed from the captured queries
and keys). Each run is a fresh process, so its peak RSS is its own: the model load, the forward
and the analysis. A plain SDPA forward of the base model (no hooks, no logits) in the same
process gives the ratio. ``engine_s`` is the time spent in the engine alone (every layer's rows
read or recomputed, checked, voted and scored; the forward excluded): the recompute path's
against the pattern path's is issue 26's bound (≤ 1.5× at T = 1024). On the recompute path,
``capture_s`` is its forward with all that runs inside it, of which ``first_keys_s`` reads the
first 32 keys' attention (the sink check, or the choice of ``sink="auto"``) and ``stash_s``
keeps the captures until the sinks are chosen (``sink="auto"``).

    python benchmarks/bench_long_context.py [--models smollm2-135m,gemma3-270m] [--lengths 1024,2048]
        [--paths pattern,recompute] [--n-seqs 1] [--queries last|K] [--timeout 1800]
        [--out benchmarks/results/bench_long_context.json]

Lengths above a model's context are skipped. A run that fails or passes ``--timeout`` is
recorded with its error, so the table says what does not fit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _common import RESULTS, ROOT, real_text, write_report

CHILD = r"""
import json, resource, sys, time, torch
sys.path.insert(0, {root!r})
import tl_geometry
from tl_geometry.inputs.capture import capture_attention
torch.set_grad_enabled(False)
name, T, path, n_seqs, queries = {name!r}, {length}, {path!r}, {n_seqs}, {queries!r}
t0 = time.perf_counter()
model = tl_geometry.load_model(name)
if T > model.cfg.n_ctx:
    print(json.dumps(dict(error=f"above the model's context of {{model.cfg.n_ctx}} tokens")))
    sys.exit(0)
text = open({text!r}, encoding="utf-8").read() if {text!r} else None
tokens = tl_geometry.text_windows(model, text, n_seqs=n_seqs, seq_len=T)
loaded = time.perf_counter()
capture_attention(model, tokens, lambda c: None)  # the plain SDPA forward: no analysis, no logits
forward = time.perf_counter()
from tl_geometry.analyze import from_model, sink, stash
parts = dict(engine_s=0.0, capture_s=0.0, first_keys_s=0.0, stash_s=0.0)
def timed(owner, name, part):
    inner = getattr(owner, name)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            parts[part] += time.perf_counter() - start
    setattr(owner, name, wrapper)
# engine: every layer's rows read (or recomputed), checked, voted and scored; capture: the
# recompute path's forward with everything its layers do inside it (the first 32 keys' columns
# for the sink, the captures kept for sink="auto"), each of those also on its own.
timed(from_model, "analyze_layer", "engine_s")
timed(from_model, "capture_attention", "capture_s")
timed(sink, "first_keys_mass", "first_keys_s")
timed(stash.CaptureStash, "keep", "stash_s")
result = tl_geometry.analyze_model(model, tokens, attention=path, queries=queries, progress=False)
done = time.perf_counter()
assert len(result.layers) == model.cfg.n_layers
print(json.dumps(dict(load_s=loaded - t0, sdpa_forward_s=forward - loaded, analyze_model_s=done - forward,
                      **parts, sink=result.metadata["sink"]["rule"],
                      peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                      labelled=sum(x is not None for row in result.labels for x in row))))
"""


def run(name: str, length: int, path: str, text: str | None, timeout: float, n_seqs: int = 1,
        queries: str | int = "last") -> dict:
    code = CHILD.format(root=str(ROOT), name=name, length=length, path=path, text=text or "", n_seqs=n_seqs,
                        queries=queries)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300], "wall_s": time.perf_counter() - start}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "error" in out:
        return out
    out["analysis_over_forward"] = out["analyze_model_s"] / out["sdpa_forward_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--paths", default="pattern,recompute")
    parser.add_argument("--n-seqs", type=int, default=1, help="windows per run (the Qwen models: 8 × 256)")
    parser.add_argument("--queries", default="last",
                        help="the queries scored: last (default), or K for a seeded sample of K per window")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=str(RESULTS / "bench_long_context.json"))
    args = parser.parse_args()
    text, source = real_text()
    text_path = str(ROOT.parent / "shared" / "data" / "wikitext-2-test.txt") if text is not None else None
    queries = int(args.queries) if args.queries.isdigit() else args.queries
    protocol = "last query" if queries == "last" else f"{queries} sampled queries per window"
    report: dict = {"text": source, "protocol": f"{protocol}, every layer, defaults", "runs": []}
    for name in args.models.split(","):
        for length in map(int, args.lengths.split(",")):
            for path in args.paths.split(","):
                row = {"model": name, "n_seqs": args.n_seqs, "T": length, "path": path, "queries": queries,
                       **run(name, length, path, text_path, args.timeout, args.n_seqs, queries)}
                print(json.dumps(row), file=sys.stderr)
                report["runs"].append(row)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
