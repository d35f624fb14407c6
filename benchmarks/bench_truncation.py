"""Certified top-N truncation (SPEC §10): does a per-head N beat a uniform N at the same budget?

Two protocols (not run in CI).

``--protocol budget`` (default; the test SPEC §10 asks for). SmolLM2-135M on WikiText-2 test, windows
of ``--seq-len 1024`` tokens: the first ``--cal-seqs`` windows calibrate, the next ``--eval-seqs``
(≥ 32) are held out; the two sets share no token.

1. Held-out windows: the dense loss and the loss of every uniform N of ``--uniform-n``
   (renormalised top-N, every head). The budgets are the uniform N whose loss exceeds the dense
   loss by ≥ ``--min-cost`` nats (0.05), the ``--n-budgets`` largest of them (or ``--budget-n``).
2. Calibration windows: each head's mean tail mass ``τ_h(N)`` for every N = 1 … T, over
   ``--cal-queries`` seeded query positions per window (τ_N = Σ of the weights outside the top N;
   0 for a query with ≤ N keys).
3. At each budget ``B`` = the mean number of keys kept over (head, query) by the uniform N (a query
   with fewer keys than N keeps them all; a windowed layer keeps at most w): a **per-layer** N and a
   **per-head** N, each by greedy on the calibrated curves (start every unit at N = 1; give one more
   key to the unit whose τ drops most per kept key until the budget reaches B; the last step is
   kept or undone, whichever lands nearer B). Each policy's actual budget is reported.
4. Held-out windows: each policy's loss, its paired difference from the uniform N (and per-head
   from per-layer), with the standard error over windows and a 95 % interval from a seeded
   bootstrap over windows (1,000 resamples); the verdict on "per-head beats uniform" is **held**
   when the whole interval is < 0, **not held** when none of it is, **undecided** otherwise (SPEC §8).

The losses are measured with a top-N hook of this script that keeps the same keys as the library's
(``tl_geometry.capacity.top_n_attention``: ties → lower index, renormalised, rows that lose no
weight left bit for bit) but finds each row's N-th and (N + 1)-th weights with ``topk`` /
``kthvalue`` instead of a full stable sort (about 2× cheaper per forward at 1024 tokens on a CPU).
The run checks the two against each other on the first held-out window, under the first budget's
uniform N and per-head policy: the largest difference of the per-token losses (``hook_check`` in
the JSON; 0.0 when the same keys are kept).

``--protocol eps`` (the earlier, smaller run): certified per-head budgets ``k_ε`` of
``analyze_model(queries="all")`` on the calibration windows (``TopNPolicy.from_result``) against the
nearest uniform N; defaults 64-token windows, 4 calibration and 8 held-out windows; optional per-head
correlation (``--corr-n``).

    python benchmarks/bench_truncation.py [--protocol budget] [--seq-len 1024] [--cal-seqs 16]
        [--eval-seqs 32] [--cal-queries 256] [--uniform-n 16,32,64] [--min-cost 0.05]
        [--n-budgets 2 | --budget-n 8,16] [--threads 1] [--out benchmarks/results/bench_truncation.json]
    python benchmarks/bench_truncation.py --protocol eps [--seq-len 64] [--cal-seqs 4] [--eval-seqs 8]
        [--n-values 1,2,4,8,16,32] [--eps 0.01,0.05,0.1,0.2,0.3] [--corr-n 4]
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from collections.abc import Sequence

import torch
from _common import RESULTS, real_text, write_report

PATTERN_HOOK = "blocks.{layer}.attn.hook_pattern"
#: Below this N the N-th and (N + 1)-th largest weights of a row come from ``topk``, else ``kthvalue``.
TOPK_LIMIT = 256


# --- pure functions: budgets, calibration curves, greedy allocation (tests/demos/test_policy_budget.py)
def kept_curve(n_pos: int, window: int | None = None) -> torch.Tensor:
    """``c[N − 1]`` for N = 1 … ``n_pos``: the mean over the queries ``t = 0 … n_pos − 1`` of an
    unpadded window of the keys one head keeps, ``min(N, t + 1, w)`` (SPEC §10's budget)."""
    if n_pos < 1:
        raise ValueError(f"n_pos must be ≥ 1, got {n_pos}.")
    keys = torch.arange(1, n_pos + 1, dtype=torch.float64)  # query t sees t + 1 keys ...
    if window is not None:
        keys = keys.clamp_max(window)  # ... or w on a windowed layer
    n = torch.arange(1, n_pos + 1, dtype=torch.float64)
    return torch.minimum(n[:, None], keys[None, :]).mean(1)


def policy_budget(n: torch.Tensor, n_pos: int, windows: Sequence[int | None] | None = None) -> float:
    """Mean kept keys over (head, query) of a ``[layer, head]`` policy (0 or N ≥ keys: every key)."""
    n_layers = n.shape[0]
    windows = list(windows) if windows is not None else [None] * n_layers
    total = 0.0
    for layer in range(n_layers):
        curve = kept_curve(n_pos, windows[layer])
        limit = torch.where(n[layer] > 0, n[layer], n_pos).clamp(1, n_pos)
        total += float(curve[limit - 1].sum())
    return total / n.numel()


def tail_mass_curve(rows: torch.Tensor) -> torch.Tensor:
    """``τ[..., N − 1]`` = Σ of each attention row's weights outside its top N, for N = 1 … keys
    (float64; exactly 0 once the top N hold every positive weight). ``rows`` is ``[..., key]``."""
    ranked = torch.sort(rows.double(), dim=-1, descending=True).values.cumsum(-1)
    return (ranked[..., -1:] - ranked).clamp_min(0.0)


def greedy_allocation(tau: torch.Tensor, cost: torch.Tensor, target: float) -> tuple[torch.Tensor, float]:
    """One N per unit (a head, or a layer of heads), greedy on calibrated tail-mass curves.

    ``tau[u, N − 1]`` is unit ``u``'s tail mass at ``N`` and ``cost[u, N − 1]`` the keys it keeps
    at ``N`` (summed over its heads), for N = 1 … ``tau.shape[1]``. Every unit starts at N = 1; the
    step ``N → N + 1`` that lowers τ most per added kept key is taken (ties → the lower unit), until
    the summed cost reaches ``target``; the last step is kept or undone, whichever leaves the sum
    nearer ``target``. Steps that add no kept key (every query already keeps all its keys) are never
    taken. Returns the N per unit (int64) and the summed cost.
    """
    if tau.shape != cost.shape or tau.ndim != 2:
        raise ValueError(f"tau and cost must both be [unit, N], got {tuple(tau.shape)} and {tuple(cost.shape)}.")
    tau, cost = tau.double(), cost.double()
    n_units = tau.shape[0]
    gain = tau[:, :-1] - tau[:, 1:]          # [unit, N − 1]: τ drop of the step N → N + 1
    extra = cost[:, 1:] - cost[:, :-1]       # kept keys the step adds
    ratio = torch.where(extra > 0, gain / extra.clamp_min(1e-300), -math.inf)
    ratio = torch.cat([ratio, torch.full((n_units, 1), -math.inf, dtype=torch.float64)], 1)
    n = torch.zeros(n_units, dtype=torch.long)  # index N − 1
    total = float(cost[:, 0].sum())
    units = torch.arange(n_units)
    if total >= target:
        return n + 1, total
    while True:
        current = ratio[units, n]
        best = int(torch.argmax(current))   # the first maximum: ties → the lower unit
        if current[best] == -math.inf:
            break                            # every unit keeps every key: the target is out of reach
        before = total
        total += float(extra[best, n[best]])
        n[best] += 1
        if total >= target:
            if target - before < total - target:  # undoing the last step lands nearer
                n[best] -= 1
                total = before
            break
    return n + 1, total


def allocate(tau: torch.Tensor, n_pos: int, budget: float, by: str,
             windows: Sequence[int | None] | None = None) -> tuple[torch.Tensor, float]:
    """A ``[layer, head]`` policy (N ≥ 1 per head) whose mean kept keys over (head, query) is as
    near ``budget`` as the greedy allows: one N per head (``by="head"``) or one per layer
    (``by="layer"``, greedy on the layer's summed τ), from ``tau [layer, head, N − 1]``
    (N = 1 … ``n_pos``). Returns the policy and its budget."""
    n_layers, n_heads, n_max = tau.shape
    windows = list(windows) if windows is not None else [None] * n_layers
    curves = torch.stack([kept_curve(n_pos, w)[:n_max] for w in windows])  # [layer, N]
    cost = curves[:, None, :].expand(n_layers, n_heads, n_max)
    target = budget * n_layers * n_heads
    if by == "head":
        n, total = greedy_allocation(tau.reshape(-1, n_max), cost.reshape(-1, n_max), target)
        n = n.reshape(n_layers, n_heads)
    elif by == "layer":
        n, total = greedy_allocation(tau.sum(1), cost.sum(1), target)
        n = n[:, None].expand(n_layers, n_heads).clone()
    else:
        raise ValueError(f"by must be 'head' or 'layer', got {by!r}.")
    return n, total / (n_layers * n_heads)


def paired(values: torch.Tensor, other: torch.Tensor, *, resamples: int = 1000, seed: int = 0) -> dict:
    """Mean of ``values − other`` over windows, its standard error and a 95 % percentile interval
    from a seeded bootstrap over windows."""
    diff = (values - other).double()
    k = len(diff)
    se = float(diff.std(unbiased=True) / math.sqrt(k)) if k > 1 else math.nan
    gen = torch.Generator().manual_seed(seed)
    means = diff[torch.randint(0, k, (resamples, k), generator=gen)].mean(1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"mean": float(diff.mean()), "se": se, "ci95": [lo, hi]}


def verdict(ci: Sequence[float]) -> str:
    """SPEC §8 for the rule "difference < 0": held / not held / undecided by the interval."""
    lo, hi = ci
    if hi < 0:
        return "held"
    if lo >= 0:
        return "not held"
    return "undecided"


# --- the top-N hook (the same keys as the library's, without a full sort) --------------------------
def _cut(pattern: torch.Tensor, n: int) -> torch.Tensor:
    """Renormalised top-``n`` of every row of ``pattern [..., query, key]``: the library's
    ``sparsify_pattern(pattern, n)`` (ties → lower index, rows that lose no weight unchanged).

    The ``n``-th and ``(n + 1)``-th largest weights of each row decide everything: the top ``n``
    are the weights ≥ the ``n``-th unless the two are equal (a tie across the cut: then the lower
    indices among the tied keys are kept), and a row loses positive weight iff the ``(n + 1)``-th
    is > 0 (future keys carry weight 0)."""
    n_key = pattern.shape[-1]
    if n >= n_key:
        return pattern
    if n < TOPK_LIMIT:
        top = torch.topk(pattern, n + 1, dim=-1, sorted=True).values
        nth, next_ = top[..., n - 1 : n], top[..., n : n + 1]
    else:
        nth = torch.kthvalue(pattern, n_key - n + 1, dim=-1, keepdim=True).values
        next_ = torch.kthvalue(pattern, n_key - n, dim=-1, keepdim=True).values
    dropped = next_ > 0
    if bool((dropped & (next_ == nth)).any()):  # a tie across the cut: lower index wins
        above, tied = pattern > nth, pattern == nth
        keep = above | (tied & (tied.cumsum(-1) <= n - above.sum(-1, keepdim=True)))
    else:
        keep = pattern >= nth
    kept = torch.where(keep, pattern, torch.zeros((), dtype=pattern.dtype))
    kept = kept / kept.sum(-1, keepdim=True)
    return torch.where(dropped, kept, pattern)


def topn_hooks(n: torch.Tensor) -> list:
    """``(hook_name, fn)`` per layer for a ``[layer, head]`` policy (0: the head keeps every key)."""
    hooks = []
    for layer in range(n.shape[0]):
        row = n[layer]
        if not bool((row > 0).any()):
            continue
        groups = {int(v): (row == v).nonzero().flatten() for v in row.unique().tolist() if v > 0}

        def hook(pattern, hook=None, groups=groups):
            if len(groups) == 1 and len(next(iter(groups.values()))) == pattern.shape[1]:
                return _cut(pattern, next(iter(groups)))  # one N for every head of the layer
            out = pattern.clone()
            for value, heads in groups.items():
                out[:, heads] = _cut(pattern[:, heads], value)
            return out

        hooks.append((PATTERN_HOOK.format(layer=layer), hook))
    return hooks


@torch.no_grad()
def window_losses(model, tokens: torch.Tensor, hooks: list | None = None) -> torch.Tensor:
    """Mean next-token loss of every window (float64), one window per forward."""
    out = []
    for row in tokens:
        per_token = model.run_with_hooks(row[None], fwd_hooks=hooks or [], return_type="loss",
                                         loss_per_token=True)
        out.append(per_token.double().mean())
    return torch.stack(out).cpu()


@torch.no_grad()
def calibrate(model, tokens: torch.Tensor, n_queries: int, seed: int = 0) -> tuple[torch.Tensor, list]:
    """Mean tail mass ``τ[layer, head, N − 1]`` (N = 1 … T) over ``n_queries`` seeded query positions
    of every window (0 where a query has ≤ N keys), and the positions."""
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    n_pos = tokens.shape[1]
    gen = torch.Generator().manual_seed(seed)
    sums = torch.zeros(n_layers, n_heads, n_pos, dtype=torch.float64)
    positions = []
    for row in tokens:
        chosen = torch.randperm(n_pos, generator=gen)[:n_queries].sort().values
        positions.append(chosen.tolist())

        def hook(pattern, hook, chosen=chosen):
            layer = int(hook.name.split(".")[1])
            sums[layer] += tail_mass_curve(pattern[0][:, chosen]).sum(1)
            return pattern

        model.run_with_hooks(row[None], fwd_hooks=[(lambda name: name.endswith("hook_pattern"), hook)],
                             return_type=None)
    return sums / (len(tokens) * min(n_queries, n_pos)), positions


def _machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "processor": platform.processor() or platform.machine()}


def run_budget(args) -> None:
    import tl_geometry
    from tl_geometry.capacity import TopNPolicy, top_n_attention
    from tl_geometry.inputs.capture import model_windows

    start = time.perf_counter()
    seq_len = args.seq_len or 1024
    cal_seqs = args.cal_seqs or 16
    eval_seqs = args.eval_seqs or 32
    uniform_n = [int(x) for x in args.uniform_n.split(",")]
    text, text_name = _text(args)
    model = tl_geometry.load_model(args.model)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    windows = model_windows(model) or [None] * n_layers
    tokens = tl_geometry.text_windows(model, text, n_seqs=cal_seqs + eval_seqs, seq_len=seq_len)
    calibration, held_out = tokens[:cal_seqs], tokens[cal_seqs:]
    timings: dict[str, float] = {}
    machine = _machine()
    log = lambda msg: print(f"[{time.perf_counter() - start:7.1f} s] {msg}", flush=True)  # noqa: E731

    # 1. The uniform curve on the held-out windows.
    t0 = time.perf_counter()
    dense = window_losses(model, held_out)
    timings["dense"] = time.perf_counter() - t0
    log(f"dense: {float(dense.mean()):.4f} ({timings['dense'] / eval_seqs:.1f} s / window)")
    losses: dict[str, torch.Tensor] = {"dense": dense}
    uniform = {}
    for n in uniform_n:
        t0 = time.perf_counter()
        policy = torch.full((n_layers, n_heads), n, dtype=torch.long)
        losses[f"uniform N={n}"] = window_losses(model, held_out, topn_hooks(policy))
        timings[f"uniform N={n}"] = time.perf_counter() - t0
        uniform[str(n)] = {"budget": policy_budget(policy, seq_len, windows),
                           "loss": float(losses[f"uniform N={n}"].mean()),
                           "minus_dense": paired(losses[f"uniform N={n}"], dense, resamples=args.resamples)}
        log(f"uniform N={n}: budget {uniform[str(n)]['budget']:.3f}, loss {uniform[str(n)]['loss']:.4f}, "
            f"+{uniform[str(n)]['minus_dense']['mean']:.4f} ({timings[f'uniform N={n}'] / eval_seqs:.1f} s / window)")
    if args.budget_n:
        budget_n = [int(x) for x in args.budget_n.split(",")]
        missing = [n for n in budget_n if str(n) not in uniform]
        if missing:
            raise SystemExit(f"--budget-n {missing} must be in --uniform-n.")
    else:
        costly = [n for n in uniform_n if uniform[str(n)]["minus_dense"]["mean"] >= args.min_cost]
        budget_n = sorted(costly)[-args.n_budgets:]
    log(f"budgets: uniform N = {budget_n} (uniform costs ≥ {args.min_cost} nats at N ∈ "
        f"{[n for n in uniform_n if uniform[str(n)]['minus_dense']['mean'] >= args.min_cost]})")

    # 2. Calibration: each head's mean τ_h(N), N = 1 … T.
    t0 = time.perf_counter()
    tau, positions = calibrate(model, calibration, args.cal_queries, seed=args.seed)
    timings["calibration"] = time.perf_counter() - t0
    log(f"calibration: {cal_seqs} windows × {args.cal_queries} queries ({timings['calibration']:.0f} s)")

    # 3. Budget-matched policies, 4. their held-out losses.
    rows = []
    hook_check = None
    for n_u in budget_n:
        budget = uniform[str(n_u)]["budget"]
        row = {"uniform_n": n_u, "budget": budget, "dense_loss": float(dense.mean()),
               "uniform": {"budget": budget, "loss": uniform[str(n_u)]["loss"],
                           "minus_dense": uniform[str(n_u)]["minus_dense"]}}
        for by in ("layer", "head"):
            n, actual = allocate(tau[..., :seq_len], seq_len, budget, by, windows)
            name = f"per-{by} B={n_u}"
            if hook_check is None and by == "head":
                hook_check = _hook_check(model, held_out[:1], top_n_attention, TopNPolicy, n, n_u)
                log(f"hook check against top_n_attention: {hook_check}")
            t0 = time.perf_counter()
            losses[name] = window_losses(model, held_out, topn_hooks(n))
            timings[name] = time.perf_counter() - t0
            row[f"per_{by}"] = {
                "budget": actual, "loss": float(losses[name].mean()),
                "minus_dense": paired(losses[name], dense, resamples=args.resamples),
                "minus_uniform": paired(losses[name], losses[f"uniform N={n_u}"], resamples=args.resamples),
                "n_min": int(n.min()), "n_median": float(n.double().median()), "n_max": int(n.max()),
                "calibrated_tau_sum": float(tau.gather(2, (n - 1)[..., None]).sum()),
                "n": n.tolist() if by == "head" else n[:, 0].tolist(),  # [layer][head] / [layer]
            }
            log(f"{name}: budget {actual:.3f}, loss {row[f'per_{by}']['loss']:.4f}, − uniform "
                f"{row[f'per_{by}']['minus_uniform']['mean']:+.4f} ± {row[f'per_{by}']['minus_uniform']['se']:.4f}")
        row["uniform"]["calibrated_tau_sum"] = float(tau[..., n_u - 1].sum())
        head_minus_layer = paired(losses[f"per-head B={n_u}"], losses[f"per-layer B={n_u}"], resamples=args.resamples)
        row["per_head_minus_per_layer"] = head_minus_layer
        row["verdicts"] = {
            "per-head beats uniform": verdict(row["per_head"]["minus_uniform"]["ci95"]),
            "per-layer beats uniform": verdict(row["per_layer"]["minus_uniform"]["ci95"]),
            "per-head beats per-layer": verdict(head_minus_layer["ci95"]),
        }
        log(f"B={n_u}: {row['verdicts']}")
        rows.append(row)

    # Last (its compiled kernels may reset torch's thread count): the library's τ_N on the same queries.
    library_check = _library_tau_check(tl_geometry, model, calibration[:1], positions[0], (2, 8, 32))
    torch.set_num_threads(args.threads or torch.get_num_threads())
    log(f"τ check against analyze_model: max |Δ| {library_check['max_abs_diff']:.2e}")

    report = {
        "protocol": "budget",
        "machine": machine,
        "input": {"model": args.model, "text": text_name, "seq_len": seq_len, "cal_seqs": cal_seqs,
                  "eval_seqs": eval_seqs, "cal_windows": [0, cal_seqs],
                  "eval_windows": [cal_seqs, cal_seqs + eval_seqs], "cal_queries": args.cal_queries,
                  "seed": args.seed, "uniform_n": uniform_n, "min_cost": args.min_cost, "budget_n": budget_n,
                  "mode": "renormalize", "tau": "mean over sampled queries (0 where a query has ≤ N keys)",
                  "resamples": args.resamples, "layer_windows": windows},
        "dense_loss": float(dense.mean()),
        "uniform": uniform,
        "budgets": rows,
        "calibration": {"mean_tau_median_over_heads": {str(n): float(tau[..., n - 1].median())
                                                       for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= seq_len},
                        "library_check": library_check},
        "hook_check": hook_check,
        "window_losses": {name: value.tolist() for name, value in losses.items()},
        "seconds": timings,
        "total_s": time.perf_counter() - start,
    }
    write_report(report, args.out or RESULTS / "bench_truncation.json")


def _library_tau_check(tl_geometry, model, window, positions, check_n) -> dict:
    """Mean τ_N of ``analyze_model`` (the library's truncation metric) on one calibration window at
    the last 32 of its sampled queries with more than max(N) keys, against this script's on the
    same queries."""
    chosen = [p for p in positions if p + 1 > max(check_n)][-32:]
    result = tl_geometry.analyze_model(model, window, n_values=check_n, queries=tuple(chosen),
                                       random_samples=0, shuffle_samples=0, progress=False)
    library = result.metric("tail_mass")  # [layer, head, n]
    mine = torch.zeros_like(library)

    def hook(pattern, hook):
        layer = int(hook.name.split(".")[1])
        curve = tail_mass_curve(pattern[0][:, chosen]).mean(1)
        mine[layer] = torch.stack([curve[:, n - 1] for n in check_n], -1).to(mine.dtype)
        return pattern

    with torch.no_grad():
        model.run_with_hooks(window, fwd_hooks=[(lambda name: name.endswith("hook_pattern"), hook)],
                             return_type=None)
    return {"n": list(check_n), "queries": len(chosen), "max_abs_diff": float((library - mine).abs().max())}


def _hook_check(model, window, top_n_attention, TopNPolicy, n_head, n_uniform) -> dict:
    """Per-token losses of one window under the library's hook and this script's, for a uniform N
    and a per-head policy: the largest difference (0 when the same keys are kept)."""
    out = {}
    for name, n in (("uniform", torch.full_like(n_head, n_uniform)), ("per_head", n_head)):
        with torch.no_grad():
            with top_n_attention(model, TopNPolicy(n)):
                library = model(window, return_type="loss", loss_per_token=True)
            fast = model.run_with_hooks(window, fwd_hooks=topn_hooks(n), return_type="loss", loss_per_token=True)
        out[name] = float((library - fast).abs().max())
    return out


# --- the earlier protocol: certified budgets k_ε against the nearest uniform N ---------------------
def _window_losses(model, tokens: torch.Tensor, hooks=None) -> torch.Tensor:
    """Mean next-token loss of every window (float64), under ``hooks`` if given."""
    with torch.no_grad():
        if hooks is None:
            per_token = model(tokens, return_type="loss", loss_per_token=True)
        else:
            with hooks:
                per_token = model(tokens, return_type="loss", loss_per_token=True)
    return per_token.double().mean(-1).cpu()


def _compare(losses: torch.Tensor, other: torch.Tensor) -> dict:
    """Mean loss of ``losses``, and its paired difference from ``other`` with the standard error."""
    diff = losses - other
    se = float(diff.std(unbiased=True) / math.sqrt(len(diff))) if len(diff) > 1 else math.nan
    return {"loss": float(losses.mean()), "minus": float(diff.mean()), "se": se}


def _nearest_uniform(target: float, n_pos: int, n_layers: int, n_heads: int) -> tuple[int, float]:
    """The integer N whose uniform policy keeps the number of keys nearest ``target`` (ties → the
    smaller N), with that number."""
    from tl_geometry.capacity import TopNPolicy

    best = None
    for n in range(1, n_pos + 1):
        kept = TopNPolicy.uniform(n, n_layers, n_heads).kept_keys(n_pos)
        if best is None or abs(kept - target) < abs(best[1] - target):
            best = (n, kept)
        if kept > target:
            break
    assert best is not None
    return best


def _text(args) -> tuple[str | None, str]:
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            return f.read(), args.text.rsplit("/", 1)[-1]
    return real_text()


def run_eps(args) -> None:
    import tl_geometry
    from tl_geometry.capacity import TopNPolicy, top_n_attention

    seq_len = args.seq_len or 64
    cal_seqs = args.cal_seqs or 4
    eval_seqs = args.eval_seqs or 8
    n_values = tuple(int(x) for x in args.n_values.split(","))
    eps_values = tuple(float(x) for x in args.eps.split(","))
    start = time.perf_counter()
    text, text_name = _text(args)
    model = tl_geometry.load_model(args.model)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    windows = tl_geometry.text_windows(model, text, n_seqs=cal_seqs + eval_seqs, seq_len=seq_len)
    calibration, held_out = windows[:cal_seqs], windows[cal_seqs:]

    t0 = time.perf_counter()
    result = tl_geometry.analyze_model(model, calibration, n_values=n_values, queries="all",
                                       random_samples=0, shuffle_samples=0, progress=False)
    analyze_s = time.perf_counter() - t0
    p90 = result.truncation_percentile("tail_mass")  # [layer, head, n]
    print(f"analyze_model over {calibration.shape[0]}×{seq_len} tokens, every query: {analyze_s:.1f} s",
          flush=True)

    dense = _window_losses(model, held_out)
    uniform = {}
    for n in n_values:
        losses = _window_losses(model, held_out, top_n_attention(model, n))
        kept = TopNPolicy.uniform(n, n_layers, n_heads).kept_keys(seq_len)
        uniform[str(n)] = {"kept_keys": kept, **_compare(losses, dense)}
        print(f"uniform N={n:>3}: kept {kept:6.2f} keys, loss {uniform[str(n)]['loss']:.4f}", flush=True)

    policies = []
    for eps in eps_values:
        policy = TopNPolicy.from_result(result, eps, n_layers=n_layers)
        budgets = policy.n[policy.mask]
        row: dict = {"eps": eps, "dense_heads": int((~policy.mask).sum()),
                     "budget_counts": {str(n): int((budgets == n).sum()) for n in n_values},
                     "kept_keys": policy.kept_keys(seq_len)}
        if policy.mask.any():
            losses = _window_losses(model, held_out, top_n_attention(model, policy))
            n_match, kept_match = _nearest_uniform(row["kept_keys"], seq_len, n_layers, n_heads)
            matched = _window_losses(model, held_out, top_n_attention(model, n_match))
            row.update(policy=_compare(losses, dense), uniform_n=n_match, uniform_kept_keys=kept_match,
                       uniform=_compare(matched, dense), policy_minus_uniform=_compare(losses, matched))
            print(f"ε={eps}: {row['dense_heads']} dense heads, kept {row['kept_keys']:.2f} keys, loss "
                  f"{row['policy']['loss']:.4f}; uniform N={n_match} (kept {kept_match:.2f}) "
                  f"{row['uniform']['loss']:.4f}; policy − uniform {row['policy_minus_uniform']['minus']:+.4f} "
                  f"± {row['policy_minus_uniform']['se']:.4f}", flush=True)
        else:
            row["policy"] = {"loss": float(dense.mean()), "minus": 0.0, "se": 0.0}
            print(f"ε={eps}: no head certified: the policy is the dense model", flush=True)
        policies.append(row)

    correlation = None
    if args.corr_n:
        corr_tokens = tl_geometry.text_windows(model, text, n_seqs=cal_seqs + eval_seqs + args.corr_seqs,
                                               seq_len=args.corr_seq_len)[-args.corr_seqs:]
        t0 = time.perf_counter()
        corr = tl_geometry.capacity.capacity_correlation(model, corr_tokens, args.corr_n)
        correlation = {"n": args.corr_n, "tokens": list(corr_tokens.shape), "rho": corr.rho,
                       "seconds": time.perf_counter() - t0,
                       "mean_scores": {k: float(v.nanmean()) for k, v in corr.scores.items()},
                       "summary": corr.summary()}
        print(corr.summary(), flush=True)

    report = {
        "protocol": "eps",
        "machine": _machine(),
        "input": {"model": args.model, "text": text_name, "seq_len": seq_len, "cal_seqs": cal_seqs,
                  "eval_seqs": eval_seqs, "n_values": list(n_values), "eps": list(eps_values),
                  "mode": "renormalize", "queries": "all"},
        "analyze_s": analyze_s,
        "p90_tail_mass_median_over_heads": {str(n): float(p90[..., i].nanmedian()) for i, n in enumerate(n_values)},
        "dense_loss": float(dense.mean()),
        "uniform": uniform,
        "policies": policies,
        "correlation": correlation,
        "total_s": time.perf_counter() - start,
    }
    write_report(report, args.out or RESULTS / "bench_truncation_eps.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", choices=("budget", "eps"), default="budget")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--text", help="plain-text file (default: WikiText-2 test if present)")
    parser.add_argument("--seq-len", type=int, help="window length (budget: 1024, eps: 64)")
    parser.add_argument("--cal-seqs", type=int, help="calibration windows (budget: 16, eps: 4)")
    parser.add_argument("--eval-seqs", type=int, help="held-out windows (budget: 32, eps: 8)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--out", help="JSON report (budget: results/bench_truncation.json, "
                                      "eps: results/bench_truncation_eps.json)")
    budget = parser.add_argument_group("--protocol budget")
    budget.add_argument("--cal-queries", type=int, default=256, help="sampled queries per calibration window")
    budget.add_argument("--seed", type=int, default=0)
    budget.add_argument("--uniform-n", default="16,32,64", help="uniform N curve on the held-out windows")
    budget.add_argument("--min-cost", type=float, default=0.05, help="a budget's uniform N must cost ≥ this (nats)")
    budget.add_argument("--n-budgets", type=int, default=2, help="the largest N of those that do")
    budget.add_argument("--budget-n", help="the budgets' uniform N instead (each in --uniform-n)")
    budget.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples over windows")
    eps = parser.add_argument_group("--protocol eps")
    eps.add_argument("--n-values", default="1,2,4,8,16,32")
    eps.add_argument("--eps", default="0.01,0.05,0.1,0.2,0.3")
    eps.add_argument("--corr-n", type=int, default=4, help="N of capacity_correlation (0: skip it)")
    eps.add_argument("--corr-seqs", type=int, default=2)
    eps.add_argument("--corr-seq-len", type=int, default=48)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    (run_budget if args.protocol == "budget" else run_eps)(args)


if __name__ == "__main__":
    main()
